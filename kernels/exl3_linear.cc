#include "kernels/exl3_linear.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_tile.h"

namespace exl3 {

absl::Status ValidateLinear(const Exl3LinearView& w) {
  if (w.bits < 1 || w.bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat("EXL3 bit width ", w.bits, " is not in 1..8"));
  }
  if (w.in_features <= 0 || w.in_features % 128 != 0 || w.out_features <= 0 ||
      w.out_features % 128 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("EXL3 layer shape ", w.in_features, "x",
                                                   w.out_features,
                                                   " is not a positive multiple of 128"));
  }
  if (w.trellis == nullptr || w.suh == nullptr || w.svh == nullptr) {
    return absl::InvalidArgumentError("EXL3 layer lacks trellis, suh or svh");
  }
  return absl::OkStatus();
}

std::vector<uint16_t> UnpackSigns(const uint16_t* packed, size_t num_words) {
  std::vector<uint16_t> out(num_words * 16);
  for (size_t j = 0; j < num_words; ++j) {
    for (int i = 0; i < 16; ++i) out[j * 16 + i] = ((packed[j] >> i) & 1) ? 0xbc00 : 0x3c00;
  }
  return out;
}

void DequantizeInner(const Exl3LinearView& w, uint16_t* out) {
  const int n = w.out_features;
  uint16_t tile[kTileElems];
  for (int i = 0; i < w.in_features / 16; ++i) {
    for (int j = 0; j < n / 16; ++j) {
      DecodeTileHalf(w.tile(i, j), w.bits, w.codebook, tile);
      for (int r = 0; r < 16; ++r) {
        std::memcpy(out + static_cast<size_t>(16 * i + r) * n + 16 * j, tile + 16 * r, 32);
      }
    }
  }
}

void DequantizeDense(const Exl3LinearView& w, float* out) {
  const int k = w.in_features, n = w.out_features;
  std::vector<uint16_t> inner(static_cast<size_t>(k) * n);
  DequantizeInner(w, inner.data());
  for (size_t i = 0; i < inner.size(); ++i) out[i] = HalfBitsToFloat(inner[i]);
  // H on the left: each column, per 128-block of rows.
  for (int rb = 0; rb < k; rb += kHadamardBlock) {
    for (int c = 0; c < n; ++c) Hadamard128Strided(out + static_cast<size_t>(rb) * n + c, n);
  }
  // H on the right: each row.
  for (int r = 0; r < k; ++r) HadamardBlocks(out + static_cast<size_t>(r) * n, n);
  for (int r = 0; r < k; ++r) {
    const float su = HalfBitsToFloat(w.suh[r]);
    float* row = out + static_cast<size_t>(r) * n;
    for (int c = 0; c < n; ++c) row[c] *= su * HalfBitsToFloat(w.svh[c]);
  }
}

namespace {

// fp32 copies of a layer's fp16 vectors, converted once per call (not per token): per-thread
// scratch, so the transforms allocate nothing after a thread's first call.
float* ScaleScratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

}  // namespace

void ApplyInputTransform(const Exl3LinearView& w, const float* x, int num_tokens, float* x_out) {
  const int k = w.in_features;
  const HadamardKernels& hk = ActiveHadamardKernels();
  float* suh = ScaleScratch(k);
  hk.half_to_float(w.suh, suh, k);
  // Per element: x * suh rounded to fp32, then the Hadamard butterflies (as the scalar code).
  for (int t = 0; t < num_tokens; ++t) {
    const float* src = x + static_cast<size_t>(t) * k;
    float* dst = x_out + static_cast<size_t>(t) * k;
    for (int b = 0; b < k; b += kHadamardBlock) hk.scale_hadamard128(src + b, suh + b, dst + b);
  }
}

void ApplyOutputTransform(const Exl3LinearView& w, float* y, int num_tokens) {
  const int n = w.out_features;
  const HadamardKernels& hk = ActiveHadamardKernels();
  float* svh = ScaleScratch(2 * static_cast<size_t>(n));
  float* bias = nullptr;
  hk.half_to_float(w.svh, svh, n);
  if (w.bias != nullptr) {
    bias = svh + n;
    hk.half_to_float(w.bias, bias, n);
  }
  // Per element: Hadamard, times svh (rounded), plus bias (rounded): never one fma.
  for (int t = 0; t < num_tokens; ++t) {
    float* row = y + static_cast<size_t>(t) * n;
    for (int b = 0; b < n; b += kHadamardBlock) {
      hk.hadamard128_scale_bias(row + b, svh + b, bias != nullptr ? bias + b : nullptr);
    }
  }
}

void LinearForwardReference(const Exl3LinearView& w, const float* x, int num_tokens, float* y) {
  const int k = w.in_features, n = w.out_features;
  std::vector<float> xt(static_cast<size_t>(num_tokens) * k);
  ApplyInputTransform(w, x, num_tokens, xt.data());
  std::memset(y, 0, sizeof(float) * num_tokens * static_cast<size_t>(n));
  const float* table = CodebookTable(w.codebook);
  float tile[kTileElems];
  for (int i = 0; i < k / 16; ++i) {
    for (int j = 0; j < n / 16; ++j) {
      DecodeTileFloat(w.tile(i, j), w.bits, table, tile);
      for (int t = 0; t < num_tokens; ++t) {
        const float* xr = xt.data() + static_cast<size_t>(t) * k + 16 * i;
        float* yr = y + static_cast<size_t>(t) * n + 16 * j;
        for (int r = 0; r < 16; ++r) {
          const float xv = xr[r];
          for (int c = 0; c < 16; ++c) yr[c] += xv * tile[r * 16 + c];
        }
      }
    }
  }
  ApplyOutputTransform(w, y, num_tokens);
}

}  // namespace exl3

#include "kernels/hadamard.h"

#include "kernels/fp16.h"

namespace exl3 {
namespace {

void Hadamard128Scalar(float* v) {
  for (int h = 1; h < kHadamardBlock; h <<= 1) {
    for (int i = 0; i < kHadamardBlock; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  for (int i = 0; i < kHadamardBlock; ++i) v[i] *= kHadamard128Scale;
}

void ScaleHadamard128Scalar(const float* x, const float* scale, float* out) {
  for (int i = 0; i < kHadamardBlock; ++i) out[i] = x[i] * scale[i];
  Hadamard128Scalar(out);
}

void Hadamard128ScaleBiasScalar(float* v, const float* scale, const float* bias) {
  Hadamard128Scalar(v);
  for (int i = 0; i < kHadamardBlock; ++i) {
    v[i] *= scale[i];
    if (bias != nullptr) v[i] += bias[i];
  }
}

void HalfToFloatScalar(const uint16_t* h, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(h[i]);
}

const HadamardKernels kScalarKernels = {Hadamard128Scalar, ScaleHadamard128Scalar,
                                        Hadamard128ScaleBiasScalar, HalfToFloatScalar};

}  // namespace

bool HadamardIsaSupported(HadamardIsa isa) {
  switch (isa) {
    case HadamardIsa::kScalar: return true;
#if defined(__x86_64__)
    case HadamardIsa::kAvx2: {
      static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
      return ok;
    }
    case HadamardIsa::kAvx512: {
      static const bool ok =
          __builtin_cpu_supports("avx512f") && HadamardIsaSupported(HadamardIsa::kAvx2);
      return ok;
    }
#else
    default: return false;
#endif
  }
  return false;
}

HadamardIsa BestHadamardIsa() {
  static const HadamardIsa best = HadamardIsaSupported(HadamardIsa::kAvx512) ? HadamardIsa::kAvx512
                                  : HadamardIsaSupported(HadamardIsa::kAvx2) ? HadamardIsa::kAvx2
                                                                             : HadamardIsa::kScalar;
  return best;
}

const HadamardKernels& HadamardKernelsFor(HadamardIsa isa) {
  switch (isa) {
    case HadamardIsa::kAvx512: return HadamardKernelsAvx512();
    case HadamardIsa::kAvx2: return HadamardKernelsAvx2();
    case HadamardIsa::kScalar: break;
  }
  return kScalarKernels;
}

const HadamardKernels& ActiveHadamardKernels() {
  static const HadamardKernels& k = HadamardKernelsFor(BestHadamardIsa());
  return k;
}

void Hadamard128(float* v) { ActiveHadamardKernels().hadamard128(v); }

void HadamardBlocks(float* v, size_t len) {
  const HadamardKernels& k = ActiveHadamardKernels();
  for (size_t off = 0; off + kHadamardBlock <= len; off += kHadamardBlock) k.hadamard128(v + off);
}

void Hadamard128Strided(float* v, size_t stride) {
  float tmp[kHadamardBlock];
  for (int i = 0; i < kHadamardBlock; ++i) tmp[i] = v[i * stride];
  Hadamard128(tmp);
  for (int i = 0; i < kHadamardBlock; ++i) v[i * stride] = tmp[i];
}

}  // namespace exl3

#include "services/common/wire.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/fp16.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace exl3::svc {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian; big-endian hosts need byte swapping here");

namespace {

#if defined(__x86_64__)
// F16C's conversion is exact for every finite half, like HalfBitsToFloat (non-finite inputs are
// rejected by the callers that care), at 8 values per instruction.
__attribute__((target("avx,f16c"))) void HalfRowF16c(const uint8_t* p, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = HalfBitsToFloat(h);
  }
}
#endif

// fp16 wire bytes -> fp32.
void HalfRow(const uint8_t* p, size_t n, float* out) {
#if defined(__x86_64__)
  // AVX2 as the test: every AVX2 CPU has F16C, and clang's builtin knows no "f16c".
  static const bool f16c = __builtin_cpu_supports("avx2");
  if (f16c) return HalfRowF16c(p, n, out);
#endif
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = HalfBitsToFloat(h);
  }
}

std::string ShapeString(const pb::Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.shape_size(); ++i) absl::StrAppend(&s, i ? ", " : "", t.shape(i));
  return s + "]";
}

std::string ExpectedString(const std::vector<int64_t>& e) {
  std::string s = "[";
  for (size_t i = 0; i < e.size(); ++i) {
    absl::StrAppend(&s, i ? ", " : "");
    if (e[i] < 0) {
      s += "*";
    } else {
      absl::StrAppend(&s, e[i]);
    }
  }
  return s + "]";
}

}  // namespace

size_t WireDTypeSize(int dtype) {
  switch (dtype) {
    case pb::DTYPE_FP32: return 4;
    case pb::DTYPE_FP16: return 2;
    case pb::DTYPE_BF16: return 2;
    default: return 0;
  }
}

std::string WireDTypeName(int dtype) {
  switch (dtype) {
    case pb::DTYPE_FP32: return "fp32";
    case pb::DTYPE_FP16: return "fp16";
    case pb::DTYPE_BF16: return "bf16";
    case pb::DTYPE_UNSPECIFIED: return "unspecified";
    default: return absl::StrCat("unknown(", dtype, ")");
  }
}

absl::Status ResolveOutputDType(int dtype, std::string_view what, pb::DType* out) {
  if (dtype == pb::DTYPE_UNSPECIFIED) {
    *out = pb::DTYPE_FP32;
    return absl::OkStatus();
  }
  if (WireDTypeSize(dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": unknown dtype ", dtype,
                                                   " (expected fp32, fp16 or bf16)"));
  }
  *out = static_cast<pb::DType>(dtype);
  return absl::OkStatus();
}

absl::Status ValidateTensor(const pb::Tensor& t, std::string_view name,
                            const std::vector<int64_t>& expected, int64_t max_elements) {
  const std::string n(name);
  const size_t esize = WireDTypeSize(t.dtype());
  if (esize == 0) {
    return absl::InvalidArgumentError(absl::StrCat(n, ": dtype ", WireDTypeName(t.dtype()),
                                                   " is not fp32, fp16 or bf16"));
  }
  if (t.shape_size() != static_cast<int>(expected.size())) {
    return absl::InvalidArgumentError(absl::StrCat(n, ": shape ", ShapeString(t), " has rank ",
                                                   t.shape_size(), ", expected ",
                                                   ExpectedString(expected)));
  }
  int64_t count = 1;
  for (int i = 0; i < t.shape_size(); ++i) {
    const int64_t d = t.shape(i);
    if (d < 1) {
      return absl::InvalidArgumentError(absl::StrCat(n, ": shape ", ShapeString(t), " has dim ", i,
                                                     " = ", d, " (every dim must be >= 1)"));
    }
    if (expected[i] >= 0 && d != expected[i]) {
      return absl::InvalidArgumentError(absl::StrCat(n, ": shape ", ShapeString(t), ", expected ",
                                                     ExpectedString(expected), " (dim ", i, " is ",
                                                     d, ", must be ", expected[i], ")"));
    }
    if (d > max_elements || count > max_elements / d) {
      return absl::InvalidArgumentError(absl::StrCat(n, ": shape ", ShapeString(t),
                                                     " has more than ", max_elements, " elements"));
    }
    count *= d;
  }
  const uint64_t want = static_cast<uint64_t>(count) * esize;
  if (t.data().size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, ": data has ", t.data().size(), " bytes, but shape ", ShapeString(t), " of ",
        WireDTypeName(t.dtype()), " needs ", want));
  }
  return absl::OkStatus();
}

namespace {

// Index of the first of n elements of type U (uint16_t or uint32_t) whose exponent field (`mask`)
// is all ones (Inf or NaN), or -1. Branch-free accumulation first (it vectorizes, where
// std::isfinite did not), then locate.
template <class U>
int64_t FirstAllOnes(const uint8_t* p, size_t n, U mask) {
  // Blocks of a fixed trip count: GCC 12 at -O2 (RelWithDebInfo, the default build) vectorizes
  // only those; the plain loop stayed scalar there, 13-20 ms per 16 MB on the 2-core VM against
  // ~2 ms in blocks.
  constexpr size_t kBlock = 64;
  U any = 0;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint8_t* q = p + i * sizeof(U);
    U acc = 0;
    for (size_t j = 0; j < kBlock; ++j) {
      U v;
      std::memcpy(&v, q + j * sizeof(U), sizeof(U));
      acc |= static_cast<U>((v & mask) == mask);
    }
    any |= acc;
  }
  for (; i < n; ++i) {
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    any |= static_cast<U>((v & mask) == mask);
  }
  if (!any) return -1;
  for (i = 0; i < n; ++i) {
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    if ((v & mask) == mask) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(const float* x, size_t n) {
  return FirstAllOnes<uint32_t>(reinterpret_cast<const uint8_t*>(x), n, 0x7f800000u);
}

void WireToFloat(pb::DType dtype, const void* data, size_t n, float* out) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  switch (dtype) {
    case pb::DTYPE_FP16:
      HalfRow(p, n, out);
      break;
    case pb::DTYPE_BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = BFloat16BitsToFloat(h);
      }
      break;
    default:
      std::memcpy(out, p, n * 4);
      break;
  }
}

namespace {

// The message of a non-finite element `bad` (of value v) of tensor `t`.
absl::Status NonFinite(const pb::Tensor& t, std::string_view name, int64_t bad, float v) {
  const int64_t cols = t.shape_size() > 0 ? t.shape(t.shape_size() - 1) : 1;
  return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": non-finite value ", v,
                                                 " at [", bad / cols, ", ", bad % cols,
                                                 "] (NaN/Inf inputs are rejected)"));
}

// Bytes per element of t's dtype; an error naming `name` for a dtype the wire does not carry.
absl::StatusOr<size_t> ElementSize(const pb::Tensor& t, std::string_view name) {
  const size_t esize = WireDTypeSize(t.dtype());
  if (esize == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(name), ": dtype ", WireDTypeName(t.dtype()), " is not supported"));
  }
  return esize;
}

}  // namespace

absl::Status CheckFinite(const pb::Tensor& t, std::string_view name) {
  const std::string& d = t.data();
  EXL3_ASSIGN_OR_RETURN(const size_t esize, ElementSize(t, name));
  const size_t n = d.size() / esize;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(d.data());
  const int64_t bad = t.dtype() == pb::DTYPE_FP32   ? FirstAllOnes<uint32_t>(p, n, 0x7f800000u)
                      : t.dtype() == pb::DTYPE_FP16 ? FirstAllOnes<uint16_t>(p, n, 0x7c00u)
                                                    : FirstAllOnes<uint16_t>(p, n, 0x7f80u);
  if (bad < 0) return absl::OkStatus();
  float v;
  WireToFloat(t.dtype(), p + bad * esize, 1, &v);
  return NonFinite(t, name, bad, v);
}

absl::Status TensorToFloat(const pb::Tensor& t, std::string_view name, bool require_finite,
                           float* out) {
  const std::string& d = t.data();
  EXL3_ASSIGN_OR_RETURN(const size_t esize, ElementSize(t, name));
  const size_t n = d.size() / esize;
  WireToFloat(t.dtype(), d.data(), n, out);
  if (require_finite) {
    const int64_t bad = FirstNonFinite(out, n);
    if (bad >= 0) return NonFinite(t, name, bad, out[bad]);
  }
  return absl::OkStatus();
}

absl::Status DecodeMatrix(const pb::Tensor& t, std::string_view name, int64_t cols,
                          std::vector<float>* out, int64_t* rows) {
  if (absl::Status s = ValidateTensor(t, name, {-1, cols}); !s.ok()) return s;
  *rows = t.shape(0);
  out->resize(static_cast<size_t>(t.shape(0) * t.shape(1)));
  return TensorToFloat(t, name, /*require_finite=*/true, out->data());
}

void EncodeTensor(const float* data, const std::vector<int64_t>& shape, pb::DType dtype,
                  pb::Tensor* out) {
  if (dtype == pb::DTYPE_UNSPECIFIED) dtype = pb::DTYPE_FP32;
  size_t n = 1;
  out->clear_shape();
  for (int64_t d : shape) {
    out->add_shape(d);
    n *= static_cast<size_t>(d);
  }
  out->set_dtype(dtype);
  std::string* bytes = out->mutable_data();
  if (dtype == pb::DTYPE_FP32) {
    // One pass (resize would zero-fill first); a buffer of enough capacity is written in place.
    bytes->assign(reinterpret_cast<const char*>(data), n * 4);
    return;
  }
  bytes->resize(n * WireDTypeSize(dtype));
  uint8_t* p = reinterpret_cast<uint8_t*>(bytes->data());
  switch (dtype) {
    case pb::DTYPE_FP16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalfBits(data[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      break;
    case pb::DTYPE_BF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToBFloat16Bits(data[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      break;
    default:
      std::memcpy(p, data, n * 4);
      break;
  }
}

std::chrono::microseconds RequestTimeout(uint64_t timeout_us) {
  constexpr uint64_t kYearUs = 365ull * 24 * 3600 * 1000000;
  return std::chrono::microseconds(std::min(timeout_us, kYearUs));
}

}  // namespace exl3::svc

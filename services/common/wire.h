// Wire tensors (exl3serve.v1.Tensor: dtype, shape, raw little-endian bytes) <-> fp32 buffers.
//
// Usage (server side, decoding a [T, hidden] input):
//   std::vector<float> x;
//   int64_t rows = 0;
//   absl::Status s = DecodeMatrix(req.hidden(), "hidden", cfg.hidden_size, &x, &rows);
//   // INVALID_ARGUMENT naming the tensor and the problem: unknown dtype, wrong rank, a dim < 1,
//   // columns != hidden_size, byte length != product(shape) * dtype size, NaN/Inf at [r, c].
//
// Encoding (fp32 -> FP32/FP16/BF16, round to nearest even):
//   EncodeTensor(y.data(), {rows, hidden}, exl3serve::v1::DTYPE_BF16, resp.mutable_output());
//
// Policy (docs/protocol.md): non-finite inputs are rejected, never propagated.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::svc {

namespace pb = ::exl3serve::v1;

// Bytes per element; 0 for DTYPE_UNSPECIFIED or an unknown value.
size_t WireDTypeSize(int dtype);
// "fp32", "fp16", "bf16", or "unknown(N)".
std::string WireDTypeName(int dtype);
// UNSPECIFIED -> FP32; FP32/FP16/BF16 as is; anything else INVALID_ARGUMENT naming `what`.
absl::Status ResolveOutputDType(int dtype, std::string_view what, pb::DType* out);

// Checks dtype, rank == expected.size(), each dim >= 1 and equal to expected[i] where
// expected[i] >= 0 (-1: any), the element count fits in memory limits (`max_elements`), and
// data size == product(shape) * dtype size. `name` names the tensor in messages.
absl::Status ValidateTensor(const pb::Tensor& t, std::string_view name,
                            const std::vector<int64_t>& expected, int64_t max_elements = 1LL << 40);

// Converts a tensor that passed ValidateTensor to fp32 in `out` (num elements floats). With
// `require_finite`, the first NaN/Inf fails with INVALID_ARGUMENT naming its [row, col] (row-major
// over the last dim). `out` may be partly written on error.
absl::Status TensorToFloat(const pb::Tensor& t, std::string_view name, bool require_finite,
                           float* out);

// Converts `n` elements of wire dtype `dtype` (FP32, FP16 or BF16) at `data` to fp32.
void WireToFloat(pb::DType dtype, const void* data, size_t n, float* out);

// TensorToFloat's require_finite check without the conversion: the same INVALID_ARGUMENT for the
// first NaN/Inf of a tensor that passed ValidateTensor, read in its wire dtype.
absl::Status CheckFinite(const pb::Tensor& t, std::string_view name);

// ValidateTensor for rank 2 [rows, cols] (cols >= 0 enforced, -1 any) + TensorToFloat with
// require_finite. `rows` receives shape[0].
absl::Status DecodeMatrix(const pb::Tensor& t, std::string_view name, int64_t cols,
                          std::vector<float>* out, int64_t* rows);

// Writes `data` (product(shape) fp32 values) into `out` as `dtype` (FP32, FP16 or BF16;
// UNSPECIFIED means FP32).
void EncodeTensor(const float* data, const std::vector<int64_t>& shape, pb::DType dtype,
                  pb::Tensor* out);

// A request's timeout_us (> 0) as a duration, clamped to a year: a larger value (up to 2^64 - 1)
// would overflow the steady clock's time_point and pass for a deadline already gone.
std::chrono::microseconds RequestTimeout(uint64_t timeout_us);

// Index of the first non-finite value among n floats, or -1.
int64_t FirstNonFinite(const float* x, size_t n);

}  // namespace exl3::svc

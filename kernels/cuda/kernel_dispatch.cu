#include "kernels/cuda/kernel_dispatch.h"

#include "absl/strings/str_cat.h"

namespace exl3::cuda {
namespace {

// Calls F::template Run<K, CB>(args...) for runtime K in 1..8, cb in 0..2.
template <typename F, typename... Args>
absl::Status Dispatch(int K, int cb, Args&&... args) {
  if (cb < 0 || cb > 2) return absl::InvalidArgumentError(absl::StrCat("bad codebook ", cb));
#define EXL3_CASE(KK)                                                  \
  case KK:                                                             \
    if (cb == 0) F::template Run<KK, 0>(args...);                      \
    else if (cb == 1) F::template Run<KK, 1>(args...);                 \
    else F::template Run<KK, 2>(args...);                              \
    return absl::OkStatus();
  switch (K) {
    EXL3_CASE(1) EXL3_CASE(2) EXL3_CASE(3) EXL3_CASE(4)
    EXL3_CASE(5) EXL3_CASE(6) EXL3_CASE(7) EXL3_CASE(8)
    default: return absl::InvalidArgumentError(absl::StrCat("EXL3 bit width ", K, " is not in 1..8"));
  }
#undef EXL3_CASE
}

struct GemvF {
  template <int K, int CB>
  static void Run(const GemvBatch& b, int grid, cudaStream_t s) { LaunchGroupedGemv<K, CB>(b, grid, s); }
};
struct DenseGemvF {
  template <int K, int CB>
  static void Run(const DenseGemvArgs& a, int grid, cudaStream_t s) { LaunchDenseGemv<K, CB>(a, grid, s); }
};
struct GemmF {
  template <int K, int CB>
  static void Run(const GemvBatch& b, int grid, cudaStream_t s) { LaunchGroupedGemm<K, CB>(b, grid, s); }
};
struct DequantF {
  template <int K, int CB>
  static void Run(const uint16_t* t, int k, int n, uint16_t* o, int grid, cudaStream_t s) {
    LaunchDequant<K, CB>(t, k, n, o, grid, s);
  }
};
struct CeilingF {
  template <int K, int CB>
  static void Run(const uint32_t* seeds, float* out, int iters, int grid, int block, cudaStream_t s) {
    LaunchDecodeCeiling<K, CB>(seeds, out, iters, grid, block, s);
  }
};

}  // namespace

absl::Status DispatchGemv(int K, int cb, const GemvBatch& batch, int grid, cudaStream_t stream) {
  return Dispatch<GemvF>(K, cb, batch, grid, stream);
}
absl::Status DispatchDenseGemv(int K, int cb, const DenseGemvArgs& args, int grid, cudaStream_t stream) {
  return Dispatch<DenseGemvF>(K, cb, args, grid, stream);
}
absl::Status DispatchGemm(int K, int cb, const GemvBatch& batch, int grid, cudaStream_t stream) {
  return Dispatch<GemmF>(K, cb, batch, grid, stream);
}
absl::Status DispatchDequant(int K, int cb, const uint16_t* trellis, int k, int n, uint16_t* out,
                             int grid, cudaStream_t stream) {
  return Dispatch<DequantF>(K, cb, trellis, k, n, out, grid, stream);
}
absl::Status DispatchDecodeCeiling(int K, int cb, const uint32_t* seeds, float* out, int iters,
                                   int grid, int block, cudaStream_t stream) {
  return Dispatch<CeilingF>(K, cb, seeds, out, iters, grid, block, stream);
}

}  // namespace exl3::cuda

#include "kernels/cuda/bench_hooks.h"

namespace exl3::cuda {
absl::Status RunDecodeCeiling(int K, int cb, const uint32_t* seeds, float* out, int iters, int grid, int block,
                              StreamHandle stream) {
  absl::Status s = DispatchDecodeCeiling(K, cb, seeds, out, iters, grid, block, static_cast<cudaStream_t>(stream));
  if (!s.ok()) return s;
  const cudaError_t e = cudaPeekAtLastError();
  if (e != cudaSuccess) return absl::InternalError(std::string("decode ceiling launch: ") + cudaGetErrorString(e));
  return absl::OkStatus();
}
}  // namespace exl3::cuda

// Template instances for K = 3 and 4, all three codebooks (spread over files for compile time).
#include "kernels/cuda/decode_ceiling_kernel.cuh"
#include "kernels/cuda/dense_gemv_kernel.cuh"
#include "kernels/cuda/gemm_kernel.cuh"
#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/kernel_dispatch.h"

namespace exl3::cuda {

#define EXL3_INSTANCES(K, CB)                                                                      \
  template void LaunchGroupedGemv<K, CB>(const GemvBatch&, int, cudaStream_t);                     \
  template void LaunchDenseGemv<K, CB>(const DenseGemvArgs&, int, cudaStream_t);                   \
  template void LaunchGroupedGemm<K, CB>(const GemvBatch&, int, cudaStream_t);                     \
  template void LaunchDequant<K, CB>(const uint16_t*, int, int, uint16_t*, int, cudaStream_t);     \
  template void LaunchDecodeCeiling<K, CB>(const uint32_t*, float*, int, int, int, cudaStream_t);

EXL3_INSTANCES(3, 0)
EXL3_INSTANCES(3, 1)
EXL3_INSTANCES(3, 2)
EXL3_INSTANCES(4, 0)
EXL3_INSTANCES(4, 1)
EXL3_INSTANCES(4, 2)

}  // namespace exl3::cuda

// Entry points for exl3-bench that are not part of the public API (no CUDA headers here).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend.h"

namespace exl3::cuda {

// The decode-ceiling kernel: grid x block threads, each warp decodes iters * 4 tiles of bit width K
// with codebook cb from register-resident words (seeds: 1024 device words; out: grid*block floats).
absl::Status RunDecodeCeiling(int K, int cb, const uint32_t* seeds, float* out, int iters, int grid, int block,
                              StreamHandle stream);

// One launch of an empty kernel (grid x 256 threads) with the PDL attribute the kernels use: in a
// graph of many, its time per launch is the fixed cost any one-launch kernel pays.
absl::Status RunEmptyLaunch(int grid, StreamHandle stream);

// Forces the k-slice length (16-row tiles, clamped to DenseMaxSliceTiles(K)) of the one-launch GEMV that
// LinearForward uses (dense_gemv_kernel.cuh); 0 restores the cost
// model's choice.
void SetDenseGemvSliceOverride(int tiles);

// Forces the kernel LinearForward runs for m <= kGemvMaxRows (gemv_plan.h) on the native path: 1 the one-launch
// DenseGemvKernel, 2 the three launches (input transform, GroupedGemvKernel, output transform), 3 the
// prefill GEMM (k-sliced as GemmKStages says; at any m, also where the rule dequantises and calls
// cuBLAS: UseDequantGemm); 0 restores the rule (PlanDenseGemv, gemv_plan.cu).
void SetGemvPathOverride(int path);

}  // namespace exl3::cuda

// The MoE layer's reference path (EXL3_MOE_KERNEL=reference, or a device below sm_80): the
// projections dequantised to fp16 and multiplied with cuBLAS, one GEMM per active expert. The
// routing, input, mid and combine kernels are the native path's.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/moe_kernels.h"
#include "kernels/cuda/moe_layer.h"
#include "kernels/cuda/workspace.h"

namespace exl3::cuda {

// The cuBLAS handle and a dequantisation buffer for the largest projection (hidden x the larger
// intermediate size), made once.
absl::Status PrepareReferenceWorkspace(Workspace::Impl& w, int hidden, int inter, int shared_inter);

// Runs `count` projection problems (tables[i] describes probs[i]): copies the chunk list to the
// host (synchronises) and runs dequant + cuBLAS per active expert, each at its own K and codebook.
absl::Status ReferenceProjections(Workspace::Impl& w, const RouteOut& route, const GemvProblem* probs,
                                  const ProjTable* const* tables, int count, cudaStream_t stream);

}  // namespace exl3::cuda

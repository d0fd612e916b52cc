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

}  // namespace exl3::cuda

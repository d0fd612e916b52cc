// The kernel path actually taken (cuda_backend.h's Path): shared by the dense and MoE host code.
#pragma once

#include "kernels/cuda/cuda_backend.h"

namespace exl3::cuda {

// Resolves kAuto through EXL3_MOE_KERNEL and the device (cc < 8 -> reference); logs the choice
// once per process and `what`.
Path ResolvePath(Path requested, int cc_major, const char* what);

}  // namespace exl3::cuda

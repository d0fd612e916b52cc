// Kernel launches with Programmatic Dependent Launch (sm_90+): each kernel of a sequence is
// launched while its predecessor drains, and waits for it with griddepcontrol.wait before reading
// its results, which hides most of the launch gap between the short kernels of one layer (also
// inside CUDA graphs). On older devices the attribute and the instructions are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "base/env_switch.h"

namespace exl3::cuda {

// First statement of every kernel in a PDL sequence: wait for the previous kernel's results, then
// let the next kernel start launching.
__device__ __forceinline__ void PdlEnter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// EXL3_PDL=0 launches every kernel of a sequence plainly (each waits for its predecessor to end):
// for measuring what PDL gains, and a way out should a driver mishandle it. Read once.
inline bool PdlEnabled() {
  static const bool enabled = EnvSwitchOn("EXL3_PDL");
  return enabled;
}

// As LaunchPdl below, with `smem_bytes` of dynamic shared memory.
template <typename... KArgs, typename... Args>
void LaunchPdlWithSmem(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = PdlEnabled() ? 1 : 0;
  // A failure is left in the runtime's last error, which every caller checks after the launch.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... KArgs, typename... Args>
void LaunchPdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  LaunchPdlWithSmem(kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace exl3::cuda

// Exit-on-error checks for the GPU tools (exl3-bench, exl3-cuda-check): a failed CUDA call or
// library status prints where it happened and exits with status 2.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

#define CK(expr)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_),  \
                   __FILE__, __LINE__, #expr);                                      \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)

#define OK(expr)                                                                    \
  do {                                                                              \
    absl::Status s_ = (expr);                                                       \
    if (!s_.ok()) {                                                                 \
      std::fprintf(stderr, "error at %s:%d: %s\n", __FILE__, __LINE__,              \
                   s_.ToString().c_str());                                          \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)

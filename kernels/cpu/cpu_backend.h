// The fast CPU backend: multithreaded decode-and-multiply EXL3 linear layers and MoE layers, with an
// AVX2+FMA+F16C inner loop chosen at run time (scalar fallback elsewhere). Same arithmetic as the
// references in kernels/exl3_linear.h and kernels/moe_cpu.h (results agree to fp32 rounding).
//
// Usage:
//   CpuBackend cpu(/*num_threads=*/0);                   // 0: all hardware threads
//   cpu.Linear(view, x /*[T, k] fp32*/, T, y /*[T, n]*/);
//   absl::Status s = cpu.Moe(layer_view, x, assignments, /*include_shared=*/true, y);
//
// One CpuBackend owns a persistent thread pool; calls on one instance are serialised by a mutex
// (use one instance per concurrent caller, or batch). Threads never allocate on the hot path
// beyond per-call scratch.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "kernels/exl3_linear.h"
#include "kernels/moe_cpu.h"

namespace exl3::cpu {

class ThreadPool;

// Which inner loop runs: "avx2" (x86 with AVX2, FMA and F16C) or "scalar".
std::string_view ActiveIsa();
// Forces the scalar loop (tests compare both); returns the previous setting.
bool ForceScalar(bool force);

class CpuBackend {
 public:
  explicit CpuBackend(int num_threads = 0);
  ~CpuBackend();
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  int num_threads() const;

  // y [T, n] = x [T, k] · W (+ bias). Validates the view (InvalidArgument) first.
  absl::Status Linear(const Exl3LinearView& w, const float* x, int num_tokens, float* y);

  // The MoE layer as MoeForwardReference: y [T, hidden] (overwritten).
  absl::Status Moe(const MoeLayerView& layer, const float* x, const MoeAssignments& assignments,
                   bool include_shared, float* y);

 private:
  std::unique_ptr<ThreadPool> pool_;
  std::mutex mu_;
};

}  // namespace exl3::cpu

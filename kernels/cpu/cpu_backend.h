// The fast CPU backend: multithreaded decode-and-multiply EXL3 linear layers and MoE layers, with an
// AVX-512 (F, or F + VBMI) or AVX2+FMA+F16C inner loop chosen at run time (scalar fallback
// elsewhere). Same arithmetic as the
// references in kernels/exl3_linear.h and kernels/moe_cpu.h (results agree to fp32 rounding).
//
// Usage:
//   CpuBackend cpu(/*num_threads=*/0);                   // 0: all hardware threads
//   cpu.Linear(view, x /*[T, k] fp32*/, T, y /*[T, n]*/);
//   absl::Status s = cpu.Moe(layer_view, x, assignments, /*include_shared=*/true, y);
//
// One CpuBackend owns a persistent thread pool; calls on one instance are serialised by a mutex
// (use one instance per concurrent caller, or batch). Scratch buffers are kept between calls, so a
// warm instance does not allocate on the hot path.
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

// Inner loops, best last. The best one the CPU supports (and the limit allows) runs. All give
// the same results to the bit.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vbmi = 3 };

// Which inner loop runs now: "avx512vbmi" (AVX-512F + VBMI), "avx512" (AVX-512F), "avx2"
// (AVX2 + FMA + F16C) or "scalar".
std::string_view ActiveIsa();
// Caps the inner loop (tests compare every path); returns the previous cap. Default kAvx512Vbmi.
Isa SetMaxIsa(Isa max);
// Same as SetMaxIsa(kScalar) / SetMaxIsa(kAvx512Vbmi); returns whether scalar was forced before.
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
  struct Scratch;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Scratch> scratch_;  // per-call buffers, reused (guarded by mu_)
  std::mutex mu_;
};

}  // namespace exl3::cpu

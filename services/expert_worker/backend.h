// The compute backends of the expert worker: one MoE layer's routed experts over a batch of
// tokens with per-token (expert, weight) slots.
//
//   auto be = CreateBackend("auto", /*device=*/0, /*threads=*/8);   // cuda when built and a GPU is
//   be->Prepare(model, opts, &stats);                                // present, else cpu
//   BatchView b{layer, T, S, x, ids, weights, out};
//   be->Forward(b);   // out[t] = sum_s weights[t,s] * expert_{ids[t,s]}(x[t]); ids -1 skipped
//                     // (+ shared(x[t]) when b.shared: exactly the router's local shared expert)
//
// Callers validate ids (held by this worker) and weights (finite) before; backends trust them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/exl3_model.h"

namespace exl3::worker {

struct BatchView {
  int layer = 0;
  int tokens = 0;  // T
  int slots = 0;   // S
  const float* x = nullptr;          // [T, hidden]
  const int32_t* ids = nullptr;      // [T, S], -1 = empty slot
  const float* weights = nullptr;    // [T, S]
  float* out = nullptr;              // [T, hidden], overwritten
  bool shared = false;  // also add the shared expert (with its gate) to every token's output
};

// Where the CUDA backend keeps the weights (--weights-residency). kAuto: in place on integrated
// GPUs (GB10: one physical memory, a copy would only halve the room), in device memory elsewhere.
enum class WeightResidency { kAuto, kDevice, kHost };
absl::StatusOr<WeightResidency> ParseWeightResidency(const std::string& name);

struct PrepareOptions {
  int load_threads = 8;
  bool lock_memory = true;  // CPU: mlock the held tensors
  bool progress = true;     // progress bar on stderr
  bool benchmark = false;   // also time a plain parallel read of the same bytes
  bool shared_expert = false;  // the model holds the shared experts: make them resident too
  int max_batch_tokens = 4096;  // largest batch Forward will see (device workspaces)
  WeightResidency residency = WeightResidency::kAuto;  // CUDA only
};

struct PrepareStats {
  uint64_t bytes = 0;         // held expert bytes read
  double read_seconds = 0;    // making them resident in RAM
  double baseline_gbps = 0;   // plain parallel pread, when benchmarked
  uint64_t pinned_bytes = 0;  // locked host / device bytes
  double seconds = 0;         // whole Prepare
  std::string note;           // e.g. why memory could not be locked
};

class MoeBackend {
 public:
  virtual ~MoeBackend() = default;
  virtual std::string name() const = 0;    // "cpu" or "cuda"
  virtual std::string device() const = 0;  // human readable
  // Makes the model's held experts resident for this backend. Called once, before Forward.
  virtual absl::Status Prepare(const Exl3Model& model, const PrepareOptions& opt,
                               PrepareStats* stats) = 0;
  virtual absl::Status Forward(const BatchView& batch) = 0;
  virtual uint64_t pinned_bytes() const = 0;
  // Forward may be called from any thread (never two at once): the scheduler then runs a lone
  // small request on the thread that received it. False where a backend is bound to one thread
  // (e.g. a CUDA context made current there).
  virtual bool forward_on_any_thread() const { return false; }
  // Host buffers of the backend's own that its copies to and from the device read and write
  // directly (the CUDA backend's page-locked staging), [max_tokens, hidden] fp32 each; null where
  // it has none. A batch of several requests is gathered into `x` and scattered from `out`
  // instead of through buffers of the scheduler's: a BatchView whose x (out) is this x (out)
  // skips the backend's own copy into (out of) its staging. Valid from Prepare on.
  struct Staging {
    float* x = nullptr;
    float* out = nullptr;
    int max_tokens = 0;
  };
  virtual Staging staging() const { return {}; }
  // Asked after a failed Forward: OK when the backend can take more batches, otherwise why it
  // cannot (a GPU whose context a sticky error lost: every later call would fail too). The
  // worker then stops serving and exits so that it is restarted.
  virtual absl::Status Health() { return absl::OkStatus(); }
};

// kind: "auto" (cuda when compiled in and a device is present, else cpu), "cpu" or "cuda".
// threads: CPU compute threads (0: hardware concurrency).
absl::StatusOr<std::unique_ptr<MoeBackend>> CreateBackend(const std::string& kind, int device,
                                                          int threads);

}  // namespace exl3::worker

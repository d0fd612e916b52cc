// CPU backend: the held experts are copied at load into memory the process owns, at the addresses
// of the mapped files (Residency::kOwned, services/expert_worker/loader.h; locked in RAM where
// permitted), so changes to the files after the load cannot reach them, and are computed by the
// fast multithreaded CPU MoE of kernels/cpu/cpu_backend.h.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe_cpu.h"
#include "base/logging.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/loader.h"

#if defined(EXL3_HAVE_CUDA)
#include "kernels/cuda/cuda_backend.h"
#endif

namespace exl3::worker {
namespace {

class CpuBackend : public MoeBackend {
 public:
  explicit CpuBackend(int threads) : cpu_(threads) {}
  ~CpuBackend() override {
    if (locked_) UnlockRanges(ranges_);
  }
  std::string name() const override { return "cpu"; }
  std::string device() const override { return absl::StrCat("cpu (", std::string(cpu::ActiveIsa()), ", ", cpu_.num_threads(), " threads)"); }
  uint64_t pinned_bytes() const override { return pinned_; }
  bool forward_on_any_thread() const override { return true; }

  absl::Status Prepare(const Exl3Model& model, const PrepareOptions& opt,
                       PrepareStats* stats) override {
    const auto t0 = std::chrono::steady_clock::now();
    const MoeConfig& c = model.config();
    hidden_ = c.hidden_size;
    for (int layer : c.MoeLayers()) {
      absl::StatusOr<MoeLayerView> v = model.LayerView(layer);
      if (!v.ok()) return v.status();
      // The shared expert (when this worker holds it) is only used by batches that ask for it.
      shared_[layer] = *v;
      v->shared = nullptr;
      layers_[layer] = *v;
    }
    ranges_ = HeldTensorRanges(model, opt.shared_expert);
    if (opt.benchmark) {
      LoadStats base = BaselineRead(ranges_, opt.load_threads);
      stats->baseline_gbps = base.gbps();
      DropFromPageCache(ranges_);
    }
    LoadStats ls = MakeResident(ranges_, opt.load_threads, opt.lock_memory, opt.progress,
                                Residency::kOwned);
    if (!ls.own_error.empty()) {
      if (ls.locked_bytes > 0) UnlockRanges(ranges_);
      return absl::ResourceExhaustedError(absl::StrCat("cannot hold the experts in memory of the worker: ",
                                                       ls.own_error));
    }
    exl3::LogInfo("%.1f MB of weights copied into memory of the worker (changes to the model files no "
                 "longer reach them)", ls.owned_bytes / 1e6);
    locked_ = ls.locked_bytes > 0;
    pinned_ = ls.locked_bytes;
    stats->bytes = ls.bytes;
    stats->read_seconds = ls.seconds;
    stats->pinned_bytes = pinned_;
    if (!ls.lock_error.empty()) {
      stats->note = absl::StrCat("mlock failed (", ls.lock_error,
                                 "): weights are resident but not locked; raise RLIMIT_MEMLOCK "
                                 "(ulimit -l) or grant CAP_IPC_LOCK");
    }
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return absl::OkStatus();
  }

  absl::Status Forward(const BatchView& b) override {
    auto& views = b.shared ? shared_ : layers_;
    auto it = views.find(b.layer);
    if (it == views.end()) return absl::InternalError(absl::StrCat("layer ", b.layer, " not prepared"));
    if (b.shared && it->second.shared == nullptr) {
      return absl::InternalError(absl::StrCat("layer ", b.layer, ": the shared expert is not loaded"));
    }
    // Padded [T, S] slots -> per-token (expert, weight) lists without the -1 padding.
    offsets_.assign(1, 0);
    ids_.clear();
    weights_.clear();
    for (int t = 0; t < b.tokens; ++t) {
      for (int s = 0; s < b.slots; ++s) {
        const size_t i = static_cast<size_t>(t) * b.slots + s;
        if (b.ids[i] < 0) continue;
        ids_.push_back(b.ids[i]);
        weights_.push_back(b.weights[i]);
      }
      offsets_.push_back(static_cast<int32_t>(ids_.size()));
    }
    MoeAssignments a;
    a.num_tokens = b.tokens;
    a.expert_ids = ids_.data();
    a.weights = weights_.data();
    a.offsets = offsets_.data();
    // With b.shared this is the same call the router makes for its local shared expert (plus the
    // routed pairs), so the two give the same sums.
    return cpu_.Moe(it->second, b.x, a, b.shared, b.out);
  }

 private:
  cpu::CpuBackend cpu_;
  std::vector<int32_t> offsets_, ids_;
  std::vector<float> weights_;
  int hidden_ = 0;
  std::map<int, MoeLayerView> layers_;  // routed experts only
  std::map<int, MoeLayerView> shared_;  // with the shared expert (null when not held)
  std::vector<TensorRange> ranges_;
  bool locked_ = false;
  uint64_t pinned_ = 0;
};

}  // namespace

std::unique_ptr<MoeBackend> MakeCpuBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

#if defined(EXL3_HAVE_CUDA)
std::unique_ptr<MoeBackend> MakeCudaBackend(int device);
#endif

absl::StatusOr<WeightResidency> ParseWeightResidency(const std::string& name) {
  if (name == "auto") return WeightResidency::kAuto;
  if (name == "device") return WeightResidency::kDevice;
  if (name == "host") return WeightResidency::kHost;
  return absl::InvalidArgumentError(
      absl::StrCat("--weights-residency '", name, "' is not auto, device or host"));
}

absl::StatusOr<std::unique_ptr<MoeBackend>> CreateBackend(const std::string& kind, int device,
                                                          int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  if (kind != "auto" && kind != "cpu" && kind != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--backend '", kind, "' is not auto, cpu or cuda"));
  }
#if defined(EXL3_HAVE_CUDA)
  if (kind != "cpu" && device != 0) {
    // The CUDA backend's API has no device selection: before the first CUDA call, narrow the
    // visible devices to the one asked for, which then is device 0 of this process.
    std::vector<std::string> visible;
    if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr && *v != 0) {
      visible = absl::StrSplit(v, ',');
    }
    const std::string pick = visible.empty() ? std::to_string(device)
                             : device < static_cast<int>(visible.size()) ? visible[device] : "";
    if (pick.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("--device ", device, ": CUDA_VISIBLE_DEVICES lists only ",
                                                        visible.size(), " devices"));
    }
    setenv("CUDA_VISIBLE_DEVICES", pick.c_str(), 1);
  }
  if (kind == "cuda" || (kind == "auto" && cuda::DeviceCount() > 0)) {
    if (cuda::DeviceCount() < 1) {
      return absl::FailedPreconditionError(absl::StrCat("--backend cuda: no CUDA device ", device,
                                                        " is visible"));
    }
    return MakeCudaBackend(device);
  }
#else
  if (kind == "cuda") {
    return absl::FailedPreconditionError(
        "--backend cuda: this exl3-worker was built without CUDA (EXL3_WITH_CUDA=OFF or no toolkit)");
  }
#endif
  (void)device;
  return MakeCpuBackend(threads);
}

}  // namespace exl3::worker

// CPU backend: the held experts stay in the mapped files (locked in RAM where permitted) and are
// computed with the kernels' CPU MLP over all of a batch's tokens per expert, experts (and large
// token groups) spread over a thread pool.
#include <algorithm>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/moe_cpu.h"
#include "services/common/logging.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/loader.h"
#include "services/expert_worker/thread_pool.h"

#if defined(EXL3_HAVE_CUDA)
#include "kernels/cuda/cuda_backend.h"
#endif

namespace exl3::worker {
namespace {

class CpuBackend : public MoeBackend {
 public:
  explicit CpuBackend(int threads) : pool_(threads) {}
  ~CpuBackend() override {
    if (locked_) UnlockRanges(ranges_);
  }
  std::string name() const override { return "cpu"; }
  std::string device() const override { return absl::StrCat("cpu (", pool_.size(), " threads)"); }
  uint64_t pinned_bytes() const override { return pinned_; }

  absl::Status Prepare(const Exl3Model& model, const PrepareOptions& opt,
                       PrepareStats* stats) override {
    const auto t0 = std::chrono::steady_clock::now();
    const MoeConfig& c = model.config();
    hidden_ = c.hidden_size;
    for (int layer : c.MoeLayers()) {
      absl::StatusOr<MoeLayerView> v = model.LayerView(layer);
      if (!v.ok()) return v.status();
      v->shared = nullptr;  // workers compute routed experts only
      layers_[layer] = *v;
    }
    ranges_ = HeldTensorRanges(model);
    if (opt.benchmark) {
      LoadStats base = BaselineRead(ranges_, opt.load_threads);
      stats->baseline_gbps = base.gbps();
      DropFromPageCache(ranges_);
    }
    LoadStats ls = MakeResident(ranges_, opt.load_threads, opt.lock_memory, opt.progress);
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
    auto it = layers_.find(b.layer);
    if (it == layers_.end()) return absl::InternalError(absl::StrCat("layer ", b.layer, " not prepared"));
    const MoeLayerView& L = it->second;
    const int H = hidden_;
    // Group (token, weight) by expert; big groups are cut so threads share the work.
    std::map<int, std::vector<std::pair<int, float>>> by_expert;
    for (int t = 0; t < b.tokens; ++t) {
      for (int s = 0; s < b.slots; ++s) {
        const int32_t e = b.ids[static_cast<size_t>(t) * b.slots + s];
        if (e < 0) continue;
        by_expert[e].push_back({t, b.weights[static_cast<size_t>(t) * b.slots + s]});
      }
    }
    constexpr int kTaskTokens = 32;
    struct Task {
      int expert;
      const std::pair<int, float>* pairs;
      int n;
      std::vector<float> y;  // [n, H]
    };
    std::vector<Task> tasks;
    for (auto& [e, v] : by_expert) {
      if (e >= L.num_experts() || L.experts[e] == nullptr) {
        return absl::InternalError(absl::StrCat("expert ", e, " of layer ", b.layer, " not held"));
      }
      for (size_t i = 0; i < v.size(); i += kTaskTokens) {
        tasks.push_back({e, v.data() + i, static_cast<int>(std::min<size_t>(kTaskTokens, v.size() - i)), {}});
      }
    }
    pool_.ParallelFor(static_cast<int>(tasks.size()), [&](int k) {
      Task& task = tasks[k];
      std::vector<float> xg(static_cast<size_t>(task.n) * H);
      for (int i = 0; i < task.n; ++i) {
        std::copy_n(b.x + static_cast<size_t>(task.pairs[i].first) * H, H, xg.data() + static_cast<size_t>(i) * H);
      }
      task.y.resize(xg.size());
      ExpertMlpForwardReference(*L.experts[task.expert], L.swiglu_limit, xg.data(), task.n, task.y.data());
    });
    std::fill_n(b.out, static_cast<size_t>(b.tokens) * H, 0.0f);
    // Fixed order (expert ascending, tokens in slot order): deterministic sums.
    for (const Task& task : tasks) {
      for (int i = 0; i < task.n; ++i) {
        float* o = b.out + static_cast<size_t>(task.pairs[i].first) * H;
        const float w = task.pairs[i].second;
        const float* y = task.y.data() + static_cast<size_t>(i) * H;
        for (int h = 0; h < H; ++h) o[h] += w * y[h];
      }
    }
    return absl::OkStatus();
  }

 private:
  ThreadPool pool_;
  int hidden_ = 0;
  std::map<int, MoeLayerView> layers_;
  std::vector<TensorRange> ranges_;
  bool locked_ = false;
  uint64_t pinned_ = 0;
};

}  // namespace

std::unique_ptr<MoeBackend> MakeCpuBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

#if defined(EXL3_HAVE_CUDA)
std::unique_ptr<MoeBackend> MakeCudaBackend(int device);
#endif

absl::StatusOr<std::unique_ptr<MoeBackend>> CreateBackend(const std::string& kind, int device,
                                                          int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  if (kind != "auto" && kind != "cpu" && kind != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--backend '", kind, "' is not auto, cpu or cuda"));
  }
#if defined(EXL3_HAVE_CUDA)
  if (kind == "cuda" || (kind == "auto" && cuda::DeviceCount() > 0)) {
    if (cuda::DeviceCount() <= device) {
      return absl::FailedPreconditionError(absl::StrCat("--backend cuda: no CUDA device ", device,
                                                        " (", cuda::DeviceCount(), " visible)"));
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

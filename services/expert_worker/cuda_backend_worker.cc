// CUDA backend of the worker (compiled only with EXL3_HAVE_CUDA): every MoE layer's held experts
// uploaded to device memory, or on unified-memory GPUs used in place from registered host memory
// (kernels/cuda/cuda_backend.h: DeviceMoeLayer, HostRegistration, MoeRunner), one workspace per
// layer, inputs and outputs staged through device buffers. In place, tensors the files leave
// less than 16-byte aligned are read from one realigned host copy that replaces their file pages
// (services/expert_worker/host_resident_weights.h), never from a second copy in device memory.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "services/common/logging.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/host_resident_weights.h"
#include "services/expert_worker/loader.h"

namespace exl3::worker {
namespace {

class CudaBackend : public MoeBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    // Named up front: Describe and the info metric read it while Prepare runs.
    absl::StatusOr<cuda::DeviceInfo> info = cuda::QueryDevice(0);
    device_name_ = absl::StrCat("cuda:", device_, info.ok() ? " " + info->name : std::string());
  }
  ~CudaBackend() override {
    runners_.clear();
    layers_.clear();
    host_pages_.reset();  // after the layers that point into it
    placed_.clear();       // then the memory it registered
    host_weights_.reset();
    if (d_x_) cuda::DeviceFree(d_x_);
    if (d_out_) cuda::DeviceFree(d_out_);
  }
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  uint64_t pinned_bytes() const override { return pinned_; }

  absl::Status Prepare(const Exl3Model& model, const PrepareOptions& opt,
                       PrepareStats* stats) override {
    const auto t0 = std::chrono::steady_clock::now();
    // CreateBackend made the chosen device the process's device 0.
    absl::StatusOr<cuda::DeviceInfo> info = cuda::QueryDevice(0);
    if (!info.ok()) return info.status();
    const MoeConfig& c = model.config();
    hidden_ = c.hidden_size;
    top_k_ = c.top_k;
    max_tokens_ = std::max(1, opt.max_batch_tokens);
    // Read the held bytes into RAM first (parallel, measured), then upload layer by layer; or,
    // in place, place them where the kernels read them (the file pages, or the realigned copy).
    std::vector<TensorRange> ranges = HeldTensorRanges(model, opt.shared_expert);
    if (opt.benchmark) {
      stats->baseline_gbps = BaselineRead(ranges, opt.load_threads).gbps();
      DropFromPageCache(ranges);
    }
    const bool in_place = opt.residency == WeightResidency::kHost ||
                          (opt.residency == WeightResidency::kAuto && info->integrated);
    if (in_place) {
      HostLoadOptions ho;
      ho.threads = opt.load_threads;
      ho.progress = opt.progress;
      absl::StatusOr<std::unique_ptr<HostResidentWeights>> w = HostResidentWeights::Load(ranges, ho);
      if (!w.ok()) return w.status();
      host_weights_ = std::move(*w);
      stats->bytes = host_weights_->stats().bytes;
      stats->read_seconds = host_weights_->stats().seconds;
    } else {
      LoadStats ls = MakeResident(ranges, opt.load_threads, /*lock=*/false, opt.progress);
      stats->bytes = ls.bytes;
      stats->read_seconds = ls.seconds;
    }
    std::map<int, MoeLayerView> views;
    std::vector<cuda::HostRange> host_ranges;
    for (int layer : c.MoeLayers()) {
      absl::StatusOr<MoeLayerView> v = model.LayerView(layer);
      if (!v.ok()) return v.status();
      // The shared expert, when held, is uploaded with the layer and added only by batches that
      // ask for it (BatchView::shared).
      if (!opt.shared_expert) v->shared = nullptr;
      if (model.HeldExperts(layer).empty() && v->shared == nullptr) continue;
      if (in_place) {
        placed_.push_back(host_weights_->Place(*v));
        *v = placed_.back()->view();
        const std::vector<cuda::HostRange> r = cuda::MoeLayerHostRanges(*v);
        host_ranges.insert(host_ranges.end(), r.begin(), r.end());
      }
      views.emplace(layer, *v);
    }
    if (in_place) {
      // One registration for all layers: neighbouring layers' tensors share pages.
      absl::StatusOr<std::unique_ptr<cuda::HostRegistration>> reg =
          cuda::HostRegistration::Create(host_ranges);
      if (!reg.ok()) return reg.status();
      host_pages_ = std::move(*reg);
      pinned_ += host_pages_->bytes();
      const HostLoadStats& hs = host_weights_->stats();
      svc::LogInfo("weights used in place from %.1f MB of registered host memory (%s): %.1f MB of "
                   "tensors in the files' pages, %.1f MB of tensors not 16-byte aligned in the files "
                   "in one realigned copy of %.1f MB (%.1f MB of their file pages dropped)",
                   host_pages_->bytes() / 1e6,
                   opt.residency == WeightResidency::kHost ? "--weights-residency host" : "integrated GPU",
                   hs.in_place_bytes / 1e6, hs.copied_bytes / 1e6, hs.copy_bytes / 1e6, hs.dropped_bytes / 1e6);
    }
    size_t copied = 0;
    for (const auto& [layer, v] : views) {
      auto dev = in_place ? cuda::DeviceMoeLayer::Register(v, host_pages_.get())
                          : cuda::DeviceMoeLayer::Upload(v);
      if (!dev.ok()) return dev.status();
      copied += (*dev)->copied_bytes();
      auto runner = cuda::MoeRunner::Create(**dev, max_tokens_, top_k_);
      if (!runner.ok()) return runner.status();
      pinned_ += (*dev)->device_bytes();
      layers_[layer] = std::move(*dev);
      runners_[layer] = std::move(*runner);
    }
    if (copied > 0) {
      svc::LogInfo("%.1f MB of tensors not 16-byte aligned in host memory were copied to device "
                   "memory instead of being read in place", copied / 1e6);
    }
    const size_t bytes = static_cast<size_t>(max_tokens_) * hidden_ * sizeof(float);
    auto x = cuda::DeviceAlloc(bytes);
    if (!x.ok()) return x.status();
    d_x_ = static_cast<float*>(*x);
    auto o = cuda::DeviceAlloc(bytes);
    if (!o.ok()) return o.status();
    d_out_ = static_cast<float*>(*o);
    stats->pinned_bytes = pinned_;
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return absl::OkStatus();
  }

  absl::Status Health() override {
    // Sticky errors (illegal or misaligned address, launch failure, ECC) are returned by every
    // later call on the context.
    return cuda::Synchronize();
  }

  absl::Status Forward(const BatchView& b) override {
    auto it = runners_.find(b.layer);
    if (it == runners_.end()) {
      return absl::InternalError(absl::StrCat("layer ", b.layer, " has no experts on the device"));
    }
    if (b.shared && !layers_[b.layer]->has_shared()) {
      return absl::InternalError(absl::StrCat("layer ", b.layer, ": the shared expert is not on the device"));
    }
    if (b.tokens > max_tokens_) {
      return absl::InternalError(absl::StrCat("batch of ", b.tokens, " tokens over the device workspace (",
                                              max_tokens_, ")"));
    }
    // Compact each token's slots to the runner's width top_k (the worker validated that no token
    // uses more than top_k slots); unused entries stay -1 and are skipped by the kernel.
    ids_.assign(static_cast<size_t>(b.tokens) * top_k_, -1);
    weights_.assign(ids_.size(), 0.0f);
    for (int t = 0; t < b.tokens; ++t) {
      int k = 0;
      for (int s = 0; s < b.slots; ++s) {
        const size_t i = static_cast<size_t>(t) * b.slots + s;
        if (b.ids[i] < 0) continue;
        if (k >= top_k_) return absl::InternalError("more routed slots than top_k in one token");
        ids_[static_cast<size_t>(t) * top_k_ + k] = b.ids[i];
        weights_[static_cast<size_t>(t) * top_k_ + k] = b.weights[i];
        ++k;
      }
    }
    const size_t bytes = static_cast<size_t>(b.tokens) * hidden_ * sizeof(float);
    if (absl::Status s = cuda::CopyToDevice(d_x_, b.x, bytes); !s.ok()) return s;
    if (absl::Status s = it->second->ForwardHostRouting(d_x_, b.tokens, ids_.data(), weights_.data(),
                                                       d_out_, nullptr, b.shared);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = cuda::CopyToHost(b.out, d_out_, bytes); !s.ok()) return s;
    return cuda::Synchronize(nullptr);
  }

 private:
  int device_;
  std::string device_name_;
  int hidden_ = 0, top_k_ = 0, max_tokens_ = 0;
  uint64_t pinned_ = 0;
  // In place (--weights-residency host, integrated GPUs): where the tensors are held, the
  // layer views pointing there, and the registration of their pages.
  std::unique_ptr<HostResidentWeights> host_weights_;
  std::vector<std::unique_ptr<PlacedMoeLayer>> placed_;
  std::unique_ptr<cuda::HostRegistration> host_pages_;
  std::map<int, std::unique_ptr<cuda::DeviceMoeLayer>> layers_;
  std::map<int, std::unique_ptr<cuda::MoeRunner>> runners_;
  float* d_x_ = nullptr;
  float* d_out_ = nullptr;
  std::vector<int32_t> ids_;
  std::vector<float> weights_;
};

}  // namespace

std::unique_ptr<MoeBackend> MakeCudaBackend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace exl3::worker

// CUDA backend of the worker (compiled only with EXL3_HAVE_CUDA): every MoE layer's held experts
// uploaded to device memory, or on unified-memory GPUs used in place from registered host memory
// (kernels/cuda/cuda_backend.h: DeviceMoeLayer, HostRegistration, MoeRunner), one workspace per
// layer shape (rebound to each batch's layer), inputs and outputs staged through page-locked host
// buffers (one asynchronous copy each way on the backend's stream, one synchronisation per batch,
// nothing allocated per batch). In
// place, tensors the files leave less than 16-byte aligned are read from one realigned host copy
// that replaces their file pages (services/expert_worker/host_resident_weights.h), never from a
// second copy in device memory.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "base/logging.h"
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
    if (stream_) (void)cuda::Synchronize(stream_);  // no copy still reads or writes the staging
    runner_of_.clear();
    runners_.clear();
    layers_.clear();
    host_pages_.reset();  // after the layers that point into it
    placed_.clear();       // then the memory it registered
    host_weights_.reset();
    cuda::DeviceFree(d_in_);
    cuda::DeviceFree(d_out_);
    cuda::HostFree(h_in_);
    cuda::HostFree(h_out_);
    cuda::StreamDestroy(stream_);
  }
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  uint64_t pinned_bytes() const override { return pinned_; }
  // The process sees one device (CreateBackend), whose primary context every thread's runtime
  // calls use; the scheduler never runs two batches at once. So a lone small request is computed
  // on the thread that received it, with no hand-off to the executor.
  bool forward_on_any_thread() const override { return true; }
  Staging staging() const override {
    return {reinterpret_cast<float*>(h_in_), h_out_, h_in_ != nullptr ? max_tokens_ : 0};
  }

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
      exl3::LogInfo("weights used in place from %.1f MB of registered host memory (%s): %.1f MB of "
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
      pinned_ += (*dev)->device_bytes();
      EXL3_ASSIGN_OR_RETURN(runner_of_[layer], RunnerFor(**dev));
      layers_[layer] = std::move(*dev);
    }
    if (copied > 0) {
      exl3::LogInfo("%.1f MB of tensors not 16-byte aligned in host memory were copied to device "
                   "memory instead of being read in place", copied / 1e6);
    }
    // Staging, host and device alike: in [x T*H fp32 | ids T*top_k int32 | weights T*top_k fp32]
    // (each part 256-byte aligned, so one copy carries a batch's input), out [T, H] fp32.
    absl::StatusOr<cuda::StreamHandle> st = cuda::StreamCreate();
    if (!st.ok()) return st.status();
    stream_ = *st;
    const InputLayout in = Layout(max_tokens_);
    const size_t out_bytes = static_cast<size_t>(max_tokens_) * hidden_ * sizeof(float);
    absl::StatusOr<void*> p = cuda::DeviceAlloc(in.bytes);
    if (!p.ok()) return p.status();
    d_in_ = static_cast<uint8_t*>(*p);
    if (p = cuda::DeviceAlloc(out_bytes); !p.ok()) return p.status();
    d_out_ = static_cast<float*>(*p);
    if (p = cuda::HostAlloc(in.bytes); !p.ok()) return p.status();
    h_in_ = static_cast<uint8_t*>(*p);
    if (p = cuda::HostAlloc(out_bytes); !p.ok()) return p.status();
    h_out_ = static_cast<float*>(*p);
    pinned_ += 2 * (in.bytes + out_bytes);  // page-locked host and device alike
    stats->pinned_bytes = pinned_;
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return absl::OkStatus();
  }

  absl::Status Health() override {
    // Sticky errors (illegal or misaligned address, launch failure, ECC) are returned by every
    // later call on the context.
    if (stream_) EXL3_RETURN_IF_ERROR(cuda::Synchronize(stream_));
    return cuda::Synchronize();
  }

  absl::Status Forward(const BatchView& b) override {
    auto it = runner_of_.find(b.layer);
    if (it == runner_of_.end()) {
      return absl::InternalError(absl::StrCat("layer ", b.layer, " has no experts on the device"));
    }
    EXL3_RETURN_IF_ERROR(it->second->Rebind(*layers_[b.layer]));
    if (b.shared && !layers_[b.layer]->has_shared()) {
      return absl::InternalError(absl::StrCat("layer ", b.layer, ": the shared expert is not on the device"));
    }
    if (b.tokens > max_tokens_) {
      return absl::InternalError(absl::StrCat("batch of ", b.tokens, " tokens over the device workspace (",
                                              max_tokens_, ")"));
    }
    const InputLayout in = Layout(b.tokens);
    // Compact each token's slots to the runner's width top_k (the worker validated that no token
    // uses more than top_k slots), straight into the staging; unused entries stay -1 and are
    // skipped by the kernel.
    int32_t* ids = reinterpret_cast<int32_t*>(h_in_ + in.ids);
    float* weights = reinterpret_cast<float*>(h_in_ + in.weights);
    std::fill_n(ids, static_cast<size_t>(b.tokens) * top_k_, -1);
    std::fill_n(weights, static_cast<size_t>(b.tokens) * top_k_, 0.0f);
    for (int t = 0; t < b.tokens; ++t) {
      int k = 0;
      for (int s = 0; s < b.slots; ++s) {
        const size_t i = static_cast<size_t>(t) * b.slots + s;
        if (b.ids[i] < 0) continue;
        if (k >= top_k_) return absl::InternalError("more routed slots than top_k in one token");
        ids[static_cast<size_t>(t) * top_k_ + k] = b.ids[i];
        weights[static_cast<size_t>(t) * top_k_ + k] = b.weights[i];
        ++k;
      }
    }
    absl::Status s = Run(b, in, it->second);
    // Every copy done (or abandoned) before the staging is written again; sticky errors stay.
    const absl::Status synced = cuda::Synchronize(stream_);
    if (!s.ok()) return s;
    if (!synced.ok()) return synced;
    if (b.out != h_out_) {
      std::memcpy(b.out, h_out_, static_cast<size_t>(b.tokens) * hidden_ * sizeof(float));
    }
    return absl::OkStatus();
  }

 private:
  // Byte offsets of a batch of `tokens` in the input staging block, and its size.
  struct InputLayout {
    size_t ids = 0, weights = 0, bytes = 0;
  };
  InputLayout Layout(int tokens) const {
    auto round = [](size_t n) { return (n + 255) / 256 * 256; };
    const size_t t = static_cast<size_t>(tokens);
    InputLayout l;
    l.ids = round(t * hidden_ * sizeof(float));
    l.weights = l.ids + round(t * top_k_ * sizeof(int32_t));
    l.bytes = l.weights + round(t * top_k_ * sizeof(float));
    return l;
  }

  // Queues the batch's copies and kernels on stream_ (the ids and weights are staged already):
  // the hidden states into the staging in pieces, each copied to the device while the next one
  // is written (unless the scheduler gathered them there), the routing with the last piece, the
  // layer, the output back into the staging.
  absl::Status Run(const BatchView& b, const InputLayout& in, cuda::MoeRunner* runner) {
    constexpr size_t kPiece = 256 << 10;
    const size_t x_bytes = static_cast<size_t>(b.tokens) * hidden_ * sizeof(float);
    size_t off = 0;
    if (b.x != reinterpret_cast<const float*>(h_in_)) {
      const uint8_t* x = reinterpret_cast<const uint8_t*>(b.x);
      for (; x_bytes - off > kPiece; off += kPiece) {
        std::memcpy(h_in_ + off, x + off, kPiece);
        EXL3_RETURN_IF_ERROR(cuda::CopyToDeviceAsync(d_in_ + off, h_in_ + off, kPiece, stream_));
      }
      std::memcpy(h_in_ + off, x + off, x_bytes - off);
    }
    EXL3_RETURN_IF_ERROR(
        cuda::CopyToDeviceAsync(d_in_ + off, h_in_ + off, in.bytes - off, stream_));
    EXL3_RETURN_IF_ERROR(runner->Forward(reinterpret_cast<const float*>(d_in_), b.tokens,
                                         reinterpret_cast<const int32_t*>(d_in_ + in.ids),
                                         reinterpret_cast<const float*>(d_in_ + in.weights), d_out_,
                                         stream_, b.shared));
    return cuda::CopyToHostAsync(h_out_, d_out_, x_bytes, stream_);
  }

  // A runner whose workspace fits `layer` (MoeRunner::Rebind checks the shape), or a new one.
  absl::StatusOr<cuda::MoeRunner*> RunnerFor(const cuda::DeviceMoeLayer& layer) {
    for (const auto& r : runners_) {
      if (r->Rebind(layer).ok()) return r.get();
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<cuda::MoeRunner> r, cuda::MoeRunner::Create(layer, max_tokens_, top_k_));
    runners_.push_back(std::move(r));
    return runners_.back().get();
  }

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
  // One runner (and workspace, sized by max_tokens_) per distinct layer shape, rebound to the
  // batch's layer: batches run one at a time on stream_, and a workspace per layer would hold
  // max_tokens_ rows for each of a model's ~40-90 MoE layers (tens of GB at 4096 tokens).
  std::vector<std::unique_ptr<cuda::MoeRunner>> runners_;
  std::map<int, cuda::MoeRunner*> runner_of_;
  // Staging (Prepare): the input block's layout (InputLayout), host and device.
  cuda::StreamHandle stream_ = nullptr;
  uint8_t* h_in_ = nullptr;
  uint8_t* d_in_ = nullptr;
  float* h_out_ = nullptr;
  float* d_out_ = nullptr;
};

}  // namespace

std::unique_ptr<MoeBackend> MakeCudaBackend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace exl3::worker

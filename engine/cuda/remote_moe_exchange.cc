#include "engine/cuda/remote_moe_exchange.h"

#include <cuda_runtime.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t Event(void* e) { return static_cast<cudaEvent_t>(e); }

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

absl::StatusOr<double> ElapsedSeconds(void* begin, void* end) {
  float ms = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, Event(begin), Event(end)));
  return ms * 1e-3;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteMoeExchange>> RemoteMoeExchange::Create(MoeExecutor* executor,
                                                                              int micro_batches, int hidden,
                                                                              int top_k) {
  if (executor == nullptr) return absl::InvalidArgumentError("remote MoE exchange without an executor");
  if (micro_batches < 1 || micro_batches > 2)
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be 1 or 2, not ", micro_batches));
  if (hidden < 1) return absl::InvalidArgumentError("remote MoE exchange: hidden size must be positive");
  if (top_k < 0) return absl::InvalidArgumentError("remote MoE exchange: top_k must not be negative");
  std::unique_ptr<RemoteMoeExchange> ex(new RemoteMoeExchange(executor, hidden, top_k));
  cudaStream_t s;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ex->to_host_stream_ = s;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ex->to_device_stream_ = s;
  for (int m = 0; m < micro_batches; ++m) ex->slots_.push_back(std::make_unique<Slot>());
  for (std::unique_ptr<Slot>& slot_ptr : ex->slots_) {
    Slot& slot = *slot_ptr;
    cudaEvent_t e;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    slot.x_ready = e;
    for (void** timed : {&slot.to_host_begin, &slot.to_host_end, &slot.to_device_begin, &slot.to_device_end}) {
      EXL3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
      *timed = e;
    }
  }
  return ex;
}

RemoteMoeExchange::~RemoteMoeExchange() {
  for (std::unique_ptr<Slot>& s : slots_) s->call.reset();  // a call's handle waits for its answer
  for (void* stream : {to_host_stream_, to_device_stream_})
    if (stream != nullptr) cudaStreamSynchronize(Stream(stream));
  for (std::unique_ptr<Slot>& s : slots_)
    for (void* e : {s->x_ready, s->to_host_begin, s->to_host_end, s->to_device_begin, s->to_device_end})
      if (e != nullptr) cudaEventDestroy(Event(e));
  for (void* stream : {to_host_stream_, to_device_stream_})
    if (stream != nullptr) cudaStreamDestroy(Stream(stream));
}

absl::Status RemoteMoeExchange::BeginStep(const std::vector<int>& rows) {
  if (rows.size() > slots_.size())
    return absl::InvalidArgumentError(absl::StrCat(rows.size(), " micro-batches for an exchange of ", slots_.size()));
  bool unfinished = false;
  for (std::unique_ptr<Slot>& s : slots_) {
    unfinished |= s->state != State::kIdle;
    s->call.reset();  // a failed step's call: waited for, its answer dropped
    s->state = State::kIdle;
    s->to_device_untimed = false;
  }
  // After a failed step a copy may still be queued; a complete step's copies have all ended (the
  // host waited for every copy out, the compute stream for every copy back).
  if (unfinished) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(Stream(to_host_stream_)));
    EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(Stream(to_device_stream_)));
  }
  for (size_t m = 0; m < slots_.size(); ++m) {
    Slot& s = *slots_[m];
    s.rows = m < rows.size() ? rows[m] : 0;
    const size_t n = static_cast<size_t>(s.rows) * hidden_;
    EXL3_RETURN_IF_ERROR(s.x.Reserve(n));
    EXL3_RETURN_IF_ERROR(s.y.Reserve(n));
    EXL3_RETURN_IF_ERROR(s.routing.Reserve(2 * static_cast<size_t>(s.rows) * top_k_));
  }
  times_ = RemoteExchangeTimes{};
  return absl::OkStatus();
}

absl::Status RemoteMoeExchange::CheckMicroBatch(int m) const {
  if (m < 0 || m >= micro_batches())
    return absl::InvalidArgumentError(absl::StrCat("micro-batch ", m, " of an exchange of ", micro_batches()));
  return absl::OkStatus();
}

absl::Status RemoteMoeExchange::Send(int m, int layer, const float* device_x, const MoeRouting* device_routing,
                                     const int32_t* host_token_ids, void* compute) {
  EXL3_RETURN_IF_ERROR(CheckMicroBatch(m));
  Slot& s = *slots_[m];
  if (s.state != State::kIdle)
    return absl::FailedPreconditionError(absl::StrCat("micro-batch ", m, ": layer ", layer, " sent while layer ",
                                                      s.layer, "'s exchange is unfinished"));
  s.layer = layer;
  const size_t bytes = static_cast<size_t>(s.rows) * hidden_ * sizeof(float);
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(Event(s.x_ready), Stream(compute)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(Stream(to_host_stream_), Event(s.x_ready), 0));
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(Event(s.to_host_begin), Stream(to_host_stream_)));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(s.x.get(), device_x, bytes, cudaMemcpyDeviceToHost, Stream(to_host_stream_)));
  if (device_routing != nullptr) {
    if (device_routing->k != top_k_)
      return absl::InvalidArgumentError(absl::StrCat("routing of ", device_routing->k, " experts per token for an ",
                                                     "exchange staged for ", top_k_));
    const size_t n = static_cast<size_t>(s.rows) * top_k_;
    int32_t* ids = reinterpret_cast<int32_t*>(s.routing.get());
    float* weights = s.routing.get() + n;
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids, device_routing->ids, n * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                              Stream(to_host_stream_)));
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(weights, device_routing->weights, n * sizeof(float),
                                              cudaMemcpyDeviceToHost, Stream(to_host_stream_)));
    s.host_routing = MoeRouting{top_k_, ids, weights};
  }
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(Event(s.to_host_end), Stream(to_host_stream_)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(Event(s.to_host_end)));
  EXL3_ASSIGN_OR_RETURN(const double t, ElapsedSeconds(s.to_host_begin, s.to_host_end));
  times_.to_host_s += t;
  s.started_at = Now();
  s.call = device_routing != nullptr ? executor_->StartRouted(layer, s.x.get(), s.rows, s.host_routing, s.y.get())
                                     : executor_->Start(layer, s.x.get(), s.rows, host_token_ids, s.y.get());
  s.state = State::kInFlight;
  return absl::OkStatus();
}

absl::Status RemoteMoeExchange::CollectToDeviceTime(Slot& s) {
  if (!s.to_device_untimed) return absl::OkStatus();
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(Event(s.to_device_end)));
  EXL3_ASSIGN_OR_RETURN(const double t, ElapsedSeconds(s.to_device_begin, s.to_device_end));
  times_.to_device_s += t;
  s.to_device_untimed = false;
  return absl::OkStatus();
}

absl::Status RemoteMoeExchange::Finish(int m, float* device_y, void* compute) {
  EXL3_RETURN_IF_ERROR(CheckMicroBatch(m));
  Slot& s = *slots_[m];
  if (s.state != State::kInFlight)
    return absl::FailedPreconditionError(absl::StrCat("micro-batch ", m, ": no exchange in flight to finish"));
  const double wait_from = Now();
  const absl::Status answer = s.call->Wait();
  const double done = Now();
  s.call.reset();
  s.state = State::kIdle;
  times_.wait_s += done - wait_from;
  times_.call_s += done - s.started_at;
  ++times_.exchanges;
  if (!answer.ok()) return answer;
  // The previous copy back of this micro-batch has ended (this call's copy out came after the
  // compute stream waited for it); its events are reused now.
  EXL3_RETURN_IF_ERROR(CollectToDeviceTime(s));
  const size_t bytes = static_cast<size_t>(s.rows) * hidden_ * sizeof(float);
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(Event(s.to_device_begin), Stream(to_device_stream_)));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_y, s.y.get(), bytes, cudaMemcpyHostToDevice, Stream(to_device_stream_)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(Event(s.to_device_end), Stream(to_device_stream_)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(Stream(compute), Event(s.to_device_end), 0));
  s.to_device_untimed = true;
  return absl::OkStatus();
}

absl::StatusOr<RemoteExchangeTimes> RemoteMoeExchange::StepTimes() {
  for (std::unique_ptr<Slot>& s : slots_) EXL3_RETURN_IF_ERROR(CollectToDeviceTime(*s));
  return times_;
}

}  // namespace exl3::engine::cuda

#include "services/router/combine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/moe_cpu.h"
#include "services/common/status.h"
#include "services/common/wire.h"

namespace exl3::router {

namespace {
uint64_t Micros(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}
}  // namespace

absl::Status AddWorkerOutput(LayerCall& c, const std::vector<int32_t>& rows,
                             const pb::Tensor& output, const std::string& worker) {
  if (absl::Status v = svc::ValidateTensor(output, "worker output",
                                           {static_cast<int64_t>(rows.size()), c.hidden_size});
      !v.ok()) {
    return absl::InternalError(absl::StrCat("worker ", worker, " sent a bad answer: ", v.message()));
  }
  // Added straight from the wire bytes: fp32 rows as they are, fp16/bf16 rows converted one at a
  // time (no [rows, H] fp32 copy of the answer).
  const size_t H = static_cast<size_t>(c.hidden_size);
  const size_t row_bytes = H * svc::WireDTypeSize(output.dtype());
  const uint8_t* wire = reinterpret_cast<const uint8_t*>(output.data().data());
  std::vector<float> row;
  if (output.dtype() != pb::DTYPE_FP32) row.resize(H);
  std::lock_guard<std::mutex> l(c.mu);
  if (c.ended) return absl::OkStatus();
  float* sum = c.sum_data();
  // A part's rows are distinct: as many as the call's are all of them.
  const bool copy = !c.sum_written && rows.size() == static_cast<size_t>(c.num_tokens);
  if (!c.sum_written && !copy) std::fill_n(sum, static_cast<size_t>(c.num_tokens) * H, 0.0f);
  c.sum_written = true;
  for (size_t r = 0; r < rows.size(); ++r) {
    float* dst = sum + static_cast<size_t>(rows[r]) * H;
    if (copy) {
      svc::WireToFloat(output.dtype(), wire + r * row_bytes, H, dst);
      continue;
    }
    const float* src;
    if (output.dtype() == pb::DTYPE_FP32) {
      src = reinterpret_cast<const float*>(wire + r * row_bytes);
    } else {
      svc::WireToFloat(output.dtype(), wire + r * row_bytes, H, row.data());
      src = row.data();
    }
    for (size_t i = 0; i < H; ++i) dst[i] += src[i];
  }
  c.t_last_answer = Clock::now();
  return absl::OkStatus();
}

LocalSharedExpert::LocalSharedExpert(const Exl3Model& model, int threads)
    : model_(model), cpu_(threads) {}

absl::Status LocalSharedExpert::AddTo(LayerCall& c) {
  absl::StatusOr<MoeLayerView> view = model_.LayerView(c.layer);
  if (!view.ok() || view->shared == nullptr) return absl::OkStatus();  // the layer has none
  std::vector<float> y(static_cast<size_t>(c.num_tokens) * c.hidden_size);
  const MoeAssignments none =
      MoeAssignments::Fixed(static_cast<int>(c.num_tokens), 0, nullptr, nullptr);
  if (absl::Status st = cpu_.Moe(*view, c.hidden.data(), none, true, y.data()); !st.ok()) {
    return absl::InternalError(absl::StrCat("shared expert: ", st.message()));
  }
  std::lock_guard<std::mutex> l(c.mu);
  if (c.ended) return absl::OkStatus();
  float* sum = c.sum_data();
  if (!c.sum_written) {
    std::copy(y.begin(), y.end(), sum);  // every row
    c.sum_written = true;
  } else {
    for (size_t i = 0; i < y.size(); ++i) sum[i] += y[i];
  }
  return absl::OkStatus();
}

size_t AnswerBytesBound(int64_t num_tokens, int hidden_size, pb::DType out_dtype, int k) {
  return static_cast<size_t>(num_tokens) * hidden_size * svc::WireDTypeSize(out_dtype) +
         static_cast<size_t>(num_tokens) * k * 9 + 256;
}

LayerAnswer MakeAnswer(const LayerCall& c, const absl::Status& st) {
  LayerAnswer a;
  a.t_combine = Clock::now();
  pb::MoeLayerResponse& r = a.response;
  r.set_id(c.id);
  r.set_layer(c.layer);
  svc::SetRequestStatus(st, r.mutable_status());
  pb::RouterTimings* tm = r.mutable_timings();
  if (st.ok()) {
    // In place (sum_out): the caller has the sum already.
    if (c.sum_out == nullptr) {
      svc::EncodeTensor(c.sum.data(), {c.num_tokens, c.hidden_size}, c.out_dtype,
                        r.mutable_output());
    }
    pb::TopK* tk = r.mutable_topk();
    tk->set_k(c.routing.k);
    *tk->mutable_ids() = {c.routing.ids.begin(), c.routing.ids.end()};
    *tk->mutable_weights() = {c.routing.weights.begin(), c.routing.weights.end()};
    tm->set_gate_us(Micros(c.t_start, c.t_gate_end));
    tm->set_dispatch_us(Micros(c.t_gate_end, c.t_dispatch_end));
    if (!c.fanout.empty()) tm->set_workers_us(Micros(c.t_first_send, c.t_last_answer));
    tm->set_fanout(static_cast<uint32_t>(c.fanout.size()));
  }
  a.t_end = Clock::now();
  tm->set_combine_us(Micros(a.t_combine, a.t_end));
  tm->set_total_us(Micros(c.t_start, a.t_end));
  return a;
}

}  // namespace exl3::router

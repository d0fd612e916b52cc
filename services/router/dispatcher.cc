#include "services/router/dispatcher.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/index_ranges.h"
#include "services/common/status.h"
#include "services/router/combine.h"

namespace exl3::router {

namespace {

uint64_t Micros(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}

// The protocol's mark of an unused slot in ExpertRequest.expert_ids
// (proto/exl3serve/v1/exl3serve.proto).
constexpr int32_t kEmptySlot = -1;

// A part as an ExpertRequest, and the call's row of each of its hidden rows.
struct PartRequest {
  pb::ExpertRequest req;
  std::vector<int32_t> rows;
};

// Rows in order of first use (the shared expert's rows, all of them, after the routed ones);
// slots = most routed pairs of any row (the shared expert takes no slot: it is a flag of the
// whole part).
PartRequest BuildPart(const LayerCall& c, const Work& part) {
  PartRequest p;
  std::vector<std::optional<int32_t>> index_of(c.num_tokens);  // the call's row -> in p.rows
  std::vector<int> used;                                       // routed pairs per part row
  auto add_row = [&](int32_t r) {
    if (index_of[r]) return;
    index_of[r] = static_cast<int32_t>(p.rows.size());
    p.rows.push_back(r);
    used.push_back(0);
  };
  for (const Assignment& a : part.routed) {
    add_row(a.row);
    ++used[*index_of[a.row]];
  }
  if (part.shared_expert) {
    for (int32_t r = 0; r < c.num_tokens; ++r) add_row(r);
  }
  const int slots = used.empty() ? 0 : *std::max_element(used.begin(), used.end());
  const size_t n = p.rows.size();

  pb::ExpertRequest& req = p.req;
  req.set_layer(c.layer);
  req.set_slots(slots);
  req.set_shared_expert(part.shared_expert);
  req.set_output_dtype(pb::DTYPE_FP32);
  pb::Tensor* h = req.mutable_hidden();
  h->set_dtype(c.in_dtype);
  h->add_shape(static_cast<int64_t>(n));
  h->add_shape(c.hidden_size);
  // Into a kept buffer (warm pages), row runs appended: no zero-fill before the copy. The
  // shared expert on the worker makes the rows 0..T-1 in order, one run.
  std::string* data = h->mutable_data();
  if (c.spare) *data = c.spare->Take();
  data->reserve(n * c.row_bytes);
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && p.rows[j] == p.rows[j - 1] + 1) ++j;
    data->append(c.hidden_bytes.data() + p.rows[i] * c.row_bytes, (j - i) * c.row_bytes);
    i = j;
  }
  std::vector<int32_t> ids(n * slots, kEmptySlot);
  std::vector<float> weights(n * slots, 0.0f);
  std::vector<int> fill(n, 0);
  for (const Assignment& a : part.routed) {
    const size_t i = *index_of[a.row];
    ids[i * slots + fill[i]] = a.expert;
    weights[i * slots + fill[i]] = a.weight;
    ++fill[i];
  }
  *req.mutable_expert_ids() = {ids.begin(), ids.end()};
  *req.mutable_expert_weights() = {weights.begin(), weights.end()};
  return p;
}

std::vector<int32_t> ExpertsOf(const Work& w) {
  std::vector<int32_t> e;
  for (const Assignment& a : w.routed) e.push_back(a.expert);
  return e;
}

// Among `holders`: up, not failed for this call, the one with the shallowest queue: its
// sub-requests outstanding, plus one when this choice already gives it a part (so one call's
// experts spread over an expert's replicas instead of piling onto the first worker chosen). Equal
// depths take turns: the holders are scanned from position `turn` (mod their number) and the first
// of the shallowest wins. `join_parts` (the shared expert, which covers every row): a holder that
// already has a part comes first, as the shared expert then rides in that part. None when no
// holder serves. One pass, no allocation: it runs per expert of every call.
std::optional<int> ChooseHolder(const WorkerSet& set, const std::vector<int>& holders,
                                const std::set<int>& failed, const std::map<int, Work>& parts,
                                uint32_t turn, bool join_parts) {
  const size_t n = holders.size();
  std::optional<int> best;
  std::pair<int, int> best_rank;  // (no part while joining parts, depth): smaller is better
  for (size_t i = 0; i < n; ++i) {
    const int w = holders[(turn + i) % n];
    const WorkerLink& link = set.link(w);
    if (!link.up() || failed.count(w)) continue;
    const bool has_part = parts.count(w) > 0;
    const std::pair<int, int> rank{join_parts && !has_part ? 1 : 0,
                                   link.outstanding() + (has_part && !join_parts ? 1 : 0)};
    if (!best || rank < best_rank) {
      best = w;
      best_rank = rank;
    }
  }
  return best;
}

}  // namespace

Work RoutedWork(const LayerCall& c, bool shared_on_workers) {
  Work w;
  const int k = c.routing.k;
  w.routed.reserve(c.routing.ids.size());
  for (size_t i = 0; i < c.routing.ids.size(); ++i) {
    w.routed.push_back(Assignment{static_cast<int32_t>(i / k), c.routing.ids[i],
                                  c.routing.weights[i]});
  }
  w.shared_expert = shared_on_workers && c.include_shared_expert;
  return w;
}

std::string ExpertsText(std::vector<int32_t> experts, bool shared_expert) {
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  if (!shared_expert) return absl::StrCat("experts ", FormatIndexRanges(experts));
  if (experts.empty()) return "shared expert";
  return absl::StrCat("experts ", FormatIndexRanges(experts), " and the shared expert");
}

// What a sent part's callback needs: where it went, what it carried (for a failover) and the
// call's row of each row of its answer.
struct Dispatcher::PartInFlight {
  int worker = 0;
  uint64_t key = 0;  // in LayerCall::subs
  Work work;
  std::vector<int32_t> rows;
};

Dispatcher::Dispatcher(RouterMetrics* metrics, EndFn on_end)
    : metrics_(metrics), on_end_(std::move(on_end)) {}

Dispatcher::~Dispatcher() = default;

void Dispatcher::Start(const std::shared_ptr<LayerCall>& c, Work work) {
  ArmDeadline(c);
  Send(c, std::move(work), std::nullopt);
}

void Dispatcher::HandlerDone(const std::shared_ptr<LayerCall>& c) {
  if (c->HandlerFinished()) End(c, absl::OkStatus());
}

void Dispatcher::PartDone(const std::shared_ptr<LayerCall>& c) {
  if (c->PartFinished()) End(c, absl::OkStatus());
}

void Dispatcher::End(const std::shared_ptr<LayerCall>& c, const absl::Status& st,
                     pb::CancelReason reason) {
  std::optional<LayerCall::Ending> e = c->End(st.ok(), reason);
  if (!e) return;
  for (const SubRequest& sub : e->withdraw) c->workers->link(sub.worker).Cancel(sub.ticket, reason);
  // A no-op when the deadline itself ended the call (its entry is gone once it runs).
  if (e->deadline_entry) timer_.Cancel(*e->deadline_entry);
  on_end_(c, st);
}

void Dispatcher::ArmDeadline(const std::shared_ptr<LayerCall>& c) {
  if (!c->deadline) return;
  std::weak_ptr<LayerCall> weak = c;
  const svc::DeadlineTimer::Entry entry = timer_.At(*c->deadline, [this, weak] {
    if (std::shared_ptr<LayerCall> cc = weak.lock()) OnDeadline(cc);
  });
  if (!c->SetDeadlineEntry(entry)) timer_.Cancel(entry);  // ended meanwhile (stream cancelled)
}

void Dispatcher::OnDeadline(const std::shared_ptr<LayerCall>& c) {
  std::set<int> fanout;
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->ended) return;
    fanout = c->fanout;
  }
  std::vector<std::string> waiting;
  for (int w : fanout) waiting.push_back(c->workers->link(w).name());
  const uint64_t budget_ms = Micros(c->t_start, *c->deadline) / 1000;
  End(c,
      absl::DeadlineExceededError(absl::StrCat(
          "layer ", c->layer, " request ", c->id, " exceeded its deadline of ", budget_ms,
          " ms (workers involved: ", waiting.empty() ? "none" : absl::StrJoin(waiting, ", "), ")")),
      pb::CANCEL_REASON_DEADLINE);
}

Dispatcher::Choice Dispatcher::Choose(LayerCall& c, const Work& work) {
  std::set<int> failed;
  {
    std::lock_guard<std::mutex> l(c.mu);
    failed = c.failed;
  }
  const WorkerSet& set = *c.workers;
  const ExpertHolders& holders = set.holders();
  Choice choice;
  // The turns of this choice's ties: consecutive experts take consecutive turns, consecutive
  // choices start at consecutive turns (round robin over calls as well as within one).
  uint32_t turn = next_turn_.fetch_add(1, std::memory_order_relaxed);
  // Expert -> the part of its chosen worker, chosen at the expert's first use (none when no
  // holder serves it); by index, not a map: a 64-token call makes 512 look-ups. Experts are in
  // 0..num_experts-1 (the gate checks them; holders.Routed indexes by them too).
  const size_t num_experts = static_cast<size_t>(holders.num_experts());
  std::vector<Work*> part_of(num_experts, nullptr);  // map nodes stay put
  std::vector<bool> chosen(num_experts, false);
  for (const Assignment& a : work.routed) {
    const size_t e = static_cast<size_t>(a.expert);
    if (!chosen[e]) {
      chosen[e] = true;
      if (std::optional<int> w = ChooseHolder(set, holders.Routed(c.layer, a.expert), failed,
                                              choice.parts, turn++, /*join_parts=*/false)) {
        part_of[e] = &choice.parts[*w];
      } else {
        choice.unserved_routed.push_back(a.expert);
      }
    }
    if (part_of[e] != nullptr) part_of[e]->routed.push_back(a);
  }
  if (work.shared_expert) {
    if (std::optional<int> w = ChooseHolder(set, holders.Shared(c.layer), failed, choice.parts,
                                            turn, /*join_parts=*/true)) {
      choice.parts[*w].shared_expert = true;
    } else {
      choice.unserved_shared = true;
    }
  }
  return choice;
}

void Dispatcher::FailUnserved(const std::shared_ptr<LayerCall>& c, const Choice& choice) {
  std::string why;
  {
    std::lock_guard<std::mutex> l(c->mu);
    why = c->last_failure;
  }
  const WorkerSet& set = *c->workers;
  std::vector<std::string> holders;
  auto add_names = [&](const std::vector<int>& workers) {
    for (int w : workers) {
      const std::string& n = set.link(w).name();
      if (std::find(holders.begin(), holders.end(), n) == holders.end()) holders.push_back(n);
    }
  };
  std::vector<int32_t> routed = choice.unserved_routed;
  std::sort(routed.begin(), routed.end());
  for (int32_t e : routed) add_names(set.holders().Routed(c->layer, e));
  if (choice.unserved_shared) add_names(set.holders().Shared(c->layer));
  End(c, absl::UnavailableError(absl::StrCat(
             why.empty() ? "" : why + "; ", "no serving worker holds layer ", c->layer, " ",
             ExpertsText(routed, choice.unserved_shared), " (held by: ",
             holders.empty() ? "none" : absl::StrJoin(holders, ", "), ")")));
}

void Dispatcher::Send(const std::shared_ptr<LayerCall>& c, Work work,
                      std::optional<int> failed_worker) {
  if (work.empty() || c->has_ended()) return;
  Choice choice = Choose(*c, work);
  if (!choice.unserved_routed.empty() || choice.unserved_shared) return FailUnserved(c, choice);
  // Every expert of the failed share has another serving holder: a failover.
  if (failed_worker && metrics_) metrics_->Failover(c->workers->link(*failed_worker).name());
  const Clock::time_point now = Clock::now();
  if (c->deadline && *c->deadline <= now) {
    return End(c,
               absl::DeadlineExceededError(absl::StrCat("layer ", c->layer, " request ", c->id,
                                                        ": deadline passed")),
               pb::CANCEL_REASON_DEADLINE);
  }
  for (auto& [worker, part] : choice.parts) SendPart(c, worker, std::move(part), now);
}

void Dispatcher::SendPart(const std::shared_ptr<LayerCall>& c, int worker, Work part,
                          Clock::time_point now) {
  PartRequest p = BuildPart(*c, part);
  if (c->deadline) p.req.set_timeout_us(std::max<uint64_t>(1, Micros(now, *c->deadline)));
  const std::optional<uint64_t> key = c->BeginPart(worker, now);
  if (!key) return;  // the call ended
  auto in_flight = std::make_shared<PartInFlight>(
      PartInFlight{worker, *key, std::move(part), std::move(p.rows)});
  const size_t bytes = p.req.ByteSizeLong();
  WorkerLink& link = c->workers->link(worker);
  absl::StatusOr<WorkerLink::Ticket> ticket =
      link.Send(std::move(p.req), bytes, [this, c, in_flight](absl::Status st, pb::ExpertResponse* r) {
        OnPartAnswer(c, *in_flight, std::move(st), r);
      });
  if (!ticket.ok()) return OnPartAnswer(c, *in_flight, ticket.status(), nullptr);
  if (std::optional<pb::CancelReason> why = c->PartSent(*key, *ticket)) link.Cancel(*ticket, *why);
}

void Dispatcher::OnPartAnswer(const std::shared_ptr<LayerCall>& c, PartInFlight& part,
                              absl::Status st, pb::ExpertResponse* resp) {
  c->PartAnswered(part.key);
  if (st.ok() && resp->status().code() == pb::OK) {
    absl::Status added =
        AddWorkerOutput(*c, part.rows, resp->output(), c->workers->link(part.worker).name());
    if (!added.ok()) return End(c, added);
    return PartDone(c);
  }
  const absl::Status err = st.ok() ? svc::FromRequestStatus(resp->status()) : st;
  OnPartFailed(c, part.worker, std::move(part.work), err);
}

void Dispatcher::OnPartFailed(const std::shared_ptr<LayerCall>& c, int worker, Work part,
                              const absl::Status& err) {
  const WorkerLink& w = c->workers->link(worker);
  if (!svc::IsRetryable(err.code())) {
    if (err.code() == absl::StatusCode::kDeadlineExceeded) {
      return End(c,
                 absl::DeadlineExceededError(absl::StrCat("layer ", c->layer, " request ", c->id,
                                                          ": worker ", w.name(), ": ",
                                                          err.message())),
                 pb::CANCEL_REASON_DEADLINE);
    }
    return End(c, absl::Status(err.code(), absl::StrCat("worker ", w.name(), ": ", err.message())));
  }
  if (c->deadline && Clock::now() >= *c->deadline) {
    return End(c,
               absl::DeadlineExceededError(absl::StrCat(
                   "layer ", c->layer, " request ", c->id, ": worker ", w.name(),
                   " failed and the deadline passed: ", err.message())),
               pb::CANCEL_REASON_DEADLINE);
  }
  const std::string why =
      absl::StrCat("worker ", w.name(), " (", w.address(), ") failed with layer ", c->layer, " ",
                   ExpertsText(ExpertsOf(part), part.shared_expert), ": ", err.message());
  if (!c->NoteFailure(worker, why)) return;  // the call ended
  Send(c, std::move(part), worker);
  PartDone(c);
}

}  // namespace exl3::router

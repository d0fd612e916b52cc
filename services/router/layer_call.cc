#include "services/router/layer_call.h"

#include <algorithm>
#include <utility>

namespace exl3::router {

LayerCall::~LayerCall() {
  if (spare) spare->Give(std::move(hidden_bytes));
}

bool LayerCall::SetDeadlineEntry(const svc::DeadlineTimer::Entry& entry) {
  std::lock_guard<std::mutex> l(mu);
  if (ended) return false;
  deadline_entry = entry;
  return true;
}

std::optional<uint64_t> LayerCall::BeginPart(int worker, Clock::time_point now) {
  std::lock_guard<std::mutex> l(mu);
  if (ended) return std::nullopt;
  ++parts_out;
  if (fanout.empty()) t_first_send = now;
  fanout.insert(worker);
  const uint64_t key = next_sub_key++;
  subs[key] = SubRequest{worker, SubRequest::State::kSending, {}};
  return key;
}

std::optional<pb::CancelReason> LayerCall::PartSent(uint64_t key,
                                                    const WorkerLink::Ticket& ticket) {
  std::lock_guard<std::mutex> l(mu);
  auto it = subs.find(key);
  if (it == subs.end()) return std::nullopt;  // answered already
  if (ended) {
    subs.erase(it);
    return end_reason;
  }
  it->second.state = SubRequest::State::kSent;
  it->second.ticket = ticket;
  return std::nullopt;
}

bool LayerCall::NoteFailure(int worker, std::string why) {
  std::lock_guard<std::mutex> l(mu);
  if (ended) return false;
  failed.insert(worker);
  last_failure = std::move(why);
  return true;
}

void LayerCall::PartAnswered(uint64_t key) {
  std::lock_guard<std::mutex> l(mu);
  subs.erase(key);
}

bool LayerCall::PartFinished() {
  std::lock_guard<std::mutex> l(mu);
  --parts_out;
  return !ended && !handler_running && parts_out == 0;
}

bool LayerCall::HandlerFinished() {
  std::lock_guard<std::mutex> l(mu);
  handler_running = false;
  return !ended && parts_out == 0;
}

std::optional<LayerCall::Ending> LayerCall::End(bool ok, pb::CancelReason reason) {
  std::lock_guard<std::mutex> l(mu);
  if (ended) return std::nullopt;
  ended = true;
  end_reason = reason;
  Ending e;
  e.deadline_entry = std::exchange(deadline_entry, std::nullopt);
  if (!ok) {
    for (auto it = subs.begin(); it != subs.end();) {
      if (it->second.state == SubRequest::State::kSent) {
        e.withdraw.push_back(std::move(it->second));
        it = subs.erase(it);
      } else {
        ++it;
      }
    }
  }
  return e;
}

void LayerCall::ZeroSumIfUnwritten() {
  std::lock_guard<std::mutex> l(mu);
  if (sum_written) return;
  std::fill_n(sum_out, static_cast<size_t>(num_tokens) * hidden_size, 0.0f);
  sum_written = true;
}

bool LayerCall::has_ended() {
  std::lock_guard<std::mutex> l(mu);
  return ended;
}

}  // namespace exl3::router

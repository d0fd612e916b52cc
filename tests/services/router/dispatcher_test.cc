// The dispatcher (services/router/dispatcher.h) on fake worker links: worker choice, parts,
// failover on each retryable code, deadlines, cancellation races, frozen and dying links, every
// holder down, expert-map reloads under load and the freeing of retired pools
// (services/router/retired_pools.h). No processes, no sockets: milliseconds per case.
#include "services/router/dispatcher.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "services/common/status.h"
#include "services/common/wire.h"
#include "services/router/retired_pools.h"
#include "services/router/router_metrics.h"
#include "services/router/worker_set.h"

namespace exl3::router {
namespace {

using std::chrono::milliseconds;

constexpr int kLayers = 2;
constexpr int kLayer = 1;  // the MoE layer
constexpr int kExperts = 8;
constexpr int kHidden = 4;
constexpr float kSharedScale = 100.0f;

// What a fake worker computes: expert e maps a row x to (e + 1) * x, the shared expert to
// kSharedScale * x; a part's answer is the weighted sum, as a real worker's.
std::vector<float> FakeCompute(const pb::ExpertRequest& req) {
  const int64_t n = req.hidden().shape(0);
  const int S = static_cast<int>(req.slots());
  std::vector<float> x(n * kHidden), y(n * kHidden, 0.0f);
  std::memcpy(x.data(), req.hidden().data().data(), x.size() * sizeof(float));
  for (int64_t r = 0; r < n; ++r) {
    float scale = req.shared_expert() ? kSharedScale : 0.0f;
    for (int s = 0; s < S; ++s) {
      const int32_t e = req.expert_ids(r * S + s);
      if (e >= 0) scale += req.expert_weights(r * S + s) * static_cast<float>(e + 1);
    }
    for (int i = 0; i < kHidden; ++i) y[r * kHidden + i] = scale * x[r * kHidden + i];
  }
  return y;
}

// A worker link the test drives. Modes say what Send does; the test can answer, fail, freeze or
// kill the link at any time. Callbacks run outside the link's lock, as the real link's do.
class FakeLink final : public WorkerLink {
 public:
  enum class Mode {
    kAnswerInline,  // answers inside Send (before it returns), as a very fast worker may
    kHold,          // keeps the sub-request until the test answers (AnswerAll) or kills the link
    kFailInline,    // answers inside Send with the in-band status `fail_code`
    kRefuse,        // Send itself fails UNAVAILABLE (not reading)
  };

  explicit FakeLink(std::string name, std::atomic<int>* destroyed = nullptr)
      : name_(std::move(name)), address_("fake:" + name_), destroyed_(destroyed) {}
  ~FakeLink() override {
    if (destroyed_) destroyed_->fetch_add(1);
  }

  const std::string& name() const override { return name_; }
  const std::string& address() const override { return address_; }
  bool up() const override { return up_.load(); }
  int outstanding() const override {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int>(pending_.size());
  }

  absl::StatusOr<Ticket> Send(pb::ExpertRequest req, size_t, SubCallback cb) override {
    Mode mode;
    absl::StatusCode fail;
    uint64_t id;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!up_) return absl::UnavailableError(name_ + " is down");
      mode = mode_;
      fail = fail_code_;
      if (mode == Mode::kRefuse) return absl::UnavailableError(name_ + " is not reading");
      id = next_id_++;
      req.set_id(id);
      sent_.push_back(req);
      if (mode == Mode::kHold) pending_[id] = Pending{std::move(req), std::move(cb)};
    }
    if (before_send_returns_) before_send_returns_();
    if (mode == Mode::kAnswerInline) Answer(req, cb);
    if (mode == Mode::kFailInline) {
      pb::ExpertResponse r;
      r.set_id(id);
      svc::SetRequestStatus(absl::Status(fail, "fake failure"), r.mutable_status());
      cb(absl::OkStatus(), &r);
    }
    return Ticket{session_, id};
  }

  void Cancel(const Ticket& t, pb::CancelReason reason) override {
    Pending p;
    {
      std::lock_guard<std::mutex> l(mu_);
      cancels_.push_back({t.id, reason});
      auto it = pending_.find(t.id);
      if (it == pending_.end()) return;
      p = std::move(it->second);
      pending_.erase(it);
    }
    // As a real link withdrawing a sub-request not yet written.
    p.cb(absl::CancelledError("withdrawn"), nullptr);
  }

  void Stop() override {
    stopped_ = true;
    Die("stopped");
  }

  // ---- driven by the test ----
  void set_mode(Mode m, absl::StatusCode fail = absl::StatusCode::kOk) {
    std::lock_guard<std::mutex> l(mu_);
    mode_ = m;
    fail_code_ = fail;
  }
  void set_up(bool up) { up_ = up; }
  void set_before_send_returns(std::function<void()> fn) { before_send_returns_ = std::move(fn); }
  // Answers every held sub-request (computed as a worker would).
  int AnswerAll() {
    std::map<uint64_t, Pending> held = TakePending();
    for (auto& [id, p] : held) Answer(p.req, p.cb);
    return static_cast<int>(held.size());
  }
  // Fails every held sub-request with the in-band status `code`.
  void FailAll(absl::StatusCode code) {
    for (auto& [id, p] : TakePending()) {
      pb::ExpertResponse r;
      r.set_id(id);
      svc::SetRequestStatus(absl::Status(code, "fake failure"), r.mutable_status());
      p.cb(absl::OkStatus(), &r);
    }
  }
  // The link breaks: down, and every held sub-request fails UNAVAILABLE (a session's end).
  void Die(const std::string& why) {
    up_ = false;
    for (auto& [id, p] : TakePending()) {
      p.cb(absl::UnavailableError(absl::StrCat("worker ", name_, " stream ended: ", why)), nullptr);
    }
  }
  std::vector<pb::ExpertRequest> sent() const {
    std::lock_guard<std::mutex> l(mu_);
    return sent_;
  }
  std::vector<std::pair<uint64_t, pb::CancelReason>> cancels() const {
    std::lock_guard<std::mutex> l(mu_);
    return cancels_;
  }
  bool stopped() const { return stopped_.load(); }

 private:
  struct Pending {
    pb::ExpertRequest req;
    SubCallback cb;
  };
  std::map<uint64_t, Pending> TakePending() {
    std::lock_guard<std::mutex> l(mu_);
    std::map<uint64_t, Pending> out;
    out.swap(pending_);
    return out;
  }
  static void Answer(const pb::ExpertRequest& req, const SubCallback& cb) {
    pb::ExpertResponse r;
    r.set_id(req.id());
    const std::vector<float> y = FakeCompute(req);
    svc::EncodeTensor(y.data(), {req.hidden().shape(0), kHidden}, pb::DTYPE_FP32, r.mutable_output());
    cb(absl::OkStatus(), &r);
  }

  const std::string name_, address_;
  std::atomic<int>* const destroyed_;
  const std::shared_ptr<int> session_ = std::make_shared<int>(0);  // what tickets name
  std::atomic<bool> up_{true};
  std::atomic<bool> stopped_{false};
  std::function<void()> before_send_returns_;
  mutable std::mutex mu_;
  Mode mode_ = Mode::kAnswerInline;             // guarded by mu_
  absl::StatusCode fail_code_ = absl::StatusCode::kOk;  // guarded by mu_
  uint64_t next_id_ = 1;                        // guarded by mu_
  std::map<uint64_t, Pending> pending_;         // guarded by mu_
  std::vector<pb::ExpertRequest> sent_;         // guarded by mu_
  std::vector<std::pair<uint64_t, pb::CancelReason>> cancels_;  // guarded by mu_
};

// How each worker of a set is given: its link and the routed experts of kLayer it holds (and
// whether it holds the shared expert).
struct Holder {
  std::shared_ptr<FakeLink> link;
  std::vector<int> experts;
  bool shared = false;
};

std::shared_ptr<WorkerSet> MakeSet(const std::vector<Holder>& holders, bool shared_on_workers) {
  ExpertHolders h(kLayers, kExperts, {kLayer}, shared_on_workers);
  std::vector<std::shared_ptr<WorkerLink>> links;
  for (size_t i = 0; i < holders.size(); ++i) {
    links.push_back(holders[i].link);
    for (int e : holders[i].experts) h.AddRouted(kLayer, e, static_cast<int>(i));
    if (holders[i].shared) h.AddShared(kLayer, static_cast<int>(i));
  }
  return std::make_shared<WorkerSet>(std::move(links), std::move(h));
}

// What the dispatcher's end callback saw of one call.
struct Outcome {
  int ends = 0;
  absl::Status status;
  std::vector<float> sum;
};

// The dispatcher under test with its end callback recording outcomes, and calls to run on it.
class DispatcherTest : public ::testing::Test {
 protected:
  DispatcherTest()
      : metrics_(registry_, {kLayer}),
        dispatcher_(&metrics_, [this](const std::shared_ptr<LayerCall>& c, const absl::Status& st) {
          std::lock_guard<std::mutex> l(mu_);
          Outcome& o = outcomes_[c->id];
          ++o.ends;
          o.status = st;
          if (st.ok()) {
            const float* sum = c->sum_data();
            o.sum.assign(sum, sum + c->num_tokens * c->hidden_size);
          }
          cv_.notify_all();
        }) {}

  std::shared_ptr<FakeLink> Link(const std::string& name,
                                 std::atomic<int>* destroyed = nullptr) {
    metrics_.AddWorker(name);
    return std::make_shared<FakeLink>(name, destroyed);
  }

  // A call of T tokens on `set`: token t uses experts ids[t] (weights 0.5, 0.25, ...), hidden
  // random; `deadline_ms` < 0: none.
  std::shared_ptr<LayerCall> MakeCall(const std::shared_ptr<const WorkerSet>& set,
                                      const std::vector<std::vector<int32_t>>& ids,
                                      int deadline_ms = 5000, bool shared = false) {
    auto c = std::make_shared<LayerCall>();
    c->workers = set;
    c->id = next_id_++;
    c->layer = kLayer;
    c->num_tokens = static_cast<int64_t>(ids.size());
    c->hidden_size = kHidden;
    c->row_bytes = kHidden * sizeof(float);
    c->hidden.resize(ids.size() * kHidden);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : c->hidden) v = u(rng_);
    c->hidden_bytes.assign(reinterpret_cast<const char*>(c->hidden.data()),
                           c->hidden.size() * sizeof(float));
    c->include_shared_expert = shared;
    c->routing.k = static_cast<int>(ids[0].size());
    for (const auto& row : ids) {
      float w = 0.5f;
      for (int32_t e : row) {
        c->routing.ids.push_back(e);
        c->routing.weights.push_back(w);
        w /= 2;
      }
    }
    c->t_start = Clock::now();
    if (deadline_ms >= 0) c->deadline = c->t_start + milliseconds(deadline_ms);
    c->sum.assign(c->hidden.size(), 0.0f);
    return c;
  }

  // Start + HandlerDone, as the service's handler does.
  void Run(const std::shared_ptr<LayerCall>& c) {
    dispatcher_.Start(c, RoutedWork(*c, c->workers->shared_on_workers()));
    dispatcher_.HandlerDone(c);
  }

  // Makes `busy`'s queue one sub-request deep: a call of `expert` held there, sent there by
  // taking `others` down meanwhile (an idle replica would take its turn otherwise). `busy` stays
  // in kHold; the test answers the call (busy.AnswerAll()) when it is done.
  std::shared_ptr<LayerCall> HoldOne(const std::shared_ptr<WorkerSet>& set, FakeLink& busy,
                                     const std::vector<FakeLink*>& others, int32_t expert) {
    for (FakeLink* o : others) o->set_up(false);
    busy.set_mode(FakeLink::Mode::kHold);
    auto c = MakeCall(set, {{expert}});
    Run(c);
    for (FakeLink* o : others) o->set_up(true);
    EXPECT_EQ(busy.outstanding(), 1);
    return c;
  }

  // Waits (bounded) for `c` to end and returns what the end callback saw.
  Outcome Wait(const std::shared_ptr<LayerCall>& c, milliseconds timeout = milliseconds(5000)) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, timeout, [&] { return outcomes_.count(c->id) > 0; });
    auto it = outcomes_.find(c->id);
    return it == outcomes_.end() ? Outcome{} : it->second;
  }
  bool Ended(const std::shared_ptr<LayerCall>& c) {
    std::lock_guard<std::mutex> l(mu_);
    return outcomes_.count(c->id) > 0;
  }

  // What the combined answer of `c` must be (FakeCompute summed over its experts).
  static std::vector<float> Expected(const LayerCall& c) {
    std::vector<float> y(c.hidden.size());
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      float scale = c.include_shared_expert && c.workers->shared_on_workers() ? kSharedScale : 0;
      for (int j = 0; j < c.routing.k; ++j) {
        scale += c.routing.weights[t * c.routing.k + j] *
                 static_cast<float>(c.routing.ids[t * c.routing.k + j] + 1);
      }
      for (int i = 0; i < kHidden; ++i) y[t * kHidden + i] = scale * c.hidden[t * kHidden + i];
    }
    return y;
  }
  static void ExpectSum(const LayerCall& c, const Outcome& o) {
    ASSERT_TRUE(o.status.ok()) << o.status;
    const std::vector<float> want = Expected(c);
    ASSERT_EQ(o.sum.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(o.sum[i], want[i], 1e-5f) << i;
  }

  double Failovers(const std::string& worker) {
    for (const auto& fam : registry_.Collect()) {
      if (fam.name != "exl3_router_failovers_total") continue;
      for (const auto& m : fam.metric) {
        for (const auto& label : m.label) {
          if (label.name == "worker" && label.value == worker) return m.counter.value;
        }
      }
    }
    return -1;
  }

  prometheus::Registry registry_;
  RouterMetrics metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Outcome> outcomes_;  // by call id; guarded by mu_
  Dispatcher dispatcher_;  // after what its end callback uses
  std::mt19937 rng_{7};
  uint64_t next_id_ = 1;
};

// ---- worker choice and parts ----

TEST_F(DispatcherTest, EachWorkerGetsOnlyTheRowsAndExpertsItHolds) {
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  // Token 0 only on a, token 1 on both, token 2 only on b.
  auto c = MakeCall(set, {{0, 1}, {2, 5}, {6, 7}});
  Run(c);
  Outcome o = Wait(c);
  ASSERT_EQ(o.ends, 1);
  ExpectSum(*c, o);
  ASSERT_EQ(a->sent().size(), 1u);
  ASSERT_EQ(b->sent().size(), 1u);
  const pb::ExpertRequest ra = a->sent()[0], rb = b->sent()[0];
  EXPECT_EQ(ra.hidden().shape(0), 2);  // rows 0 and 1
  EXPECT_EQ(ra.slots(), 2);
  EXPECT_EQ(std::vector<int32_t>(ra.expert_ids().begin(), ra.expert_ids().end()),
            (std::vector<int32_t>{0, 1, 2, -1}));
  EXPECT_EQ(rb.hidden().shape(0), 2);  // rows 1 and 2
  EXPECT_EQ(std::vector<int32_t>(rb.expert_ids().begin(), rb.expert_ids().end()),
            (std::vector<int32_t>{5, -1, 6, 7}));
  EXPECT_GT(ra.timeout_us(), 0u);
  EXPECT_LE(ra.timeout_us(), 5000000u);
  EXPECT_EQ(c->fanout.size(), 2u);
}

TEST_F(DispatcherTest, PartsCarryTheirRowsBitForBitInAKeptBuffer) {
  // BuildPart writes a part's rows into a buffer from LayerCall::spare (holding stale bytes of
  // another size), a run of consecutive rows at a time: each part's hidden states must be exactly
  // its rows of the call's, in order, whatever the runs; the call's bytes go back when it is gone.
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  auto spare = std::make_shared<svc::SpareBuffers>();
  for (int i = 0; i < 2; ++i) spare->Give(std::string(svc::SpareBuffers::kMinBufferBytes, '\x7f'));
  // a: rows 0, 1, 3, 4 (runs 0-1 and 3-4); b: rows 1, 2, 4 (runs 1-2 and 4).
  auto c = MakeCall(set, {{0, 1}, {2, 5}, {6, 7}, {3, 0}, {1, 4}});
  c->spare = spare;
  c->hidden_bytes.reserve(svc::SpareBuffers::kMinBufferBytes);  // large enough to be kept
  Run(c);
  ExpectSum(*c, Wait(c));
  ASSERT_EQ(a->sent().size(), 1u);
  ASSERT_EQ(b->sent().size(), 1u);
  auto rows_of = [&](const std::vector<int>& rows) {
    std::string want;
    for (int r : rows) want.append(c->hidden_bytes.data() + r * c->row_bytes, c->row_bytes);
    return want;
  };
  EXPECT_EQ(a->sent()[0].hidden().data(), rows_of({0, 1, 3, 4}));
  EXPECT_EQ(b->sent()[0].hidden().data(), rows_of({1, 2, 4}));
  EXPECT_EQ(spare->kept(), 0u);  // both taken by the parts (the fake link keeps them)
  c.reset();  // the last reference: ~LayerCall gives hidden_bytes back
  EXPECT_EQ(spare->kept(), 1u);
}

TEST_F(DispatcherTest, SumsIntoTheCallersBufferWhateverItHeld) {
  // LayerCall::sum_out (an in-process caller's buffer, not zeroed): one part covering every row is
  // copied into it, parts covering some rows zero it first and add.
  auto a = Link("a"), b = Link("b");
  auto one = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}}, false);
  auto two = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  for (const auto& set : {one, two}) {
    auto c = MakeCall(set, {{0, 1}, {2, 5}, {6, 7}});
    std::vector<float> out(c->hidden.size(), std::numeric_limits<float>::quiet_NaN());
    c->sum.clear();
    c->sum_out = out.data();
    c->sum_written = false;
    Run(c);
    Outcome o = Wait(c);
    ASSERT_EQ(o.ends, 1);
    ExpectSum(*c, o);
  }
}

TEST_F(DispatcherTest, ChoosesTheLeastLoadedReplicaAndSkipsDownWorkers) {
  auto a = Link("a"), a2 = Link("a2"), a3 = Link("a3");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}, {a3, {0, 1, 2, 3}}}, false);
  auto busy = HoldOne(set, *a, {a2.get(), a3.get()}, 0);
  a2->set_up(false);
  for (int i = 0; i < 4; ++i) {  // whatever the turn: a3 is the only idle serving replica
    auto c = MakeCall(set, {{i}});
    Run(c);
    ExpectSum(*c, Wait(c));
  }
  EXPECT_EQ(a->sent().size(), 1u);   // the busy call only
  EXPECT_EQ(a2->sent().size(), 0u);  // down
  EXPECT_EQ(a3->sent().size(), 4u);  // fewer outstanding than a
  a->AnswerAll();
  ExpectSum(*busy, Wait(busy));
}

TEST_F(DispatcherTest, SpreadsOneCallsExpertsOverAnExpertsReplicas) {
  // Issue 30: a replica got no traffic at any load (the call's first worker took every expert it
  // held). Two idle full replicas: the experts of one call alternate between them.
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  auto c = MakeCall(set, {{0, 1}, {2, 3}, {1, 0}});
  Run(c);
  ExpectSum(*c, Wait(c));
  ASSERT_EQ(a->sent().size(), 1u);
  ASSERT_EQ(a2->sent().size(), 1u);
  auto experts_of = [](const pb::ExpertRequest& r) {
    std::set<int32_t> e(r.expert_ids().begin(), r.expert_ids().end());
    e.erase(-1);
    return e;
  };
  const std::set<int32_t> on_a = experts_of(a->sent()[0]), on_a2 = experts_of(a2->sent()[0]);
  EXPECT_EQ(on_a.size(), 2u);
  EXPECT_EQ(on_a2.size(), 2u);
  for (int32_t e : on_a) EXPECT_EQ(on_a2.count(e), 0u) << e;  // each expert computed once
  EXPECT_EQ(c->fanout.size(), 2u);
}

TEST_F(DispatcherTest, EqualLoadsTakeTurnsAcrossCalls) {
  // One expert per call, both replicas idle each time: they alternate.
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  for (int i = 0; i < 10; ++i) {
    auto c = MakeCall(set, {{i % 4}});
    Run(c);
    ExpectSum(*c, Wait(c));
  }
  EXPECT_EQ(a->sent().size(), 5u);
  EXPECT_EQ(a2->sent().size(), 5u);
}

TEST_F(DispatcherTest, AnExpertGoesToItsLessBusyReplicaEvenBesideACallsOtherPart) {
  // Expert 5 is only on b; expert 1 on a and b; b is one deep: expert 1 goes to the idle a (a
  // second part of the call, computed in parallel), where dispatch used to join b's part.
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {1, 4, 5, 6, 7}}}, false);
  auto busy = HoldOne(set, *b, {}, 4);
  b->set_mode(FakeLink::Mode::kAnswerInline);
  auto c = MakeCall(set, {{5, 1}});
  Run(c);
  ExpectSum(*c, Wait(c));
  ASSERT_EQ(a->sent().size(), 1u);
  EXPECT_EQ(a->sent()[0].expert_ids(0), 1);
  EXPECT_EQ(b->sent().size(), 2u);  // the busy call's part and expert 5
  EXPECT_EQ(c->fanout.size(), 2u);
  b->AnswerAll();
  ExpectSum(*busy, Wait(busy));
}

TEST_F(DispatcherTest, ManyConcurrentCallsSplitEvenlyOverTwoReplicas) {
  // Calls in flight together (the workers answer later): queue depth keeps the two replicas
  // within one sub-request of each other.
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}, {a2, {0, 1, 2, 3, 4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  a2->set_mode(FakeLink::Mode::kHold);
  std::vector<std::shared_ptr<LayerCall>> calls;
  for (int i = 0; i < 40; ++i) {
    calls.push_back(MakeCall(set, {{i % 8}}));
    Run(calls.back());
    EXPECT_LE(std::abs(a->outstanding() - a2->outstanding()), 1) << i;
  }
  EXPECT_EQ(a->outstanding(), 20);
  EXPECT_EQ(a2->outstanding(), 20);
  a->AnswerAll();
  a2->AnswerAll();
  for (auto& c : calls) ExpectSum(*c, Wait(c));
}

TEST_F(DispatcherTest, SharedExpertOnAWorkerJoinsItsRoutedPart) {
  auto a = Link("a"), s = Link("s");
  auto set = MakeSet({{a, {0, 1, 2, 3}, /*shared=*/true}, {s, {4, 5, 6, 7}, /*shared=*/true}}, true);
  auto c = MakeCall(set, {{0}, {5}}, 5000, /*shared=*/true);
  Run(c);
  ExpectSum(*c, Wait(c));
  // Both hold the shared expert and have a part of the call: it rides in one of those parts
  // (every row), not in a part of its own.
  ASSERT_EQ(a->sent().size(), 1u);
  ASSERT_EQ(s->sent().size(), 1u);
  EXPECT_NE(a->sent()[0].shared_expert(), s->sent()[0].shared_expert());
  const pb::ExpertRequest with_shared = a->sent()[0].shared_expert() ? a->sent()[0] : s->sent()[0];
  EXPECT_EQ(with_shared.hidden().shape(0), 2);
}

// ---- failover ----

TEST_F(DispatcherTest, EachRetryableCodeFailsOverToAReplica) {
  for (absl::StatusCode code : {absl::StatusCode::kUnavailable, absl::StatusCode::kResourceExhausted,
                                absl::StatusCode::kAborted, absl::StatusCode::kCancelled}) {
    SCOPED_TRACE(absl::StatusCodeToString(code));
    auto a = Link("a"), a2 = Link("a2");
    auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
    a->set_mode(FakeLink::Mode::kFailInline, code);
    const double before = Failovers("a");
    auto c = MakeCall(set, {{0, 3}, {1, 2}});  // two experts each (SpreadsOneCalls...)
    Run(c);
    Outcome o = Wait(c);
    EXPECT_EQ(o.ends, 1);
    ExpectSum(*c, o);
    EXPECT_EQ(a2->sent().size(), 2u);  // its own part and a's
    EXPECT_EQ(Failovers("a"), before + 1);
  }
}

TEST_F(DispatcherTest, ASendThatFailsFailsOver) {
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  a->set_mode(FakeLink::Mode::kRefuse);  // its write queue is full
  auto c = MakeCall(set, {{0, 1}});       // one expert each
  Run(c);
  ExpectSum(*c, Wait(c));
  EXPECT_EQ(Failovers("a"), 1);
}

TEST_F(DispatcherTest, ANonRetryableCodeEndsTheCallNamingTheWorker) {
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  auto busy = HoldOne(set, *a2, {a.get()}, 1);  // the call goes to a
  a->set_mode(FakeLink::Mode::kFailInline, absl::StatusCode::kInvalidArgument);
  auto c = MakeCall(set, {{0}});
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status.message().find("worker a"), std::string::npos) << o.status;
  EXPECT_EQ(a2->sent().size(), 1u);  // the busy call only
  EXPECT_EQ(Failovers("a"), 0);
  a2->AnswerAll();
}

// A link whose worker answers OK with an output of the wrong shape (3 columns).
class WrongShapeLink final : public WorkerLink {
 public:
  const std::string& name() const override { return name_; }
  const std::string& address() const override { return name_; }
  bool up() const override { return true; }
  int outstanding() const override { return 0; }
  absl::StatusOr<Ticket> Send(pb::ExpertRequest, size_t, SubCallback cb) override {
    pb::ExpertResponse r;
    const float y[3] = {1, 2, 3};
    svc::EncodeTensor(y, {1, 3}, pb::DTYPE_FP32, r.mutable_output());
    cb(absl::OkStatus(), &r);
    return Ticket{};
  }
  void Cancel(const Ticket&, pb::CancelReason) override {}
  void Stop() override {}

 private:
  const std::string name_ = "wrong";
};

TEST_F(DispatcherTest, ABadAnswerEndsTheCallInternal) {
  ExpertHolders h(kLayers, kExperts, {kLayer}, false);
  for (int e = 0; e < kExperts; ++e) h.AddRouted(kLayer, e, 0);
  auto set = std::make_shared<WorkerSet>(
      std::vector<std::shared_ptr<WorkerLink>>{std::make_shared<WrongShapeLink>()}, std::move(h));
  auto c = MakeCall(set, {{2}});
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(o.status.message().find("worker wrong sent a bad answer"), std::string::npos)
      << o.status;
}

// ---- every holder down ----

TEST_F(DispatcherTest, EveryHolderDownFailsUnavailableNamingExpertsAndHolders) {
  auto a = Link("a"), a2 = Link("a2"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  a->set_up(false);
  a2->set_up(false);
  auto c = MakeCall(set, {{1, 2}, {4, 5}});
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(o.status.message().find("no serving worker holds layer 1 experts 1-2 (held by: a, a2)"),
            std::string::npos)
      << o.status;
  EXPECT_EQ(a->sent().size() + a2->sent().size() + b->sent().size(), 0u);  // nothing sent
  EXPECT_EQ(Failovers("a"), 0);
}

TEST_F(DispatcherTest, TheOnlyHolderFailingIsNoFailover) {
  // Fault 11 of issue 13: a failover was counted for a worker that has no replica.
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kFailInline, absl::StatusCode::kUnavailable);
  auto c = MakeCall(set, {{0, 4}});
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(o.status.message().find("worker a (fake:a) failed with layer 1 experts 0: "),
            std::string::npos)
      << o.status;
  EXPECT_NE(o.status.message().find("no serving worker holds layer 1 experts 0 (held by: a)"),
            std::string::npos)
      << o.status;
  EXPECT_EQ(Failovers("a"), 0);
}

TEST_F(DispatcherTest, SharedExpertWithoutServingHolderIsNamed) {
  auto a = Link("a"), s = Link("s"), s2 = Link("s2");
  auto set = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}, {s, {}, true}, {s2, {}, true}}, true);
  s->set_up(false);
  s2->set_up(false);
  auto c = MakeCall(set, {{0}}, 5000, /*shared=*/true);
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(o.status.message().find("no serving worker holds layer 1 shared expert (held by: s, s2)"),
            std::string::npos)
      << o.status;
}

// ---- deadlines ----

TEST_F(DispatcherTest, AFrozenLinkWithoutReplicaEndsAtTheDeadlineAndIsWithdrawn) {
  auto a = Link("a");
  auto set = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);  // never answers
  const auto t0 = Clock::now();
  auto c = MakeCall(set, {{0, 1}}, /*deadline_ms=*/60);
  Run(c);
  Outcome o = Wait(c);
  const auto took = Clock::now() - t0;
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(o.status.message().find("exceeded its deadline of 60 ms (workers involved: a)"),
            std::string::npos)
      << o.status;
  EXPECT_GE(took, milliseconds(55));
  EXPECT_LT(took, milliseconds(1000));
  ASSERT_EQ(a->cancels().size(), 1u);
  EXPECT_EQ(a->cancels()[0].second, pb::CANCEL_REASON_DEADLINE);
  EXPECT_EQ(a->outstanding(), 0);
}

TEST_F(DispatcherTest, ADeadlineAlreadyPassedSendsNothing) {
  auto a = Link("a");
  auto set = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}}, false);
  auto c = MakeCall(set, {{0}}, /*deadline_ms=*/0);
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a->sent().size(), 0u);
}

TEST_F(DispatcherTest, AFailureAfterTheDeadlineIsNotRetried) {
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  a2->set_up(false);  // the call goes to a
  auto c = MakeCall(set, {{0}}, /*deadline_ms=*/30);
  Run(c);
  a2->set_up(true);
  std::this_thread::sleep_for(milliseconds(40));
  a->FailAll(absl::StatusCode::kUnavailable);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a2->sent().size(), 0u);
  EXPECT_EQ(o.ends, 1);
}

TEST_F(DispatcherTest, AWorkerDeadlineIsTheCallsDeadline) {
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  auto busy = HoldOne(set, *a2, {a.get()}, 1);  // the call goes to a
  a->set_mode(FakeLink::Mode::kFailInline, absl::StatusCode::kDeadlineExceeded);
  auto c = MakeCall(set, {{0}});
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(o.status.message().find(": worker a: "), std::string::npos) << o.status;
  EXPECT_EQ(a2->sent().size(), 1u);  // the busy call only: not retryable
  a2->AnswerAll();
}

// ---- frozen and dying links ----

TEST_F(DispatcherTest, AFrozenLinkDeclaredDeadFailsOverWithinTheDeadline) {
  // The link's liveness check (WorkerConn) ends a frozen worker's session: what it held fails
  // UNAVAILABLE and goes to the replica.
  auto a = Link("a"), a2 = Link("a2");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {a2, {0, 1, 2, 3}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  a2->set_mode(FakeLink::Mode::kHold);
  a2->set_up(false);  // busy elsewhere at first: everything goes to a
  std::vector<std::shared_ptr<LayerCall>> calls;
  for (int i = 0; i < 20; ++i) {
    calls.push_back(MakeCall(set, {{i % 4}, {(i + 1) % 4}}, 2000));
    Run(calls.back());
  }
  EXPECT_EQ(a->outstanding(), 20);
  a2->set_up(true);
  a2->set_mode(FakeLink::Mode::kAnswerInline);
  a->Die("no answer to liveness probes or requests for 1600 ms");
  for (auto& c : calls) {
    Outcome o = Wait(c);
    EXPECT_EQ(o.ends, 1);
    ExpectSum(*c, o);
  }
  EXPECT_EQ(Failovers("a"), 20);
}

TEST_F(DispatcherTest, ALinkDyingWithRequestsInFlightFailsOnlyThoseNeedingIt) {
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  b->set_mode(FakeLink::Mode::kHold);
  std::vector<std::shared_ptr<LayerCall>> on_a, on_b;
  for (int i = 0; i < 10; ++i) {
    on_a.push_back(MakeCall(set, {{i % 4, 4 + i % 4}}));
    Run(on_a.back());
    on_b.push_back(MakeCall(set, {{4 + i % 4}}));
    Run(on_b.back());
  }
  a->Die("killed");
  for (auto& c : on_a) {
    Outcome o = Wait(c);
    EXPECT_EQ(o.status.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(o.status.message().find("stream ended: killed"), std::string::npos) << o.status;
  }
  // Their parts on b are withdrawn (the call failed), the others still wait for b.
  EXPECT_EQ(b->cancels().size(), on_a.size());
  for (auto& c : on_b) EXPECT_FALSE(Ended(c));
  EXPECT_EQ(b->AnswerAll(), 10);
  for (auto& c : on_b) ExpectSum(*c, Wait(c));
}

// ---- cancellation ----

TEST_F(DispatcherTest, CancelWithdrawsWhatIsOutAndLateAnswersAreDropped) {
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  b->set_mode(FakeLink::Mode::kHold);
  auto c = MakeCall(set, {{0, 5}});
  Run(c);
  dispatcher_.End(c, absl::CancelledError("client"), pb::CANCEL_REASON_CLIENT);
  dispatcher_.End(c, absl::CancelledError("again"), pb::CANCEL_REASON_CLIENT);  // no-op
  Outcome o = Wait(c);
  EXPECT_EQ(o.ends, 1);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kCancelled);
  ASSERT_EQ(a->cancels().size(), 1u);
  EXPECT_EQ(a->cancels()[0].second, pb::CANCEL_REASON_CLIENT);
  ASSERT_EQ(b->cancels().size(), 1u);
  EXPECT_EQ(a->AnswerAll() + b->AnswerAll(), 0);  // withdrawn: nothing left to answer
  EXPECT_EQ(Wait(c).ends, 1);
  EXPECT_EQ(dispatcher_.timer().pending(), 0u);  // its deadline entry is gone
}

TEST_F(DispatcherTest, ACallEndedWhileItsSendRunsWithdrawsThatPart) {
  // The race of the kSending state: the call ends between a part's registration and its Send's
  // return; the part is withdrawn once the ticket is known.
  auto a = Link("a");
  auto set = MakeSet({{a, {0, 1, 2, 3, 4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  auto c = MakeCall(set, {{0}});
  a->set_before_send_returns([&] {
    dispatcher_.End(c, absl::CancelledError("stream closed"), pb::CANCEL_REASON_STREAM_CLOSED);
  });
  Run(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kCancelled);
  ASSERT_EQ(a->cancels().size(), 1u);
  EXPECT_EQ(a->cancels()[0].second, pb::CANCEL_REASON_STREAM_CLOSED);
  EXPECT_EQ(a->outstanding(), 0);
}

TEST_F(DispatcherTest, AnswersBeforeSendReturnsAreCombined) {
  // A worker answering inside Send (the kSending state answered at once) and the handler
  // finishing last: the call ends OK exactly once.
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  auto c = MakeCall(set, {{0, 4}, {1, 5}});
  dispatcher_.Start(c, RoutedWork(*c, false));
  EXPECT_FALSE(Ended(c));  // the handler is still running
  dispatcher_.HandlerDone(c);
  Outcome o = Wait(c);
  EXPECT_EQ(o.ends, 1);
  ExpectSum(*c, o);
}

TEST_F(DispatcherTest, CancelsRacingAnswersEndEachCallOnce) {
  auto a = Link("a"), b = Link("b");
  auto set = MakeSet({{a, {0, 1, 2, 3}}, {b, {4, 5, 6, 7}}}, false);
  a->set_mode(FakeLink::Mode::kHold);
  b->set_mode(FakeLink::Mode::kHold);
  constexpr int kCalls = 300;
  std::vector<std::shared_ptr<LayerCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(MakeCall(set, {{i % 4, 4 + (i % 4)}, {(i + 1) % 4, 4 + ((i + 2) % 4)}}));
  }
  std::atomic<bool> done{false};
  std::atomic<int> started{0};
  std::thread answer_a([&] {
    while (!done) a->AnswerAll();
  });
  std::thread answer_b([&] {
    while (!done) b->AnswerAll();
  });
  std::thread canceller([&] {
    for (int i = 0; i < kCalls; i += 2) {
      while (started.load() <= i) std::this_thread::yield();
      dispatcher_.End(calls[i], absl::CancelledError("raced"), pb::CANCEL_REASON_CLIENT);
    }
  });
  for (int i = 0; i < kCalls; ++i) {
    Run(calls[i]);
    started.store(i + 1);
  }
  canceller.join();
  int ok = 0, cancelled = 0;
  for (int i = 0; i < kCalls; ++i) {
    Outcome o = Wait(calls[i]);
    ASSERT_EQ(o.ends, 1) << i;
    if (o.status.ok()) {
      ++ok;
      ExpectSum(*calls[i], o);
    } else {
      ASSERT_EQ(o.status.code(), absl::StatusCode::kCancelled) << o.status;
      ++cancelled;
    }
  }
  done = true;
  answer_a.join();
  answer_b.join();
  EXPECT_GE(ok, kCalls / 2);  // the odd ones are never cancelled
  EXPECT_EQ(ok + cancelled, kCalls);
  EXPECT_EQ(a->outstanding() + b->outstanding(), 0);
}

// ---- expert-map reload ----

TEST_F(DispatcherTest, ReloadUnderLoadKeepsOldCallsOnTheirSetAndFreesItAfterwards) {
  std::atomic<int> destroyed{0};
  auto a = Link("a");                // in both maps
  auto x = Link("x", &destroyed);    // only in the old map
  auto y = Link("y");                // only in the new map
  a->set_mode(FakeLink::Mode::kHold);
  x->set_mode(FakeLink::Mode::kHold);
  auto old_set = MakeSet({{a, {0, 1, 2, 3}}, {x, {4, 5, 6, 7}}}, false);
  std::vector<std::shared_ptr<LayerCall>> old_calls, old_calls_a_only, new_calls;
  for (int i = 0; i < 8; ++i) {
    old_calls.push_back(MakeCall(old_set, {{i % 4, 4 + i % 4}}));
    Run(old_calls.back());
    old_calls_a_only.push_back(MakeCall(old_set, {{i % 4}}));
    Run(old_calls_a_only.back());
  }
  // The reload: a new set, the old one retired; links that left the map stop.
  auto new_set = MakeSet({{a, {0, 1, 2, 3}}, {y, {4, 5, 6, 7}}}, false);
  std::weak_ptr<WorkerSet> old_weak = old_set;
  RetiredPools retired(milliseconds(5));
  old_set->StopUnshared(*new_set);
  EXPECT_TRUE(x->stopped());
  EXPECT_FALSE(a->stopped());
  retired.Retire(std::move(old_set));
  x.reset();
  // Calls that needed x fail (it left the map and holds no replica); the others go on.
  for (auto& c : old_calls) EXPECT_EQ(Wait(c).status.code(), absl::StatusCode::kUnavailable);
  for (int i = 0; i < 8; ++i) {
    new_calls.push_back(MakeCall(new_set, {{i % 4, 4 + i % 4}}));
    Run(new_calls.back());
  }
  EXPECT_EQ(y->sent().size(), 8u);
  for (auto& c : old_calls_a_only) EXPECT_FALSE(Ended(c));
  // The old set stays while calls that started on it still run.
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(retired.size(), 1);
  EXPECT_FALSE(old_weak.expired());
  EXPECT_EQ(a->AnswerAll(), 16);  // the old calls' parts and the new calls'
  for (auto& c : old_calls_a_only) ExpectSum(*c, Wait(c));
  for (auto& c : new_calls) ExpectSum(*c, Wait(c));
  old_calls.clear();
  old_calls_a_only.clear();
  // Once nothing holds it, the retired set goes, and with it the link only it held.
  for (int i = 0; i < 200 && retired.size() > 0; ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(retired.size(), 0);
  EXPECT_TRUE(old_weak.expired());
  EXPECT_EQ(destroyed.load(), 1);
  EXPECT_FALSE(a->stopped());  // the new set still uses it
}

TEST(RetiredPoolsTest, FreesASetOnlyOnceUnused) {
  std::atomic<int> destroyed{0};
  auto link = std::make_shared<FakeLink>("w", &destroyed);
  ExpertHolders h(kLayers, kExperts, {kLayer}, false);
  auto set = std::make_shared<WorkerSet>(std::vector<std::shared_ptr<WorkerLink>>{link},
                                         std::move(h));
  link.reset();
  std::shared_ptr<const WorkerSet> in_use = set;  // a call still running on it
  RetiredPools retired(milliseconds(5));
  retired.Retire(std::move(set));
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(retired.size(), 1);
  EXPECT_EQ(destroyed.load(), 0);
  in_use.reset();
  for (int i = 0; i < 200 && retired.size() > 0; ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(retired.size(), 0);
  EXPECT_EQ(destroyed.load(), 1);
}

TEST(RetiredPoolsTest, StopAllStopsTheSetsStillHeld) {
  auto link = std::make_shared<FakeLink>("w");
  ExpertHolders h(kLayers, kExperts, {kLayer}, false);
  auto set = std::make_shared<WorkerSet>(std::vector<std::shared_ptr<WorkerLink>>{link},
                                         std::move(h));
  std::shared_ptr<const WorkerSet> in_use = set;
  RetiredPools retired;
  retired.Retire(std::move(set));
  retired.StopAll();
  EXPECT_TRUE(link->stopped());
}

TEST(ExpertsTextTest, NamesRoutedAndSharedExperts) {
  EXPECT_EQ(ExpertsText({3, 1, 2, 2}, false), "experts 1-3");
  EXPECT_EQ(ExpertsText({}, true), "shared expert");
  EXPECT_EQ(ExpertsText({5, 7}, true), "experts 5,7 and the shared expert");
}

}  // namespace
}  // namespace exl3::router

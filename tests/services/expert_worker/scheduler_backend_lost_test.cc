// The scheduler when its backend is lost (a GPU context killed by a sticky error): the failing
// batch's requests get its error, the loss is reported once, and later requests are refused with
// UNAVAILABLE instead of being computed on a dead device. A GPU cannot be made to fail here, so
// the backend is a stand-in that fails every Forward and reports itself unusable.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "gtest/gtest.h"
#include "services/expert_worker/scheduler.h"

namespace exl3::worker {
namespace {

class LostDeviceBackend : public MoeBackend {
 public:
  std::string name() const override { return "cuda"; }
  std::string device() const override { return "a device that failed"; }
  absl::Status Prepare(const Exl3Model&, const PrepareOptions&, PrepareStats*) override {
    return absl::OkStatus();
  }
  absl::Status Forward(const BatchView&) override {
    ++forwards;
    return absl::InternalError("CUDA error cudaErrorIllegalAddress (an illegal memory access)");
  }
  absl::Status Health() override {
    return absl::InternalError("CUDA error cudaErrorIllegalAddress (sticky)");
  }
  uint64_t pinned_bytes() const override { return 0; }
  bool forward_on_any_thread() const override { return true; }
  std::atomic<int> forwards{0};
};

struct Sink : RequestSink {
  bool Cancelled() const override { return false; }
  void Complete(std::shared_ptr<WorkRequest>, absl::Status s) override {
    std::lock_guard<std::mutex> l(mu);
    done.push_back(s);
    cv.notify_all();
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<absl::Status> done;
};

std::shared_ptr<WorkRequest> Request(uint64_t id, const std::vector<float>& x,
                                     const std::shared_ptr<Sink>& sink) {
  auto r = std::make_shared<WorkRequest>();
  r->id = id;
  r->layer = 1;
  r->tokens = 1;
  r->slots = 1;
  r->x = x.data();
  r->ids = {0};
  r->weights = {1.0f};
  r->received = Clock::now();
  r->sink = sink;
  return r;
}

TEST(SchedulerBackendLost, ReportedOnceThenRequestsRefused) {
  constexpr int kHidden = 128;
  LostDeviceBackend backend;
  SchedulerOptions o;
  std::atomic<int> lost_calls{0};
  absl::Status why;
  o.on_backend_lost = [&](const absl::Status& s) {
    why = s;
    ++lost_calls;
  };
  Scheduler sched(o, &backend, nullptr, kHidden);
  sched.Start();
  const std::vector<float> x(kHidden, 0.5f);
  auto sink = std::make_shared<Sink>();
  for (uint64_t id = 1; id <= 2; ++id) {
    absl::Status s = sched.Submit(Request(id, x, sink));
    if (id == 1) {
      ASSERT_TRUE(s.ok()) << s;
      std::unique_lock<std::mutex> l(sink->mu);
      ASSERT_TRUE(sink->cv.wait_for(l, std::chrono::seconds(10), [&] { return !sink->done.empty(); }));
      EXPECT_EQ(sink->done[0].code(), absl::StatusCode::kInternal);
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_NE(std::string(s.message()).find("cannot compute"), std::string::npos) << s;
    }
  }
  EXPECT_EQ(lost_calls.load(), 1);
  EXPECT_NE(std::string(why.message()).find("sticky"), std::string::npos);
  EXPECT_EQ(backend.forwards.load(), 1);
  sched.Stop();
}

}  // namespace
}  // namespace exl3::worker

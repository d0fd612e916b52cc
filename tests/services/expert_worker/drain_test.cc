// The real exl3-worker binary under SIGTERM: every request sent before the signal is answered
// (computed, or UNAVAILABLE if it arrived after draining began), no response is lost, the
// process exits 0 after draining.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "tests/services/expert_worker/worker_harness.h"

namespace exl3::testing {
namespace {

pid_t Spawn(const std::vector<std::string>& args) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

int WaitExit(pid_t pid, int timeout_s) {
  for (int i = 0; i < timeout_s * 100; ++i) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

TEST(WorkerDrain, SigtermAnswersEveryAcceptedRequestThenExits) {
  WorkerHarness h;
  const worker::WorkerOptions o = h.Options();  // writes the model
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  const pid_t pid = Spawn({EXL3_WORKER_BIN, "--model", o.model_dir, "--experts", "0-5", "--listen",
                           addr, "--metrics-listen=", "--threads", "1", "--batch-window-us",
                           "20000", "--progress=false", "--drain-timeout-s", "20"});
  ASSERT_GT(pid, 0);
  bool serving = false;
  for (int i = 0; i < 400 && !serving; ++i) {
    // A fresh channel per probe: a refused connection would put a reused one in backoff.
    serving = HealthCheck(LoopbackChannel(addr), "") == 1;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(serving) << "worker did not become SERVING";
  auto channel = LoopbackChannel(addr);
  auto stub = pb::ExpertWorker::NewStub(channel);

  constexpr int kStreams = 8, kPerStream = 25;
  std::mt19937 rng(17);
  struct StreamState {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<pb::ExpertRequest, pb::ExpertResponse>> rw;
    std::vector<pb::ExpertResponse> got;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<StreamState>> streams;
  for (int s = 0; s < kStreams; ++s) {
    auto st = std::make_unique<StreamState>();
    st->rw = stub->Forward(&st->ctx);
    for (int i = 0; i < kPerStream; ++i) {
      std::vector<int32_t> ids;
      std::vector<float> w;
      const std::vector<float> x = RandomHidden(rng, 2, 256);
      RandomRouting(rng, 2, 4, {0, 1, 2, 3, 4, 5}, 4, &ids, &w);
      ASSERT_TRUE(st->rw->Write(MakeRequest(i, 1 + (i % 2), x, 2, 256, 4, ids, w)));
    }
    streams.push_back(std::move(st));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  std::vector<std::thread> readers;
  for (auto& st : streams) {
    readers.emplace_back([&st] {
      st->rw->WritesDone();
      pb::ExpertResponse r;
      while (st->rw->Read(&r)) st->got.push_back(r);
      st->status = st->rw->Finish();
    });
  }
  for (auto& t : readers) t.join();
  int ok = 0, unavailable = 0;
  for (auto& st : streams) {
    EXPECT_TRUE(st->status.ok() || st->status.error_code() == grpc::StatusCode::UNAVAILABLE)
        << st->status.error_message();
    EXPECT_EQ(st->got.size(), static_cast<size_t>(kPerStream)) << "responses lost";
    std::set<uint64_t> ids;
    for (const auto& r : st->got) {
      ids.insert(r.id());
      if (r.status().code() == pb::OK) {
        ++ok;
      } else {
        EXPECT_EQ(r.status().code(), pb::UNAVAILABLE) << r.status().message();
        ++unavailable;
      }
    }
    EXPECT_EQ(ids.size(), static_cast<size_t>(kPerStream));
  }
  EXPECT_GT(ok, 0);
  std::printf("drain: %d computed, %d answered UNAVAILABLE\n", ok, unavailable);
  EXPECT_EQ(WaitExit(pid, 30), 0);
}

}  // namespace
}  // namespace exl3::testing

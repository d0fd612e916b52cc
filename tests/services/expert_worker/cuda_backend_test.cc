// The worker's CUDA backend (services/expert_worker/cuda_backend_worker.cc) against its CPU
// backend on one synthetic MoE layer: a batch from the caller's buffers, a batch gathered into the
// backend's own staging (MoeBackend::staging), a batch run from another thread
// (forward_on_any_thread), and three requests the scheduler batches into the staging. Label gpu:
// every case skips where no GPU is visible.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/exl3_model.h"
#include "tools/test_model/test_model.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/scheduler.h"

namespace exl3::worker {
namespace {

namespace fs = std::filesystem;

constexpr int kLayer = 1;  // glm4_moe: layer 0 dense, layers 1 and 2 MoE
constexpr int kMaxTokens = 64;

// max |a - b| / max |b|: the GPU's fp16 activations against the CPU's.
double RelativeError(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, static_cast<double>(std::fabs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::fabs(b[i])));
  }
  return den > 0 ? num / den : num;
}

// T tokens of S slots: distinct experts, some slots empty (-1), random weights and inputs.
struct Batch {
  int tokens = 0, slots = 0;
  std::vector<float> x, weights;
  std::vector<int32_t> ids;
};
Batch RandomBatch(int tokens, int slots, int experts, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  Batch b;
  b.tokens = tokens;
  b.slots = slots;
  b.x.resize(static_cast<size_t>(tokens) * hidden);
  for (float& v : b.x) v = normal(rng);
  b.ids.assign(static_cast<size_t>(tokens) * slots, -1);
  b.weights.assign(b.ids.size(), 0.0f);
  std::vector<int32_t> order(experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) order[e] = e;
    std::shuffle(order.begin(), order.end(), rng);
    const int used = slots - (t % 3 == 2 ? 1 : 0);  // every third token leaves its last slot empty
    for (int s = 0; s < used; ++s) {
      b.ids[static_cast<size_t>(t) * slots + s] = order[s];
      b.weights[static_cast<size_t>(t) * slots + s] = unit(rng);
    }
  }
  return b;
}

BatchView View(const Batch& b, bool shared, float* out, int layer = kLayer) {
  BatchView v;
  v.layer = layer;
  v.tokens = b.tokens;
  v.slots = b.slots;
  v.x = b.x.data();
  v.ids = b.ids.data();
  v.weights = b.weights.data();
  v.out = out;
  v.shared = shared;
  return v;
}

class CudaBackendTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (cuda::DeviceCount() == 0) return;
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("exl3_cuda_backend_" + std::to_string(getpid())));
    TestModelSpec spec;
    spec.layers = 3;
    spec.hidden = 512;
    spec.experts = 8;
    spec.top_k = 4;
    spec.intermediate = 128;
    spec.shared = 1;
    SyntheticOptions so;
    so.progress = false;
    ASSERT_TRUE(WriteSyntheticExl3Model(spec, so, dir_->string()).ok());
    Exl3ModelOptions mo;  // as the worker opens it (services/expert_worker/worker_server.cc)
    mo.load_routers = false;
    absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(dir_->string(), mo);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = model->release();
    PrepareOptions po;
    po.progress = false;
    po.lock_memory = false;
    po.shared_expert = true;
    po.max_batch_tokens = kMaxTokens;
    PrepareStats st;
    auto cpu = CreateBackend("cpu", 0, 2);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE((*cpu)->Prepare(*model_, po, &st).ok());
    auto gpu = CreateBackend("cuda", 0, 0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    absl::Status s = (*gpu)->Prepare(*model_, po, &st);
    ASSERT_TRUE(s.ok()) << s;
    cpu_ = cpu->release();
    gpu_ = gpu->release();
  }
  static void TearDownTestSuite() {
    delete gpu_;
    delete cpu_;
    delete model_;
    if (dir_ != nullptr) fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
    ASSERT_NE(gpu_, nullptr);
  }
  int hidden() const { return model_->config().hidden_size; }
  int experts() const { return model_->config().num_experts; }
  std::vector<float> CpuAnswer(const Batch& b, bool shared, int layer = kLayer) {
    std::vector<float> out(b.x.size());
    EXPECT_TRUE(cpu_->Forward(View(b, shared, out.data(), layer)).ok());
    return out;
  }

  static fs::path* dir_;
  static Exl3Model* model_;
  static MoeBackend* cpu_;
  static MoeBackend* gpu_;
};
fs::path* CudaBackendTest::dir_ = nullptr;
Exl3Model* CudaBackendTest::model_ = nullptr;
MoeBackend* CudaBackendTest::cpu_ = nullptr;
MoeBackend* CudaBackendTest::gpu_ = nullptr;

constexpr double kTolerance = 1e-2;  // fp16 activations on the GPU

TEST_F(CudaBackendTest, CallerBuffersMatchCpu) {
  for (int tokens : {1, 5, 33, kMaxTokens}) {
    for (bool shared : {false, true}) {
      const Batch b = RandomBatch(tokens, 4, experts(), hidden(), 100 + tokens);
      const std::vector<float> want = CpuAnswer(b, shared);
      std::vector<float> got(b.x.size(), NAN);
      const absl::Status s = gpu_->Forward(View(b, shared, got.data()));
      ASSERT_TRUE(s.ok()) << s;
      const double err = RelativeError(got.data(), want.data(), got.size());
      EXPECT_LT(err, kTolerance) << "T=" << tokens << " shared=" << shared;
      std::printf("caller buffers T=%d shared=%d: relative error %.2e\n", tokens, shared, err);
    }
  }
}

// The backend's one workspace serves both MoE layers (rebound per batch): the same batch through
// layers 1, 2, 1 and 2 again gives each layer's own answer.
TEST_F(CudaBackendTest, LayersTakeTurnsOnOneWorkspace) {
  const Batch b = RandomBatch(9, 4, experts(), hidden(), 77);
  const std::vector<float> want1 = CpuAnswer(b, true, 1), want2 = CpuAnswer(b, true, 2);
  ASSERT_GT(RelativeError(want1.data(), want2.data(), want1.size()), 0.1) << "the two layers answer alike";
  for (const int layer : {1, 2, 1, 2}) {
    std::vector<float> got(b.x.size(), NAN);
    ASSERT_TRUE(gpu_->Forward(View(b, true, got.data(), layer)).ok());
    const std::vector<float>& want = layer == 1 ? want1 : want2;
    const double rel = RelativeError(got.data(), want.data(), got.size());
    std::printf("cuda backend layer %d after a batch of another layer: rel %.2e\n", layer, rel);
    EXPECT_LT(rel, kTolerance) << "layer " << layer;
  }
}

TEST_F(CudaBackendTest, StagedBatchMatchesCpu) {
  const MoeBackend::Staging st = gpu_->staging();
  ASSERT_NE(st.x, nullptr);
  ASSERT_NE(st.out, nullptr);
  ASSERT_EQ(st.max_tokens, kMaxTokens);
  // Wider slots than top_k, some empty: the backend compacts them.
  const Batch b = RandomBatch(40, 6, experts(), hidden(), 7);
  Batch narrow = b;
  for (int t = 0; t < b.tokens; ++t) {
    int used = 0;
    for (int s = 0; s < b.slots; ++s) {
      int32_t& id = narrow.ids[static_cast<size_t>(t) * b.slots + s];
      if (id >= 0 && ++used > 4) id = -1;  // at most top_k per token, as the worker validates
    }
  }
  const std::vector<float> want = CpuAnswer(narrow, true);
  std::memcpy(st.x, narrow.x.data(), narrow.x.size() * sizeof(float));
  BatchView v = View(narrow, true, st.out);
  v.x = st.x;
  const absl::Status s = gpu_->Forward(v);
  ASSERT_TRUE(s.ok()) << s;
  const double err = RelativeError(st.out, want.data(), want.size());
  EXPECT_LT(err, kTolerance);
  std::printf("staged T=40: relative error %.2e\n", err);
}

TEST_F(CudaBackendTest, ForwardFromAnotherThread) {
  ASSERT_TRUE(gpu_->forward_on_any_thread());
  const Batch b = RandomBatch(8, 4, experts(), hidden(), 11);
  const std::vector<float> want = CpuAnswer(b, false);
  std::vector<float> got(b.x.size(), NAN);
  absl::Status s;
  std::thread([&] { s = gpu_->Forward(View(b, false, got.data())); }).join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_LT(RelativeError(got.data(), want.data(), got.size()), kTolerance);
  EXPECT_TRUE(gpu_->Health().ok());
}

// Records the completions.
class Sink : public RequestSink {
 public:
  bool Cancelled() const override { return false; }
  void Complete(std::shared_ptr<WorkRequest> r, absl::Status status) override {
    std::lock_guard<std::mutex> l(mu);
    done.emplace_back(std::move(r), std::move(status));
  }
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<WorkRequest>, absl::Status>> done;
};

TEST_F(CudaBackendTest, SchedulerGathersIntoStaging) {
  SchedulerOptions so;
  so.inline_max_tokens = 0;  // all three queued, then taken as one batch
  so.max_batch_tokens = kMaxTokens;
  Scheduler sched(so, gpu_, nullptr, hidden());
  auto sink = std::make_shared<Sink>();
  std::vector<Batch> batches;
  for (int i = 0; i < 3; ++i) {
    batches.push_back(RandomBatch(3 + 7 * i, 4, experts(), hidden(), 50 + i));
  }
  for (int i = 0; i < 3; ++i) {
    auto r = std::make_shared<WorkRequest>();
    r->id = i;
    r->layer = kLayer;
    r->tokens = batches[i].tokens;
    r->slots = batches[i].slots;
    r->shared = true;
    r->received = Clock::now();
    r->x_f32 = batches[i].x;
    r->x = r->x_f32.data();
    r->ids = batches[i].ids;
    r->weights = batches[i].weights;
    r->sink = sink;
    ASSERT_TRUE(sched.Submit(r).ok());
  }
  sched.Start();
  for (int i = 0; i < 2000; ++i) {
    {
      std::lock_guard<std::mutex> l(sink->mu);
      if (sink->done.size() == 3) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  sched.Stop();
  ASSERT_EQ(sink->done.size(), 3u);
  for (auto& [r, status] : sink->done) {
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(r->batch_requests, 3) << "the three requests were not batched together";
    const std::vector<float> want = CpuAnswer(batches[r->id], true);
    const double err = RelativeError(r->out(), want.data(), want.size());
    EXPECT_LT(err, kTolerance) << "request " << r->id;
    std::printf("scheduler batch, request %d (T=%d): relative error %.2e\n",
                static_cast<int>(r->id), r->tokens, err);
  }
}

}  // namespace
}  // namespace exl3::worker

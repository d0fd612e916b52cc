// The CPU model's own consistency on a model of each family: the
// same logits whether a prompt runs at once, in chunks or token by token, whether sequences run
// alone or batched together, and bit for bit the same when a step runs as two micro-batches. (Agreement with transformers: transformers_conformance_test.cc.)
#include "engine/cpu/cpu_model.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "engine/cpu/local_moe.h"
#include "tests/engine/delayed_moe.h"
#include "tests/engine/model_harness.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

using testing::RelativeError;

std::vector<int32_t> RandomPrompt(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

class CpuModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  // The transformers fixtures' models (tests/fixtures/engine/README.md).
  static std::string ModelDir(const std::string& fixture) {
    return (fs::path("tests/fixtures/engine") / fixture).string();
  }
};

TEST_P(CpuModelTest, ChunkedPrefillBatchingMicroBatchesAndDecodeAgree) {
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(ModelDir(GetParam()), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  const std::vector<int32_t> a = RandomPrompt(37, vocab, 1), b = RandomPrompt(9, vocab, 2);

  auto whole = testing::RunGreedy(**model, {a}, 8, /*chunk=*/1000);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto by_token = testing::RunGreedy(**model, {a}, 8, /*chunk=*/1);
  ASSERT_TRUE(by_token.ok()) << by_token.status();
  auto batched = testing::RunGreedy(**model, {b, a}, 8, /*chunk=*/7);
  ASSERT_TRUE(batched.ok()) << batched.status();

  // The same step as two ping-pong micro-batches (in-process MoE: the same arithmetic per token).
  CpuModelOptions two = o;
  two.micro_batches = 2;
  auto split_model = CpuModel::Open(ModelDir(GetParam()), two);
  ASSERT_TRUE(split_model.ok()) << split_model.status();
  auto split = testing::RunGreedy(**split_model, {b, a}, 8, /*chunk=*/7);
  ASSERT_TRUE(split.ok()) << split.status();

  for (int i = 0; i <= 8; ++i) {
    EXPECT_EQ((*split)[1][i], (*batched)[1][i]) << "step " << i;
    EXPECT_EQ((*split)[0][i], (*batched)[0][i]) << "step " << i;
    for (float v : (*whole)[0][i]) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(RelativeError((*by_token)[0][i], (*whole)[0][i]), 1e-5) << "step " << i;
    EXPECT_LT(RelativeError((*batched)[1][i], (*whole)[0][i]), 1e-5) << "step " << i;
  }
}

// Two micro-batches with the experts behind an executor whose answers come later on threads of
// their own (tests/engine/delayed_moe.h, as the workers'): bit for bit the steps of one, with two
// calls out at once. (The GPU model's test of the same: tests/engine/cuda/cuda_model_test.cc.)
TEST(CpuModelMicroBatches, LateAnswersGiveTheSameLogitsWithTwoCallsInFlight) {
  const std::string dir = "tests/fixtures/engine/glm4_moe_all";
  const std::vector<std::vector<int32_t>> prompts = {{3, 14, 15, 92, 65, 35, 89, 79, 32}, {38, 46, 26}, {7, 1, 8}};
  CpuCompute compute(1);
  std::vector<std::vector<std::vector<float>>> rows[2];
  for (int mb = 1; mb <= 2; ++mb) {
    auto local = LocalMoe::Open(dir, compute);
    ASSERT_TRUE(local.ok()) << local.status();
    auto delayed = std::make_unique<testing::DelayedMoe>(std::move(*local), std::chrono::microseconds(2000));
    testing::DelayedMoe* executor = delayed.get();
    CpuModelOptions o;
    o.num_threads = 1;
    o.micro_batches = mb;
    auto model = CpuModel::Open(dir, o, std::move(delayed));
    ASSERT_TRUE(model.ok()) << model.status();
    auto out = testing::RunGreedy(**model, prompts, 6, /*chunk=*/4);
    ASSERT_TRUE(out.ok()) << out.status();
    rows[mb - 1] = std::move(*out);
    EXPECT_EQ(executor->max_in_flight(), mb);
  }
  ASSERT_EQ(rows[0].size(), rows[1].size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    ASSERT_EQ(rows[0][s].size(), rows[1][s].size()) << "sequence " << s;
    for (size_t r = 0; r < rows[0][s].size(); ++r) EXPECT_EQ(rows[0][s][r], rows[1][s][r]) << "sequence " << s << " step " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CpuModelTest,
                         ::testing::Values("glm4_moe_all", "deepseek_v3_all", "qwen3_moe_experts",
                                           "mixtral_all", "glm_moe_dsa_all", "deepseek_v4_all",
                                           "qwen3_next_all"));

}  // namespace
}  // namespace exl3::engine

namespace exl3::engine {
namespace {

// GLM-MoE-DSA's cache: every layer holds the MLA latent and rope key (128 + 32 floats), the
// layer that runs its own indexer also its key (128); the "shared" layer does not.
TEST(CpuModelKvFootprint, CountsTheIndexerKeysOfLayersThatRunAnIndexer) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto model = CpuModel::Open("tests/fixtures/engine/glm_moe_dsa_experts", o);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config().KvWidth(0), 128 + 32 + 128);
  EXPECT_EQ((*model)->config().KvWidth(1), 128 + 32);
  EXPECT_EQ((*model)->info().kv_bytes_per_token, static_cast<int64_t>(sizeof(float)) * (288 + 160));
}

// A tied head (no lm_head, tie_word_embeddings) is the embedding matrix: the same logits as the
// model whose lm_head holds a copy of the embeddings.
TEST(CpuModelTiedHead, EqualsAnExplicitCopyOfTheEmbeddings) {
  const fs::path fixture = "tests/fixtures/engine/glm4_moe_experts";
  auto src = TensorSource::Open(fixture.string());
  ASSERT_TRUE(src.ok()) << src.status();
  std::ifstream in(fixture / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  const fs::path base = fs::temp_directory_path() / "exl3_engine_tied_head";
  for (bool tied : {true, false}) {
    const fs::path dir = base / (tied ? "tied" : "copy");
    fs::create_directories(dir);
    SafetensorsWriter w;
    for (const std::string& name : (*src)->Names()) {
      if (name == "lm_head.weight") continue;
      TensorView t = *(*src)->Get(name);
      w.Add(name, t.info->dtype, t.info->shape, t.data, t.size_bytes());
    }
    if (!tied) {
      TensorView e = *(*src)->Get("model.embed_tokens.weight");
      w.Add("lm_head.weight", e.info->dtype, e.info->shape, e.data, e.size_bytes());
    }
    ASSERT_TRUE(w.Write((dir / "model.safetensors").string()).ok());
    config["tie_word_embeddings"] = tied;
    std::ofstream(dir / "config.json") << config.dump();
  }
  CpuModelOptions o;
  o.num_threads = 2;
  auto tied = CpuModel::Open((base / "tied").string(), o);
  auto copy = CpuModel::Open((base / "copy").string(), o);
  ASSERT_TRUE(tied.ok()) << tied.status();
  ASSERT_TRUE(copy.ok()) << copy.status();
  const std::vector<int32_t> prompt = RandomPrompt(11, (*tied)->info().vocab_size, 3);
  auto a = testing::RunGreedy(**tied, {prompt}, 4, 100);
  auto b = testing::RunGreedy(**copy, {prompt}, 4, 100);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  fs::remove_all(base);
}

// Records each MoE call (layer, tokens) and runs it in process.
class CountingMoe final : public MoeExecutor {
 public:
  explicit CountingMoe(std::unique_ptr<MoeExecutor> inner) : inner_(std::move(inner)) {}
  absl::Status Forward(int layer, const float* x, int num_tokens, const int32_t* ids,
                       float* y) override {
    calls.emplace_back(layer, num_tokens);
    return inner_->Forward(layer, x, num_tokens, ids, y);
  }
  std::vector<std::pair<int, int>> calls;

 private:
  std::unique_ptr<MoeExecutor> inner_;
};

// Each MoE layer of a step is one call of the executor (the router, with workers) carrying every
// token of the step: the decode tokens and the prompt chunks of all its sequences together; with
// two micro-batches, two calls per layer whose tokens add up to the step's.
TEST(CpuModelMoeCalls, EachMoeLayerOfAStepIsOneCallCarryingAllOfItsTokens) {
  const std::string dir = "tests/fixtures/engine/qwen3_moe_all";  // layer 0 MoE, layer 1 dense
  CpuCompute compute(1);
  for (int mb : {1, 2}) {
    auto local = LocalMoe::Open(dir, compute);
    ASSERT_TRUE(local.ok()) << local.status();
    auto counting = std::make_unique<CountingMoe>(std::move(*local));
    CountingMoe* moe = counting.get();
    CpuModelOptions o;
    o.num_threads = 1;
    o.micro_batches = mb;
    auto model = CpuModel::Open(dir, o, std::move(counting));
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<int> moe_layers;
    for (int l = 0; l < (*model)->config().num_layers; ++l)
      if ((*model)->config().IsMoeLayer(l)) moe_layers.push_back(l);
    ASSERT_FALSE(moe_layers.empty());
    ASSERT_LT(moe_layers.size(), static_cast<size_t>((*model)->config().num_layers));
    ASSERT_TRUE((*model)->AllocateKvCache({8, 16, 3}).ok());

    // One step: a prompt chunk of 9, one of 3 and a single token (13 tokens, three sequences).
    StepBatch batch;
    const std::vector<std::vector<int32_t>> chunks = {{3, 14, 15, 92, 65, 35, 89, 79, 32}, {38, 46, 26}, {7}};
    for (size_t s = 0; s < chunks.size(); ++s) {
      SequenceChunk c;
      c.sequence_id = static_cast<int64_t>(s);
      c.tokens = chunks[s];
      c.start_position = 0;
      c.block_table = {static_cast<int32_t>(2 * s), static_cast<int32_t>(2 * s + 1)};
      c.wants_logits = true;
      c.state_slot = static_cast<int>(s);
      batch.chunks.push_back(std::move(c));
    }
    std::vector<float> logits(static_cast<size_t>(batch.NumLogitRows()) * (*model)->info().vocab_size);
    ASSERT_TRUE((*model)->Forward(batch, logits.data()).ok());
    ASSERT_EQ(moe->calls.size(), moe_layers.size() * mb) << mb << " micro-batches";
    for (size_t i = 0; i < moe_layers.size(); ++i) {
      int tokens = 0;
      for (int k = 0; k < mb; ++k) {
        const auto& [layer, n] = moe->calls[i * mb + k];
        EXPECT_EQ(layer, moe_layers[i]) << "call " << i * mb + k;
        EXPECT_GT(n, 0);
        tokens += n;
      }
      EXPECT_EQ(tokens, 13) << "layer " << moe_layers[i] << ", " << mb << " micro-batches";
    }
  }
}

// With the experts in process (LocalMoe) a step's MoE time is split into its stages: choosing the
// experts and running them, both within the step's MoE phase. An executor that reports no stages
// (the workers' path) leaves them zero.
TEST(CpuModelMoeStages, InProcessExpertsReportGateAndExpertTime) {
  const std::string dir = "tests/fixtures/engine/glm4_moe_all";
  CpuModelOptions o;
  o.num_threads = 1;
  auto model = CpuModel::Open(dir, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> prompt = RandomPrompt(21, (*model)->info().vocab_size, 9);
  ASSERT_TRUE(testing::RunGreedy(**model, {prompt}, 2, 100).ok());
  const StepPhaseTimes t = (*model)->LastPhaseTimes();
  EXPECT_GT(t.moe_gate_s, 0);
  EXPECT_GT(t.moe_experts_s, 0);
  EXPECT_LE(t.moe_gate_s + t.moe_experts_s, t.moe_s);

  CpuCompute compute(1);
  auto local = LocalMoe::Open(dir, compute);
  ASSERT_TRUE(local.ok()) << local.status();
  auto wrapped = CpuModel::Open(dir, o, std::make_unique<CountingMoe>(std::move(*local)));
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  ASSERT_TRUE(testing::RunGreedy(**wrapped, {prompt}, 2, 100).ok());
  EXPECT_GT((*wrapped)->LastPhaseTimes().moe_s, 0);
  EXPECT_EQ((*wrapped)->LastPhaseTimes().moe_gate_s, 0);
  EXPECT_EQ((*wrapped)->LastPhaseTimes().moe_experts_s, 0);
}

// Linear layers, embeddings and norms stored as fp32 or fp16 instead of the fixture's bf16: fp32
// (exact copies of the bf16 values) gives the same logits bit for bit; the projections in fp16
// (bf16 values rounded to fp16) give the same logits within rounding.
TEST(CpuModelDenseWeights, Fp32AndFp16TensorsAsStored) {
  const fs::path fixture = "tests/fixtures/engine/glm4_moe_experts";
  auto src = TensorSource::Open(fixture.string());
  ASSERT_TRUE(src.ok()) << src.status();
  const fs::path base = fs::temp_directory_path() / "exl3_engine_dense_dtypes";
  int converted[2] = {0, 0};
  for (DType to : {DType::kF32, DType::kF16}) {
    const fs::path dir = base / std::string(DTypeName(to));
    fs::create_directories(dir);
    fs::copy_file(fixture / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    SafetensorsWriter w;
    std::vector<std::vector<uint8_t>> held;  // the converted tensors, alive until Write
    for (const std::string& name : (*src)->Names()) {
      TensorView t = *(*src)->Get(name);
      const bool projection = name == "lm_head.weight" ||
                              (name.size() > 12 && name.compare(name.size() - 12, 12, "_proj.weight") == 0);
      if (t.info->dtype != DType::kBF16 || (to == DType::kF16 && !projection)) {
        w.Add(name, t.info->dtype, t.info->shape, t.data, t.size_bytes());
        continue;
      }
      auto f = ToFloat32(t);
      ASSERT_TRUE(f.ok()) << f.status();
      std::vector<uint8_t>& bytes = held.emplace_back();
      if (to == DType::kF32) {
        bytes.resize(f->size() * sizeof(float));
        std::memcpy(bytes.data(), f->data(), bytes.size());
      } else {
        bytes.resize(f->size() * sizeof(uint16_t));
        for (size_t i = 0; i < f->size(); ++i) {
          const uint16_t h = FloatToHalfBits((*f)[i]);
          std::memcpy(bytes.data() + 2 * i, &h, 2);
        }
      }
      w.Add(name, to, t.info->shape, bytes.data(), bytes.size());
      ++converted[to == DType::kF32 ? 0 : 1];
    }
    ASSERT_TRUE(w.Write((dir / "model.safetensors").string()).ok());
  }
  EXPECT_GE(converted[0], 20);  // every bf16 tensor: projections, embeddings, norms, the gate
  EXPECT_GE(converted[1], 10);  // q/k/v/o, the dense MLP and lm_head
  CpuModelOptions o;
  o.num_threads = 2;
  auto bf16 = CpuModel::Open(fixture.string(), o);
  auto f32 = CpuModel::Open((base / "F32").string(), o);
  auto f16 = CpuModel::Open((base / "F16").string(), o);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(f32.ok()) << f32.status();
  ASSERT_TRUE(f16.ok()) << f16.status();
  const std::vector<int32_t> prompt = RandomPrompt(13, (*bf16)->info().vocab_size, 5);
  auto a = testing::RunGreedy(**bf16, {prompt}, 4, 100);
  auto b = testing::RunGreedy(**f32, {prompt}, 4, 100);
  auto c = testing::RunGreedy(**f16, {prompt}, 4, 100);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  for (size_t i = 0; i < (*a)[0].size(); ++i)
    EXPECT_LT(RelativeError((*c)[0][i], (*a)[0][i]), 1e-3) << "step " << i;
  fs::remove_all(base);
}

}  // namespace
}  // namespace exl3::engine

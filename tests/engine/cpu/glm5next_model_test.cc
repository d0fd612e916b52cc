// Glm5NextForConditionalGeneration (GLM-5.3-Flash's text model) in the CPU engine beyond the
// conformance test (tests/engine/cpu/transformers_conformance_test.cc): the fixtures with every
// prompt batched (prefill chunks beside other sequences' decode tokens), the engine over the
// KDA state and the pooled selection (batching, preemption and recomputation, a failed step run
// again, prefix caching off), missing or misshapen tensors named at open, and a checkpoint's MTP
// layer and vision tower stored beside the text model and left alone.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>

#include <unistd.h>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/model_harness.h"
#include "tests/engine/relative_error.h"
#include "tests/engine/transformers_engine_test.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;
using testing::Greedy32;
using testing::Int32Rows;
using testing::RelativeError;

constexpr char kExperts[] = "tests/fixtures/engine/glm5_next_experts";
constexpr char kAll[] = "tests/fixtures/engine/glm5_next_all";

class Glm5NextFixtureTest : public ::testing::TestWithParam<const char*> {};

void RunBatched(const std::string& dir, int micro_batches);

// All four prompts in the same steps: prefill chunks of 7 beside other sequences' decode tokens,
// then decode together; each sequence's first 32 tokens and their logits against transformers'.
TEST_P(Glm5NextFixtureTest, BatchedSequencesGiveTransformersTokensAndLogits) {
  for (int micro_batches : {1, 2}) RunBatched(GetParam(), micro_batches);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Glm5NextFixtureTest, ::testing::Values(kExperts, kAll));

// With micro_batches 2 the step's sequences run as two micro-batches whose layers alternate:
// each keeps its own pooled selection and its sequences' states.
void RunBatched(const std::string& dir, int micro_batches) {
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto prompts = Int32Rows(**ref, "prompt."), greedy = Int32Rows(**ref, "greedy.");
  ASSERT_EQ(prompts.size(), 4u);
  CpuModelOptions o;
  o.num_threads = 2;
  o.micro_batches = micro_batches;
  auto model = CpuModel::Open(dir, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  const int steps = static_cast<int>(greedy[0].size());
  auto rows = testing::RunGreedy(**model, prompts, steps - 1, /*chunk=*/7);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<float> logits = *ToFloat32(*(*ref)->Get("logits." + std::to_string(i)));
    ASSERT_GE((*rows)[i].size(), greedy[i].size());
    double worst = 0;
    for (int j = 0; j < steps; ++j) {
      const std::vector<float>& got = (*rows)[i][j];
      const int token = static_cast<int>(std::max_element(got.begin(), got.end()) - got.begin());
      EXPECT_EQ(token, greedy[i][j]) << "prompt " << i << " step " << j;
      worst = std::max(worst, RelativeError(got.data(), &logits[(prompts[i].size() - 1 + j) * vocab], vocab));
    }
    EXPECT_LT(worst, 1e-3) << "prompt " << i;
    std::printf("%s, %d micro-batch(es), batched prompt %zu (%zu tokens): %d greedy tokens, worst "
                "logits rel err %.2e\n", dir.c_str(), micro_batches, i, prompts[i].size(), steps, worst);
  }
}

// ---------------------------------------------------------------------------------------------
// The engine over the KDA state and the pooled selection.

class Glm5NextEngineTest : public testing::TransformersEngineTest {
 protected:
  Glm5NextEngineTest() : TransformersEngineTest(kAll) {}
};

TEST_F(Glm5NextEngineTest, BatchedPromptsGiveTransformersTokens) { ExpectBatchedPromptsGiveTransformersTokens(); }

TEST_F(Glm5NextEngineTest, PreemptedSequencesRebuildTheirStateAndGiveTheSameTokens) {
  // Recomputed from position 0, their KDA state and cached indexer keys with them.
  ExpectPreemptedSequencesGiveTransformersTokens();
}

TEST_F(Glm5NextEngineTest, AFailedStepRunsAgainFromTheStateBeforeIt) {
  // The first full step fails in layer 1's MoE, after layer 0's KDA has written the new states;
  // the engine runs each chunk again alone, from the states before the failed step.
  ExpectAFailedStepRunsAgainFromTheStateBeforeIt();
}

TEST_F(Glm5NextEngineTest, PrefixCachingIsOffForRecurrentLayers) { ExpectPrefixCachingOff(); }

// ---------------------------------------------------------------------------------------------
// The model directory.

// The experts fixture's config.json and tensors in a fresh directory: `drop` left out, `swap`
// stored with its first two dimensions swapped, `extra` tensors added (bf16 zeros of the shapes
// given).
std::string CopyOf(const std::string& drop, const std::string& swap = "",
                   const std::vector<std::pair<std::string, std::vector<int64_t>>>& extra = {}) {
  const fs::path dir = fs::temp_directory_path() / ("glm5next-model-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fs::path(kExperts) / "config.json", dir / "config.json");
  auto in = SafetensorsFile::Open(std::string(kExperts) + "/model.safetensors");
  EXPECT_TRUE(in.ok()) << in.status();
  SafetensorsWriter out;
  for (const TensorInfo& t : (*in)->tensors()) {
    if (t.name == drop) continue;
    TensorView v = *(*in)->Get(t.name);
    std::vector<int64_t> shape = t.shape;
    if (t.name == swap && shape.size() >= 2) std::swap(shape[0], shape[1]);
    out.Add(t.name, t.dtype, shape, v.data, v.size_bytes());
  }
  std::vector<std::vector<uint16_t>> zeros;
  for (const auto& [name, shape] : extra) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    zeros.emplace_back(n, 0);
    out.Add(name, DType::kBF16, shape, zeros.back().data(), zeros.back().size() * 2);
  }
  EXPECT_TRUE(out.Write((dir / "model.safetensors").string()).ok());
  return dir.string();
}

void ExpectOpenFails(const std::string& dir, const std::string& needle) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto m = CpuModel::Open(dir, o);
  ASSERT_FALSE(m.ok()) << needle;
  EXPECT_NE(std::string(m.status().message()).find(needle), std::string::npos) << m.status();
  fs::remove_all(dir);
}

TEST(Glm5NextModel, MissingOrMisshapenTensorsAreNamed) {
  const std::string L = "model.language_model.layers.";
  for (const std::string& name :
       {L + "0.self_attn.k_conv1d.weight", L + "0.self_attn.A_log", L + "0.self_attn.dt_bias",
        L + "0.self_attn.o_norm.weight", L + "0.hc_attn_fn", L + "2.hc_ffn_base",
        L + "1.self_attn.indexer.index_kpool_compress_ape",
        L + "1.self_attn.indexer.index_kpool_compress_gate", L + "1.self_attn.indexer.k_norm.bias",
        std::string("model.language_model.embed_tokens.weight")}) {
    ExpectOpenFails(CopyOf(name), name);
  }
  // Linears are found by their prefix (PREFIX.weight or PREFIX.trellis).
  ExpectOpenFails(CopyOf(L + "0.self_attn.f_b_proj.weight"), L + "0.self_attn.f_b_proj");
  ExpectOpenFails(CopyOf(L + "0.self_attn.b_proj.weight"), L + "0.self_attn.b_proj");
  ExpectOpenFails(CopyOf("", L + "1.self_attn.indexer.index_kpool_compress_ape"), "index_kpool_compress_ape");
  ExpectOpenFails(CopyOf("", L + "0.self_attn.q_conv1d.weight"), "q_conv1d");
}

TEST(Glm5NextModel, AnMtpLayerAndTheVisionTowerAreStoredAndLeftAlone) {
  // transformers ignores layers.{num_hidden_layers}.* and shared_head.* on load; the fixture
  // already holds a vision tower (model.visual.*).
  const std::string mtp = "model.language_model.layers.3.";
  const std::string dir = CopyOf("", "", {{mtp + "self_attn.q_a_proj.weight", {128, 256}},
                                          {mtp + "shared_head.head.weight", {128, 256}},
                                          {mtp + "eh_proj.weight", {256, 512}}});
  CpuModelOptions o;
  o.num_threads = 1;
  auto with = CpuModel::Open(dir, o);
  ASSERT_TRUE(with.ok()) << with.status();
  auto without = CpuModel::Open(kExperts, o);
  ASSERT_TRUE(without.ok()) << without.status();
  std::vector<float> a(128), b(128);
  for (CpuModel* m : {with->get(), without->get()}) {
    ASSERT_TRUE(m->AllocateKvCache({4, 16, 1}).ok());
    StepBatch batch;
    SequenceChunk sc;
    sc.tokens = {5, 17, 99, 3, 42, 8};
    sc.block_table = {0};
    sc.wants_logits = true;
    batch.chunks.push_back(sc);
    ASSERT_TRUE(m->Forward(batch, m == with->get() ? a.data() : b.data()).ok());
  }
  EXPECT_EQ(a, b);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace exl3::engine

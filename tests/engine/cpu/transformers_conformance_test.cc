// The CPU engine against transformers: every fixture of tests/fixtures/engine (tiny random models
// of each family built with transformers' own classes, converted by exl3-tool quantize, with
// transformers' outputs on the dequantized weights; tests/fixtures/engine/README.md) must give
// the same greedy tokens and logits within 1e-3 relative, and each MoE layer inside the engine
// must see the hidden states transformers' MoE block saw and answer as exl3-tool moe does.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/cpu/local_moe.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/model_harness.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

const char* const kFixtures[] = {"glm4_moe_experts",    "glm4_moe_all",    "qwen3_moe_experts",
                                 "qwen3_moe_all",       "mixtral_experts", "mixtral_all",
                                 "deepseek_v3_experts", "deepseek_v3_all", "glm_moe_dsa_experts",
                                 "glm_moe_dsa_all",     "deepseek_v4_experts", "deepseek_v4_all",
                                 "qwen3_next_experts",  "qwen3_next_all",
                                 "glm5_next_experts",   "glm5_next_all",
                                 "qwen4_exp_experts",   "qwen4_exp_all",
                                 // The release settings and config.json layouts (the reverse
                                 // check's fixtures, scripts/conformance/exllamav3_reverse.py).
                                 "glm4_moe_release_all", "mixtral_release_all",
                                 "qwen3_moe_release_all", "qwen3_next_release_all",
                                 "deepseek_v3_release_all", "glm_moe_dsa_release_all",
                                 "glm5_next_release_all", "deepseek_v4_release_all",
                                 "qwen4_exp_release_all"};
// The fixtures whose reference has a stop-and-resume run (resume.*: DeepSeek-V4's compressors,
// GLM-5.3-Flash's KDA state and pools, Qwen4-Exp's DeltaNet / PLE states and QSA's indexed keys).
const char* const kResumeFixtures[] = {"deepseek_v4_experts", "deepseek_v4_all",
                                       "glm5_next_experts",   "glm5_next_all",
                                       "qwen4_exp_experts",   "qwen4_exp_all",
                                       "glm5_next_release_all", "deepseek_v4_release_all",
                                       "qwen4_exp_release_all"};

using testing::RelativeError;

struct Reference {
  std::unique_ptr<TensorSource> src;
  std::vector<int32_t> Ints(const std::string& name) const {
    TensorView t = *src->Get(name);
    return std::vector<int32_t>(t.as<int32_t>(), t.as<int32_t>() + t.info->num_elements());
  }
  std::vector<float> Floats(const std::string& name) const { return *ToFloat32(*src->Get(name)); }
  bool Has(const std::string& name) const { return src->Has(name); }
};

// Records each MoE call's input while running the layers in process.
class RecordingMoe final : public MoeExecutor {
 public:
  static std::unique_ptr<RecordingMoe> Open(const std::string& dir) {
    auto r = std::unique_ptr<RecordingMoe>(new RecordingMoe());
    auto local = LocalMoe::Open(dir, r->compute_);
    EXPECT_TRUE(local.ok()) << local.status();
    r->local_ = std::move(*local);
    return r;
  }
  absl::Status Forward(int layer, const float* x, int T, const int32_t* ids, float* y) override {
    inputs[layer].assign(x, x + static_cast<size_t>(T) * local_->model().config().hidden_size);
    return local_->Forward(layer, x, T, ids, y);
  }
  LocalMoe& local() { return *local_; }
  std::map<int, std::vector<float>> inputs;

 private:
  RecordingMoe() : compute_(2) {}
  CpuCompute compute_;
  std::unique_ptr<LocalMoe> local_;
};

class TransformersConformanceTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = (fs::path("tests/fixtures/engine") / GetParam()).string();
    ASSERT_TRUE(fs::exists(dir_ + "/reference.safetensors")) << dir_;
    auto src = TensorSource::Open(dir_ + "/reference.safetensors");
    ASSERT_TRUE(src.ok()) << src.status();
    ref_.src = std::move(*src);
  }
  std::string dir_;
  Reference ref_;
};

TEST_P(TransformersConformanceTest, GreedyTokensAndLogits) {
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir_, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  for (int i = 0; ref_.Has("prompt." + std::to_string(i)); ++i) {
    const std::vector<int32_t> prompt = ref_.Ints("prompt." + std::to_string(i));
    const std::vector<int32_t> greedy = ref_.Ints("greedy." + std::to_string(i));
    const std::vector<float> logits = ref_.Floats("logits." + std::to_string(i));
    const int steps = static_cast<int>(greedy.size());
    // Prompt in chunks of 7 (chunked prefill over the paged cache), then decode.
    auto rows = testing::RunGreedy(**model, {prompt}, steps - 1, /*chunk=*/7);
    ASSERT_TRUE(rows.ok()) << rows.status();
    ASSERT_EQ((*rows)[0].size(), greedy.size());
    double worst = 0;
    for (int j = 0; j < steps; ++j) {
      const std::vector<float>& got = (*rows)[0][j];
      const float* want = &logits[(prompt.size() - 1 + j) * vocab];
      const int token = static_cast<int>(std::max_element(got.begin(), got.end()) - got.begin());
      EXPECT_EQ(token, greedy[j]) << "prompt " << i << " step " << j;
      worst = std::max(worst, RelativeError(got.data(), want, vocab));
    }
    EXPECT_LT(worst, 1e-3) << "prompt " << i;
    std::printf("%s prompt %d (%zu tokens): %d greedy tokens equal, worst logits rel err %.2e\n",
                GetParam(), i, prompt.size(), steps, worst);
  }
}

TEST_P(TransformersConformanceTest, MoeLayersInsideTheEngine) {
  auto recording = RecordingMoe::Open(dir_);
  RecordingMoe* rec = recording.get();
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir_, o, std::move(recording));
  ASSERT_TRUE(model.ok()) << model.status();
  // The moe prompt and its greedy continuation, teacher-forced in one prefill (as the fixture).
  std::vector<int32_t> tokens = ref_.Ints("prompt.1");
  for (int32_t t : ref_.Ints("greedy.1")) tokens.push_back(t);
  auto rows = testing::RunGreedy(**model, {tokens}, 0, /*chunk=*/1000);
  ASSERT_TRUE(rows.ok()) << rows.status();
  const int hidden = (*model)->config().hidden_size;
  int checked = 0;
  for (const auto& [layer, input] : rec->inputs) {
    const std::string L = std::to_string(layer);
    if (!ref_.Has("moe_in." + L)) continue;
    const std::vector<float> moe_in = ref_.Floats("moe_in." + L), moe_out = ref_.Floats("moe_out." + L);
    ASSERT_EQ(input.size(), moe_in.size()) << "layer " << L;
    const double in_err = RelativeError(input.data(), moe_in.data(), moe_in.size());
    EXPECT_LT(in_err, 1e-4) << "layer " << L << ": the MoE block's input";
    std::vector<float> out(moe_out.size());
    const int T = static_cast<int>(moe_in.size() / hidden);
    ASSERT_TRUE(rec->local().Forward(layer, moe_in.data(), T, tokens.data(), out.data()).ok());
    const double out_err = RelativeError(out.data(), moe_out.data(), moe_out.size());
    EXPECT_LT(out_err, 1e-5) << "layer " << L << ": the MoE block on transformers' input";
    std::printf("%s MoE layer %s: input rel err %.2e, output rel err %.2e\n", GetParam(),
                L.c_str(), in_err, out_err);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TransformersConformanceTest, ::testing::ValuesIn(kFixtures));

// prefill → decode → prefill → decode in one sequence, as transformers ran it with its own cache
// (reference.json "resume"): resume.tokens are the first prompt chunk, the greedy tokens, the
// second prompt chunk and the greedy tokens after it; resume.logits row r predicts token r + 1.
class ResumeTest : public TransformersConformanceTest {};

TEST_P(ResumeTest, PrefillDecodePrefillDecode) {
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir_, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  const std::vector<int32_t> tokens = ref_.Ints("resume.tokens");
  const std::vector<float> logits = ref_.Floats("resume.logits");
  ASSERT_EQ(logits.size(), (tokens.size() - 1) * vocab);
  // The run's shape, from reference.json: first prefill 21 tokens, 6 greedy steps, second
  // prefill 19, 32 greedy steps (tests/fixtures/engine/README.md).
  const int first = 21, decode = 6, second = 19;
  ASSERT_EQ(tokens.size(), static_cast<size_t>(first + decode + second + 32));
  // One state slot for the recurrent layers (GLM-5.3-Flash's KDA, Qwen4-Exp's DeltaNet and PLE);
  // unused by the others.
  const absl::Status allocated = (*model)->AllocateKvCache({8, 16, /*num_sequence_slots=*/1});
  ASSERT_TRUE(allocated.ok()) << allocated;
  std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7};
  int computed = 0, compared = 0, greedy = 0;
  double worst = 0;
  // Runs tokens [computed, computed + n) in chunks of at most `chunk`; checks the last row.
  auto run = [&](int n, int chunk, bool next_is_greedy) {
    std::vector<float> row(vocab);
    for (int done = 0; done < n;) {
      const int c = std::min(chunk, n - done);
      StepBatch batch;
      SequenceChunk sc;
      sc.tokens.assign(tokens.begin() + computed, tokens.begin() + computed + c);
      sc.start_position = computed;
      sc.block_table = table;
      sc.state_slot = 0;
      sc.wants_logits = done + c == n;
      batch.chunks.push_back(sc);
      const absl::Status st = (*model)->Forward(batch, row.data());
      ASSERT_TRUE(st.ok()) << st;
      computed += c;
      done += c;
    }
    const float* want = &logits[static_cast<size_t>(computed - 1) * vocab];
    worst = std::max(worst, RelativeError(row.data(), want, vocab));
    ++compared;
    if (next_is_greedy) {
      EXPECT_EQ(std::max_element(row.begin(), row.end()) - row.begin(), tokens[computed])
          << "position " << computed;
      ++greedy;
    }
  };
  // Chunks of 5: DeepSeek-V4's windows of 4 and 16, GLM-5.3-Flash's pools of 4 and its KDA
  // state (chunked form) carried across steps; then decode (KDA's recurrent form), a second
  // prefill of 19 tokens in one chunk, decode.
  run(first, 5, true);
  for (int i = 0; i < decode; ++i) run(1, 1, i + 1 < decode);
  run(second, 1000, true);
  for (int i = 0; i < 31; ++i) run(1, 1, true);
  EXPECT_LT(worst, 1e-3);
  std::printf("%s resume: %d logits rows compared (worst rel err %.2e), %d greedy tokens equal\n",
              GetParam(), compared, worst, greedy);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ResumeTest, ::testing::ValuesIn(kResumeFixtures));

}  // namespace
}  // namespace exl3::engine

// Speculative method mtp on the GPU engine (CudaModel's MTP drafters, engine/cuda/cuda_mtp_head.h and
// cuda_qwen4exp_mtp_head.h) on the <family>_mtp fixtures (DeepSeek-V3 MLA, GLM-4 MoE GQA, GLM-5 DSA,
// GLM-5.3-Flash: KDA, k-pooled DSA and hyper-connections in the model, its MTP layer plain; Qwen4-Exp:
// its head over the gated hyper-connection streams, QSA):
//   * the GPU's drafts equal the CPU engine's (engine/cpu/cpu_model.cc) for the same spans: the
//     prompt as one chunk, then verify chunks of the teacher-forced sequence prompt + greedy with
//     K = 1, 2, 3 drafts (accepted where they match it), each step's kept positions drafting again;
//   * a sequence alone at K = 1 drafts and accepts as the fixture's reference MTP logits
//     (transformers' modules) say;
//   * greedy generation through the Engine with mtp at K = 1, 2, 3 gives plain decoding's tokens
//     (the fixture prompts: transformers' greedy tokens, or on DSA past a token where plain GPU
//     decoding took another after an indexer choice, plain GPU decoding's; prompts built to repeat:
//     plain GPU decoding's up to the first near-tie, as tests/engine/cuda/speculative_decoding_test.cc
//     says why), and the KV cache is idle after;
//   * the MTP layer's KV is one more cache layer (kv_bytes_per_token grows), and models the GPU
//     engine cannot draft for are refused by name.
// DeepSeek-V4's DSPARK block drafter has tests of its own: tests/engine/cuda/dspark_drafting_test.cc.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/config/read_model_config.h"
#include "engine/core/engine.h"
#include "engine/cpu/cpu_model.h"
#include "engine/cuda/cuda_model.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/cuda/open_gpu_model.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/speculative_runs.h"

namespace exl3::engine::cuda {
namespace {

using testing::Greedy32;
using testing::Int32Rows;

SpeculativeOptions Mtp(int k) {
  SpeculativeOptions s;
  s.method = SpeculativeMethod::kMtp;
  s.num_speculative_tokens = k;
  return s;
}

std::string FixtureDir(const char* name) { return std::string("tests/fixtures/engine/") + name; }

class CudaMtpTest : public ::testing::TestWithParam<const char*> {
 protected:
  void LoadReference() {
    auto ref = TensorSource::Open(FixtureDir(GetParam()) + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    prompts_ = Int32Rows(**ref, "prompt.");
    greedy_ = Int32Rows(**ref, "greedy.");
    ASSERT_FALSE(prompts_.empty());
  }
  std::vector<std::vector<int32_t>> prompts_, greedy_;
};

// Both runners run the same step (keeping its states) and draft for the same spans; the drafts
// must be equal. `logits` is scratch.
void StepBoth(ModelRunner& cpu, ModelRunner& gpu, const StepBatch& batch, std::vector<float>* logits) {
  logits->resize(static_cast<size_t>(std::max(batch.NumLogitRows(), 1)) * cpu.info().vocab_size);
  const absl::Status c = cpu.Forward(batch, logits->data());
  ASSERT_TRUE(c.ok()) << c;
  const absl::Status g = gpu.Forward(batch, logits->data());
  ASSERT_TRUE(g.ok()) << g;
}

TEST_P(CudaMtpTest, DraftsEqualTheCpuEnginesForTheSameSpans) {
  REQUIRE_GPU();
  LoadReference();
  const std::string dir = FixtureDir(GetParam());
  std::unique_ptr<CpuModel> cpu = testing::OpenCpuFixtureModel(dir);
  std::unique_ptr<CudaModel> gpu = OpenGpuModel(dir);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  const int64_t gpu_kv_before = gpu->info().kv_bytes_per_token;
  for (ModelRunner* m : {static_cast<ModelRunner*>(cpu.get()), static_cast<ModelRunner*>(gpu.get())}) {
    const absl::Status st = m->EnableMtpDrafting();
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_GT(gpu->info().kv_bytes_per_token, gpu_kv_before) << "the MTP layer's KV is one more cache layer";
  // Every (prompt, K) run in blocks of its own, one after the other (state slot 0 starts afresh at
  // position 0); verify chunks of up to 4 rows.
  const int block_size = 16, blocks_per_run = 4;
  const int runs = static_cast<int>(prompts_.size()) * 3;
  const KvCacheShape shape{runs * blocks_per_run, block_size, /*num_sequence_slots=*/1,
                           /*max_logit_rows_per_chunk=*/4};
  for (ModelRunner* m : {static_cast<ModelRunner*>(cpu.get()), static_cast<ModelRunner*>(gpu.get())}) {
    const absl::Status st = m->AllocateKvCache(shape);
    ASSERT_TRUE(st.ok()) << st;
  }
  std::vector<float> logits;
  int run = 0, compared = 0, accepted = 0;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    // The teacher-forced sequence: the model's tokens are transformers' greedy ones (the fixtures'
    // top-2 margins are wide), so both engines see the same history.
    std::vector<int32_t> ids = prompts_[i];
    ids.insert(ids.end(), greedy_[i].begin(), greedy_[i].end());
    const int P = static_cast<int>(prompts_[i].size());
    for (int k = 1; k <= 3; ++k, ++run) {
      std::vector<int32_t> table;
      for (int b = 0; b < blocks_per_run; ++b) table.push_back(run * blocks_per_run + b);
      const int max_position = blocks_per_run * block_size - 1;
      const int64_t id = 100 + run;
      // The prompt as one chunk; its kept positions draft the first K.
      StepBatch batch;
      batch.keep_hidden_states = true;
      SequenceChunk& prompt = batch.chunks.emplace_back();
      prompt.sequence_id = id;
      prompt.tokens.assign(ids.begin(), ids.begin() + P);
      prompt.block_table = table;
      prompt.wants_logits = true;
      int start = 0, kept = P;
      for (int step = 0;; ++step) {
        ASSERT_NO_FATAL_FAILURE(StepBoth(*cpu, *gpu, batch, &logits));
        const MtpSpan span = TeacherForcedSpan(id, ids, start, kept, table, k);
        // The last kept position; the drafts run the MTP up to last + k - 1 and the verify chunk
        // writes positions last + 1 .. last + 1 + k, whose successors the sequence must hold.
        const int last = start + kept - 1;
        if (last + k + 1 >= static_cast<int>(ids.size()) || last + 1 + k > max_position) break;
        const std::vector<MtpSpan> spans = {span};
        auto cpu_drafts = cpu->ProposeMtpDrafts(spans);
        ASSERT_TRUE(cpu_drafts.ok()) << cpu_drafts.status();
        auto gpu_drafts = gpu->ProposeMtpDrafts(spans);
        ASSERT_TRUE(gpu_drafts.ok()) << gpu_drafts.status();
        ASSERT_EQ(gpu_drafts->size(), 1u);
        ASSERT_EQ((*cpu_drafts)[0].size(), static_cast<size_t>(k));
        EXPECT_EQ((*gpu_drafts)[0], (*cpu_drafts)[0])
            << GetParam() << " prompt " << i << ", K " << k << ", step " << step << " (positions " << start << ".."
            << last << ")";
        ++compared;
        // The verify chunk: the token at last + 1 and the drafts; the drafts that match the
        // teacher-forced sequence are accepted, and the next step's kept positions are those.
        const std::vector<int32_t>& drafts = (*cpu_drafts)[0];
        int hits = 0;
        while (hits < k && drafts[hits] == ids[last + 2 + hits]) ++hits;
        accepted += hits;
        batch = TeacherForcedVerify(id, ids, last, drafts, table);
        start = last + 1;
        kept = 1 + hits;
        if (step >= 8) break;
      }
    }
  }
  std::printf("%s: %d draft proposals compared (K = 1, 2, 3), %d drafts matched the greedy sequence\n", GetParam(),
              compared, accepted);
  EXPECT_GT(compared, 0);
}

TEST_P(CudaMtpTest, GreedyGenerationWithMtpEqualsPlainDecoding) {
  REQUIRE_GPU();
  LoadReference();
  const std::string dir = FixtureDir(GetParam());
  std::vector<GenerateParams> params;
  for (const auto& p : prompts_) params.push_back(Greedy32(p, /*logprobs=*/2));
  for (size_t i = 0; i < 2 && i < prompts_.size(); ++i)
    params.push_back(Greedy32(testing::Repeating(prompts_[i], greedy_[i]), /*logprobs=*/2));
  auto run = [&](const SpeculativeOptions& speculative) {
    return testing::RunOnce(testing::SpeculativeEngineOptions(speculative, /*kv_blocks=*/64, /*block_size=*/16),
                            OpenGpuModel(dir), params);
  };
  const testing::SpeculativeRun plain = run({});
  // Plain GPU decoding against transformers' greedy tokens. Where an indexer chooses the positions
  // attention reads (DSA), a near-tie at its top-k boundary that the GPU's fp16 keys break the other
  // way can change a token (tests/engine/cuda/cuda_model_test.cc counts such rows), more often in a
  // batch, whose rows' sums run in another order than a sequence alone: from there that request is
  // compared with plain GPU decoding only, and the difference reported. Any other family: every
  // token transformers'.
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const bool selecting = config->attention == AttentionKind::kDsa || config->attention == AttentionKind::kPooledDsa ||
                         config->attention == AttentionKind::kQsa;
  std::vector<bool> plain_is_greedy(prompts_.size(), true);
  for (size_t i = 0; i < prompts_.size(); ++i) {
    for (size_t t = 0; t < plain.tokens[i].size(); ++t) {
      if (plain.tokens[i][t].token == greedy_[i][t]) continue;
      const std::vector<TokenLogprob>& top = plain.tokens[i][t].top_logprobs;
      const std::string where = absl::StrCat(GetParam(), " plain, prompt ", i, ", token ", t, ": ",
                                             plain.tokens[i][t].token, " where transformers' is ", greedy_[i][t],
                                             " (top-2 gap ", top.size() == 2 ? top[0].logprob - top[1].logprob : -1.0f,
                                             ", runner-up ", top.size() == 2 ? top[1].token : -1, ")");
      ASSERT_TRUE(selecting) << where;
      std::printf("%s: after an indexer choice; compared with plain GPU decoding from here\n", where.c_str());
      plain_is_greedy[i] = false;
      break;
    }
  }
  for (int k : {1, 2, 3}) {
    const testing::SpeculativeRun spec = run(Mtp(k));
    ASSERT_EQ(spec.tokens.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(spec.finish[i].reason, FinishReason::kLength) << "K " << k << ", request " << i;
      ASSERT_EQ(spec.tokens[i].size(), plain.tokens[i].size()) << "K " << k << ", request " << i;
      const bool fixture_prompt = i < prompts_.size();
      // A verify row runs the prefill kernels where plain decoding runs the decode kernels.
      ASSERT_NO_FATAL_FAILURE(testing::ExpectTokensOfPlainDecoding(
          spec.tokens[i], plain.tokens[i], fixture_prompt && plain_is_greedy[i] ? &greedy_[i] : nullptr,
          absl::StrCat(GetParam(), " K ", k, fixture_prompt ? ", prompt " : ", repeating prompt ", i)));
    }
    testing::ExpectMtpRunCounts(spec, plain, k, absl::StrCat(GetParam(), " GPU mtp"));
  }
}

TEST_P(CudaMtpTest, DraftsAreTheHeadsPredictionsAtK1) {
  // With K = 1 every draft is the MTP head's argmax at the sequence's last kept position p
  // (predicting position p + 2), which the fixture's reference gives for the teacher-forced
  // sequence prompt + greedy (transformers' modules): a sequence alone drafts and accepts exactly
  // as simulated from it only if the MTP layer's KV of every earlier position was written by the
  // steps before (the prompt, accepted drafts, rejections). As the CPU engine's test
  // (tests/engine/speculative/mtp_speculative_decoding_test.cc), on the GPU.
  REQUIRE_GPU();
  LoadReference();
  const std::string dir = FixtureDir(GetParam());
  std::vector<testing::MtpDraftCounts> counts;
  ASSERT_NO_FATAL_FAILURE(testing::SimulateMtpDraftsAtK1(dir, prompts_, greedy_, &counts));
  for (size_t i = 0; i < prompts_.size(); ++i) {
    const testing::MtpDraftCounts& want = counts[i];
    const testing::SpeculativeRun spec =
        testing::RunOnce(testing::SpeculativeEngineOptions(Mtp(1), /*kv_blocks=*/64, /*block_size=*/16),
                         OpenGpuModel(dir), {Greedy32(prompts_[i])});
    ASSERT_EQ(spec.tokens.size(), 1u);
    EXPECT_EQ(testing::Ids(spec.tokens[0]), greedy_[i]) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_draft_tokens, want.drafts) << GetParam() << " prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_accepted_tokens, want.accepted) << GetParam() << " prompt " << i;
    std::printf("%s prompt %zu alone on the GPU, K=1: %lld of %lld drafts accepted (the reference's MTP logits: %lld "
                "of %lld)\n",
                GetParam(), i, static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
                static_cast<long long>(spec.stats.speculative.num_draft_tokens), static_cast<long long>(want.accepted),
                static_cast<long long>(want.drafts));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaMtpTest,
                         ::testing::Values("deepseek_v3_mtp", "glm4_moe_mtp", "glm_moe_dsa_mtp",
                                           "glm_moe_dsa_release_mtp", "glm5_next_mtp", "glm5_next_release_mtp"));

// Qwen4-Exp: its MTP head over the gated hyper-connection streams.
INSTANTIATE_TEST_SUITE_P(Qwen4Exp, CudaMtpTest, ::testing::Values("qwen4_exp_mtp", "qwen4_exp_release_mtp"));

TEST(CudaMtpRefusalTest, ModelsWithoutAnMtpDrafterAreRefusedByName) {
  REQUIRE_GPU();
  struct Case {
    const char* fixture;
    const char* says;  // a part of the refusal
  };
  // A DeepSeek-V4 config without the DSPARK drafter's MTP blocks (the drafter itself runs:
  // tests/engine/cuda/dspark_drafting_test.cc); a checkpoint without its MTP layer names what is
  // missing; a family without an MTP design says so.
  for (const Case& c : {Case{"deepseek_v4_all", "no DSPARK mtp drafter"}, Case{"glm4_moe_all", "missing"},
                        Case{"qwen3_moe_all", "no MTP head"}}) {
    std::unique_ptr<CudaModel> model = OpenGpuModel(FixtureDir(c.fixture));
    ASSERT_NE(model, nullptr) << c.fixture;
    const absl::Status check = model->CheckMtpDrafting();
    EXPECT_EQ(check.code(), absl::StatusCode::kFailedPrecondition) << c.fixture << ": " << check;
    EXPECT_NE(check.message().find(model->info().architecture), std::string::npos) << check;
    EXPECT_NE(check.message().find(c.says), std::string::npos) << check;
    const int64_t kv = model->info().kv_bytes_per_token;
    EXPECT_FALSE(model->EnableMtpDrafting().ok()) << c.fixture;
    EXPECT_EQ(model->info().kv_bytes_per_token, kv) << c.fixture;
  }
  // Through the engine: refused at start, naming the method.
  Engine engine(testing::SpeculativeEngineOptions(Mtp(2), /*kv_blocks=*/64, /*block_size=*/16),
                OpenGpuModel(FixtureDir("glm4_moe_all")));
  const absl::Status started = engine.Start();
  EXPECT_FALSE(started.ok());
  EXPECT_NE(started.message().find("speculative method mtp refused"), std::string::npos) << started;
}

TEST(CudaMtpRefusalTest, KeepingStatesWithoutMtpDraftingIsRefused) {
  REQUIRE_GPU();
  std::unique_ptr<CudaModel> model = OpenGpuModel(FixtureDir("glm4_moe_mtp"));
  ASSERT_NE(model, nullptr);
  ASSERT_TRUE(model->AllocateKvCache({8, 16}).ok());
  StepBatch batch;
  batch.keep_hidden_states = true;
  SequenceChunk& c = batch.chunks.emplace_back();
  c.sequence_id = 1;
  c.tokens = {1, 2, 3};
  c.block_table = {0};
  c.wants_logits = true;
  std::vector<float> logits(model->info().vocab_size);
  EXPECT_EQ(model->Forward(batch, logits.data()).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<MtpSpan> spans(1);
  EXPECT_EQ(model->ProposeMtpDrafts(spans).status().code(), absl::StatusCode::kFailedPrecondition);
  // Enabled after the cache exists: refused (the cache has no layer for it).
  EXPECT_EQ(model->EnableMtpDrafting().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace exl3::engine::cuda

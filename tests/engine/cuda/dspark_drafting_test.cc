// DeepSeek-V4's DSPARK block drafter on the GPU engine (engine/cuda/cuda_dspark_drafter.h, driven by
// engine/cuda/mtp_drafting.h for speculative method mtp; docs/dspark.md) on the
// deepseek_v4_release_mtp fixture:
//   * the drafter alone against the fp32 torch reference (scripts/conformance/dspark_reference.py)
//     the fixture records, as tests/engine/cpu/mtp/dspark_drafter_test.cc checks the CPU drafter:
//     for both prompts the main-kv rows from the recorded trunk taps, and at every draft position
//     p0 the draft call (seed = ids[p0], history = the rows just written of positions
//     p0 - min(window, p0) .. p0 - 1): the Markov-biased logits and the confidence logits
//     (relative error printed), the drafts and the draft length (equal); every p0 one call at a
//     time and all in one batched call;
//   * the GPU model's drafts equal the CPU model's for the same spans (the trunk's taps on the
//     device, the rows kept in the drafter's cache layer), teacher-forced on prompt + greedy;
//   * greedy generation through the Engine with mtp at K = 1, 2 and 4 gives plain GPU decoding's
//     tokens and logprobs (the fixture prompts: transformers' greedy tokens; prompts built to
//     repeat: plain GPU decoding's up to a near-tie, as tests/engine/cuda/speculative_decoding_test.cc
//     says why), also through preemption (the rows written again with the recomputed prompt), the
//     KV cache idle after;
//   * a sequence alone at K = 1 drafts and accepts exactly as the fixture's reference drafts and
//     lengths say (as the CPU engine's tests/engine/speculative/mtp_speculative_decoding_test.cc).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/read_model_config.h"
#include "engine/core/engine.h"
#include "engine/cpu/cpu_model.h"
#include "engine/cuda/cuda_dspark_drafter.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/device_context.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/reference_tensors.h"
#include "tests/engine/cuda/open_gpu_model.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/speculative_runs.h"

namespace exl3::engine::cuda {
namespace {

using testing::Greedy32;
using testing::Ids;
using testing::Int32Rows;

constexpr char kDir[] = "tests/fixtures/engine/deepseek_v4_release_mtp";

SpeculativeOptions Mtp(int k) {
  SpeculativeOptions s;
  s.method = SpeculativeMethod::kMtp;
  s.num_speculative_tokens = k;
  return s;
}

using testing::ReferenceFloats;
using testing::ReferenceInts;

// The GPU against the fp32 reference: EXL3 linears on the GPU's kernels (the model tests' bound,
// tests/engine/cuda/cuda_model_test.cc); the fixture keeps every greedy choice and confidence sign
// clear of ties (its reference.json), so drafts and lengths must be equal.
constexpr double kTolerance = 5e-3;

TEST(CudaDsparkDrafterTest, MatchesTheReferenceAtEveryDraftPosition) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kDir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->dsv4, nullptr);
  ASSERT_TRUE(cfg->dsv4->dspark.enabled());
  auto src = TensorSource::Open(kDir);
  ASSERT_TRUE(src.ok()) << src.status();
  auto ref = TensorSource::Open(std::string(kDir) + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int H = cfg->hidden_size, V = cfg->vocab_size;
  // What the drafter borrows of the model: its stream, embeddings and head.
  auto device = DeviceContext::Create();
  ASSERT_TRUE(device.ok()) << device.status();
  auto embedding = (*src)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(embedding.ok()) << embedding.status();
  EmbeddingDType dtype = EmbeddingDType::kF32;
  switch (embedding->info->dtype) {
    case DType::kF32: break;
    case DType::kF16: dtype = EmbeddingDType::kF16; break;
    case DType::kBF16: dtype = EmbeddingDType::kBF16; break;
    default: FAIL() << "embeddings of dtype " << DTypeName(embedding->info->dtype);
  }
  DeviceArray<uint8_t> table;
  ASSERT_TRUE(table.Upload(static_cast<const uint8_t*>(embedding->data), embedding->size_bytes()).ok());
  auto head = CudaLinear::Load(**src, "head", H, V);
  ASSERT_TRUE(head.ok()) << head.status();
  CudaMtpModelParts parts;
  parts.linear = (*device)->linear();
  parts.sm_count = (*device)->sm_count();
  parts.embedding = table.get();
  parts.embedding_dtype = dtype;
  parts.head = &*head;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto drafter = CudaDsparkDrafter::Load(*cfg, **src, parts);
  ASSERT_TRUE(drafter.ok()) << drafter.status();
  CudaDsparkDrafter& d = **drafter;
  ASSERT_EQ(d.num_blocks(), 1);
  const int D = d.row_width(), B = d.block_size();
  ASSERT_EQ(B, 4);
  ASSERT_EQ(d.tap_width(), 2 * H);
  EXPECT_EQ(d.tap_layers(), (std::vector<int>{0, 2}));
  // Positions up to max_position_embeddings (128) in blocks of 16, scattered over the cache.
  const int block_size = 16;
  ASSERT_TRUE(d.AllocateCache({/*num_blocks=*/16, block_size}, (*device)->stream()).ok());
  const std::vector<int32_t> blocks = {9, 3, 14, 0, 7, 11, 5, 12};
  for (int s = 0; s < 2; ++s) {
    const std::string k = std::to_string(s);
    std::vector<int32_t> ids = ReferenceInts(**ref, "prompt." + k);
    const std::vector<int32_t> greedy = ReferenceInts(**ref, "greedy." + k);
    ids.insert(ids.end(), greedy.begin(), greedy.end());
    const int n = static_cast<int>(ids.size());
    ASSERT_LE(n, static_cast<int>(blocks.size()) * block_size);
    const std::vector<float> taps = ReferenceFloats(**ref, "dspark_taps." + k);
    const std::vector<float> want_rows = ReferenceFloats(**ref, "dspark_main_kv." + k);
    ASSERT_EQ(taps.size(), static_cast<size_t>(n) * 2 * H);
    ASSERT_EQ(want_rows.size(), static_cast<size_t>(n) * D);
    const DeviceArray<float> device_taps = ToDevice(taps);
    // The rows of every position from its taps (two writes: 0 .. n - 2, then the last alone).
    const DsparkRowWrite writes[] = {{device_taps.get(), 0, n - 1, &blocks},
                                     {device_taps.get() + static_cast<size_t>(n - 1) * 2 * H, n - 1, 1, &blocks}};
    auto none = d.Run(writes, {}, /*want_logits=*/false);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty());
    auto rows = d.ReadRows(0, blocks, 0, n);
    ASSERT_TRUE(rows.ok()) << rows.status();
    const double row_err = RelativeError(rows->data(), want_rows.data(), rows->size());
    std::printf("prompt %d: main-kv rows of %d positions: rel err %.3g\n", s, n, row_err);
    EXPECT_LT(row_err, kTolerance);

    const std::vector<float> want_logits = ReferenceFloats(**ref, "dspark_logits." + k);
    const std::vector<float> want_conf = ReferenceFloats(**ref, "dspark_confidence." + k);
    const std::vector<int32_t> want_drafts = ReferenceInts(**ref, "dspark_drafts." + k);
    const std::vector<int32_t> want_length = ReferenceInts(**ref, "dspark_length." + k);
    ASSERT_EQ(want_logits.size(), static_cast<size_t>(n) * B * V);
    ASSERT_EQ(want_drafts.size(), static_cast<size_t>(n) * B);
    ASSERT_EQ(want_length.size(), static_cast<size_t>(n));
    // Every p0 one call at a time, then all of them in one call.
    std::vector<DsparkDraftCall> calls;
    for (int p0 = 0; p0 < n; ++p0) calls.push_back({ids[p0], p0, &blocks});
    std::vector<DsparkDraft> single;
    for (const DsparkDraftCall& c : calls) {
      auto r = d.Run({}, {&c, 1}, /*want_logits=*/true);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->size(), 1u);
      single.push_back(std::move((*r)[0]));
    }
    auto batched = d.Run({}, calls, /*want_logits=*/true);
    ASSERT_TRUE(batched.ok()) << batched.status();
    ASSERT_EQ(batched->size(), calls.size());
    for (const auto* results : {&single, &*batched}) {
      const char* how = results == &single ? "one at a time" : "in one call";
      double worst_logits = 0, worst_conf = 0;
      int draft_mismatches = 0, length_mismatches = 0;
      for (int p0 = 0; p0 < n; ++p0) {
        const DsparkDraft& r = (*results)[p0];
        ASSERT_EQ(r.logits.size(), static_cast<size_t>(B) * V);
        ASSERT_EQ(r.drafts.size(), static_cast<size_t>(B));
        ASSERT_EQ(r.confidence.size(), static_cast<size_t>(B));
        worst_logits =
            std::max(worst_logits, RelativeError(r.logits.data(), &want_logits[static_cast<size_t>(p0) * B * V], r.logits.size()));
        worst_conf = std::max(worst_conf, RelativeError(r.confidence.data(), &want_conf[static_cast<size_t>(p0) * B], B));
        for (int j = 0; j < B; ++j) {
          EXPECT_EQ(r.drafts[j], want_drafts[static_cast<size_t>(p0) * B + j])
              << how << ", prompt " << s << " p0 " << p0 << " j " << j;
          draft_mismatches += r.drafts[j] != want_drafts[static_cast<size_t>(p0) * B + j];
        }
        EXPECT_EQ(r.length, want_length[p0]) << how << ", prompt " << s << " p0 " << p0;
        length_mismatches += r.length != want_length[p0];
      }
      std::printf("prompt %d: %d draft calls %s: worst rel err logits %.3g, confidence %.3g; draft mismatches %d, "
                  "length mismatches %d\n",
                  s, n, how, worst_logits, worst_conf, draft_mismatches, length_mismatches);
      EXPECT_LT(worst_logits, kTolerance) << how;
      EXPECT_LT(worst_conf, kTolerance) << how;
    }
  }
  // A draft whose history is not in its block table is refused before anything runs.
  const std::vector<int32_t> short_table = {1};
  const DsparkDraftCall beyond{1, 40, &short_table};
  EXPECT_EQ(d.Run({}, {&beyond, 1}, false).status().code(), absl::StatusCode::kInvalidArgument);
}

class CudaDsparkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ref = TensorSource::Open(std::string(kDir) + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = std::move(*ref);
    prompts_ = Int32Rows(*ref_, "prompt.");
    greedy_ = Int32Rows(*ref_, "greedy.");
    ASSERT_EQ(prompts_.size(), 2u);
  }
  // Every fixture prompt and one built to repeat from each: greedy, 32 tokens, top-2 logprobs.
  std::vector<GenerateParams> GreedyRequests() const {
    std::vector<GenerateParams> params;
    for (const auto& p : prompts_) params.push_back(Greedy32(p, /*logprobs=*/2));
    for (size_t i = 0; i < prompts_.size(); ++i)
      params.push_back(Greedy32(testing::Repeating(prompts_[i], greedy_[i]), /*logprobs=*/2));
    return params;
  }
  testing::SpeculativeRun Run(const SpeculativeOptions& speculative, const std::vector<GenerateParams>& params,
                              int kv_blocks = 256) {
    return testing::RunOnce(testing::SpeculativeEngineOptions(speculative, kv_blocks), OpenGpuModel(kDir), params);
  }

  std::unique_ptr<TensorSource> ref_;
  std::vector<std::vector<int32_t>> prompts_, greedy_;
};

TEST_F(CudaDsparkTest, DraftsEqualTheCpuEnginesForTheSameSpans) {
  // The prompt as one chunk, then verify chunks of the teacher-forced sequence prompt + greedy
  // with the drafts each engine proposed (equal, or the test fails), accepted where they match it.
  REQUIRE_GPU();
  std::unique_ptr<CpuModel> cpu = testing::OpenCpuFixtureModel(kDir);
  std::unique_ptr<CudaModel> gpu = OpenGpuModel(kDir);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  const absl::Status check = gpu->CheckMtpDrafting();
  ASSERT_TRUE(check.ok()) << check;
  const int64_t gpu_kv_before = gpu->info().kv_bytes_per_token;
  for (ModelRunner* m : {static_cast<ModelRunner*>(cpu.get()), static_cast<ModelRunner*>(gpu.get())}) {
    const absl::Status st = m->EnableMtpDrafting();
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_EQ(gpu->info().kv_bytes_per_token - gpu_kv_before, 128 * static_cast<int64_t>(sizeof(float)))
      << "one main-kv row of head_dim floats per position and block";
  const int block_size = 16, blocks_per_run = 8, runs = 2 * 3;
  const KvCacheShape shape{runs * blocks_per_run, block_size, /*num_sequence_slots=*/1,
                           /*max_logit_rows_per_chunk=*/5};
  for (ModelRunner* m : {static_cast<ModelRunner*>(cpu.get()), static_cast<ModelRunner*>(gpu.get())}) {
    const absl::Status st = m->AllocateKvCache(shape);
    ASSERT_TRUE(st.ok()) << st;
  }
  std::vector<float> logits;
  int run = 0, compared = 0, drafted = 0, accepted = 0;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    std::vector<int32_t> ids = prompts_[i];
    ids.insert(ids.end(), greedy_[i].begin(), greedy_[i].end());
    const int P = static_cast<int>(prompts_[i].size());
    for (int k : {1, 2, 4}) {
      std::vector<int32_t> table;
      for (int b = 0; b < blocks_per_run; ++b) table.push_back(run * blocks_per_run + b);
      ++run;
      const int64_t id = 100 + run;
      StepBatch batch;
      batch.keep_hidden_states = true;
      SequenceChunk& prompt = batch.chunks.emplace_back();
      prompt.sequence_id = id;
      prompt.tokens.assign(ids.begin(), ids.begin() + P);
      prompt.block_table = table;
      prompt.wants_logits = true;
      int start = 0, kept = P;
      for (int step = 0; step < 24; ++step) {
        logits.resize(static_cast<size_t>(std::max(batch.NumLogitRows(), 1)) * cpu->info().vocab_size);
        const absl::Status c = cpu->Forward(batch, logits.data());
        ASSERT_TRUE(c.ok()) << c;
        const absl::Status g = gpu->Forward(batch, logits.data());
        ASSERT_TRUE(g.ok()) << g;
        const int last = start + kept - 1;  // the last kept position; the seed is the token at last + 1
        if (last + 1 + k >= static_cast<int>(ids.size())) break;
        const std::vector<MtpSpan> spans = {TeacherForcedSpan(id, ids, start, kept, table, k)};
        auto cpu_drafts = cpu->ProposeMtpDrafts(spans);
        ASSERT_TRUE(cpu_drafts.ok()) << cpu_drafts.status();
        auto gpu_drafts = gpu->ProposeMtpDrafts(spans);
        ASSERT_TRUE(gpu_drafts.ok()) << gpu_drafts.status();
        ASSERT_EQ(gpu_drafts->size(), 1u);
        EXPECT_EQ((*gpu_drafts)[0], (*cpu_drafts)[0])
            << "prompt " << i << ", K " << k << ", step " << step << " (positions " << start << ".." << last << ")";
        ++compared;
        // The verify chunk: the token at last + 1 and the drafts (none: a plain step).
        const std::vector<int32_t>& drafts = (*cpu_drafts)[0];
        const int w = static_cast<int>(drafts.size());
        EXPECT_LE(w, k);
        drafted += w;
        int hits = 0;
        while (hits < w && drafts[hits] == ids[last + 2 + hits]) ++hits;
        accepted += hits;
        batch = TeacherForcedVerify(id, ids, last, drafts, table);
        start = last + 1;
        kept = 1 + hits;
      }
    }
  }
  std::printf("deepseek_v4_release_mtp: %d DSPARK proposals compared (K = 1, 2, 4): %d drafts, %d matched the "
              "greedy sequence\n",
              compared, drafted, accepted);
  EXPECT_GT(compared, 0);
  EXPECT_GT(drafted, 0);
}

TEST_F(CudaDsparkTest, GreedyTokensAndLogprobsEqualPlainDecodingAtK124) {
  REQUIRE_GPU();
  const std::vector<GenerateParams> params = GreedyRequests();
  const testing::SpeculativeRun plain = Run({}, params);
  ASSERT_EQ(plain.tokens.size(), params.size());
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(Ids(plain.tokens[i]), greedy_[i]) << "plain, prompt " << i;
  for (int k : {1, 2, 4}) {
    const testing::SpeculativeRun spec = Run(Mtp(k), params);
    ASSERT_EQ(spec.tokens.size(), params.size());
    double worst_logprob = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(spec.finish[i].reason, FinishReason::kLength) << "K " << k << ", request " << i;
      // The fixture prompts: transformers' greedy tokens; the repeating ones plain GPU decoding's
      // up to a near-tie (a verify row's linears may run other kernels than a decode row's).
      const bool fixture_prompt = i < prompts_.size();
      ASSERT_NO_FATAL_FAILURE(testing::ExpectTokensOfPlainDecoding(
          spec.tokens[i], plain.tokens[i], fixture_prompt ? &greedy_[i] : nullptr,
          absl::StrCat("deepseek_v4_release_mtp K ", k, fixture_prompt ? ", prompt " : ", repeating prompt ", i)));
      // Logprobs of the same tokens within the CPU engine's bound
      // (tests/engine/speculative/mtp_speculative_decoding_test.cc).
      for (size_t t = 0; t < spec.tokens[i].size() && spec.tokens[i][t].token == plain.tokens[i][t].token; ++t) {
        ASSERT_TRUE(spec.tokens[i][t].logprob.has_value() && plain.tokens[i][t].logprob.has_value());
        const double diff = std::fabs(*spec.tokens[i][t].logprob - *plain.tokens[i][t].logprob);
        worst_logprob = std::max(worst_logprob, diff);
        EXPECT_LT(diff, 1e-4) << "K " << k << ", request " << i << ", token " << t;
      }
    }
    testing::ExpectMtpRunCounts(spec, plain, k, "deepseek_v4_release_mtp GPU mtp");
    std::printf("deepseek_v4_release_mtp GPU mtp K=%d: worst |logprob - plain's| %.2e\n", k, worst_logprob);
  }
}

TEST_F(CudaDsparkTest, PreemptionGivesTheSameTokensAndFreesEverything) {
  // 40 blocks of 4 = 160 tokens for prompts + continuations of about 280: preemption and
  // recomputation (the main-kv rows written again with the recomputed prompt).
  REQUIRE_GPU();
  const std::vector<GenerateParams> params = GreedyRequests();
  const testing::SpeculativeRun plain = Run({}, params);
  const testing::SpeculativeRun spec = Run(Mtp(4), params, /*kv_blocks=*/40);
  EXPECT_GT(spec.stats.preemptions, 0);
  ASSERT_EQ(spec.tokens.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const bool fixture_prompt = i < prompts_.size();
    ASSERT_NO_FATAL_FAILURE(testing::ExpectTokensOfPlainDecoding(
        spec.tokens[i], plain.tokens[i], fixture_prompt ? &greedy_[i] : nullptr,
        absl::StrCat("deepseek_v4_release_mtp preempted, request ", i)));
  }
  std::printf("deepseek_v4_release_mtp GPU preempted %lld times: %lld of %lld drafts accepted\n",
              static_cast<long long>(spec.stats.preemptions),
              static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
              static_cast<long long>(spec.stats.speculative.num_draft_tokens));
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
}

TEST_F(CudaDsparkTest, DraftsAreTheReferencesAtK1) {
  // A sequence alone at K = 1: its first seed is the first sampled token at p0 = the prompt's
  // length; a draft is the reference's first draft at p0 where its length is not 0 (else a plain
  // step), accepted where it is the greedy token, as the CPU engine's test simulates it.
  REQUIRE_GPU();
  const int max_tokens = 32, B = 4;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    const std::string k = std::to_string(i);
    const std::vector<int32_t> drafts = ReferenceInts(*ref_, "dspark_drafts." + k);
    const std::vector<int32_t> lengths = ReferenceInts(*ref_, "dspark_length." + k);
    std::vector<int32_t> ids = prompts_[i];
    ids.insert(ids.end(), greedy_[i].begin(), greedy_[i].end());
    const int P = static_cast<int>(prompts_[i].size());
    int64_t want_drafts = 0, want_accepted = 0;
    for (int p0 = P, out = 1; max_tokens - out - 1 > 0;) {  // after the prefill: 1 token out
      if (lengths[p0] == 0) {
        ++p0;
        ++out;
        continue;
      }
      ++want_drafts;
      const bool hit = drafts[static_cast<size_t>(p0) * B] == ids[p0 + 1];
      want_accepted += hit;
      p0 += hit ? 2 : 1;
      out += hit ? 2 : 1;
    }
    const testing::SpeculativeRun spec = Run(Mtp(1), {Greedy32(prompts_[i])});
    ASSERT_EQ(spec.tokens.size(), 1u);
    EXPECT_EQ(Ids(spec.tokens[0]), greedy_[i]) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_draft_tokens, want_drafts) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_accepted_tokens, want_accepted) << "prompt " << i;
    std::printf("deepseek_v4_release_mtp prompt %zu alone on the GPU, K=1: %lld of %lld drafts accepted (reference: "
                "%lld of %lld)\n",
                i, static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
                static_cast<long long>(spec.stats.speculative.num_draft_tokens), static_cast<long long>(want_accepted),
                static_cast<long long>(want_drafts));
  }
}

}  // namespace
}  // namespace exl3::engine::cuda

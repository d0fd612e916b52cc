// Rejected drafts and DeepSeek-V4's compressed caches (engine/cpu/attention/dsv4_attention.h,
// engine/cpu/attention/dsv4_kept_accumulators.h), one compressed layer at a time (layer 1: CSA with its indexer,
// windows of 4; layer 2: HCA, windows of 16) of tests/fixtures/engine/deepseek_v4_experts, with
// random inputs. After a prefill of P positions, a verify chunk of d + 1 = 5 (positions P .. P + 4)
// keeps a + 1 of them (a = 0 .. 4), the rest holding other inputs (rejected drafts); the sequence
// then runs its true next 4 positions from P + a + 1. The prefill lengths put the verify chunk
// and the resume point at every offset within a CSA window, across an HCA window's end and
// across cache blocks (of 8 and of 16). The block areas (fold counts, both compressors'
// accumulators, the entries of every window closed by then) and the next chunk's outputs equal,
// bit for bit, those of a cache that never saw the rejected inputs (prefill, the a + 1 kept
// positions, the same next chunk). The next chunk run twice (a failed step run again) changes
// nothing; nor does the verify chunk run twice (its run again keeps every state its first run
// kept).
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/config/dsv4_config.h"
#include "engine/cpu/attention/load_attention.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/one_chunk_step.h"
#include "tests/engine/relative_error.h"
#include "tests/engine/verify_chunk_runs.h"

namespace exl3::engine {
namespace {

constexpr char kFixture[] = "tests/fixtures/engine/deepseek_v4_experts";
constexpr int kVerify = 5, kNext = 4, kBlocks = 12, kMaxPrefill = 40;

class Dsv4VerifyChunkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cfg = LoadModelConfig(kFixture);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    ASSERT_EQ(cfg_->attention, AttentionKind::kDsv4);
    auto src = TensorSource::Open(kFixture);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    testing::VerifyChunkInputs in =
        testing::RandomVerifyChunkInputs(kMaxPrefill + kVerify + kNext, cfg_->hidden_size, cfg_->vocab_size);
    ids_ = std::move(in.ids);
    true_x_ = std::move(in.true_x);
    rejected_x_ = std::move(in.rejected_x);
  }

  std::unique_ptr<PagedKvCache> Cache(int block_size) const {
    std::vector<KvLayerShape> layers(cfg_->num_layers);
    for (int l = 0; l < cfg_->num_layers; ++l) layers[l] = {cfg_->KvWidth(l), cfg_->KvBlockFloats(l, block_size)};
    return std::make_unique<PagedKvCache>(
        std::move(layers), KvCacheShape{kBlocks, block_size, /*num_sequence_slots=*/1,
                                        /*max_logit_rows_per_chunk=*/kVerify});
  }

  // Positions [start, start + x.size() / hidden) as one chunk with inputs x, wanting `rows` logit
  // rows (a verify chunk: rows > 1); its outputs.
  std::vector<float> Run(Attention& a, PagedKvCache& cache, int start, const std::vector<float>& x, int rows) {
    return testing::RunOneChunk(a, *cfg_, ids_, cache, kBlocks, start, x, rows, compute_);
  }

  std::vector<float> Rows(const std::vector<float>& x, int first, int n) const {
    const size_t H = cfg_->hidden_size;
    return std::vector<float>(x.begin() + first * H, x.begin() + (first + n) * H);
  }

  // What layer `layer`'s blocks hold for positions [0, end): per block its fold count and
  // accumulators, then the entry of every window whose last position is before `end`.
  std::vector<float> CompressedState(PagedKvCache& cache, int layer, int end) const {
    const int B = cache.shape().block_size;
    const Dsv4CacheLayout layout = CacheLayoutFor(*cfg_->dsv4, cfg_->dsv4->layer_types[layer], B);
    const int m = cfg_->dsv4->CompressRate(layer);
    std::vector<int32_t> table(kBlocks);
    for (int b = 0; b < kBlocks; ++b) table[b] = b;
    std::vector<float> state;
    for (int first = 0; first < end; first += B) {
      const float* area = cache.BlockArea(layer, table, first);
      state.insert(state.end(), area + layout.folded, area + layout.accumulators_end);
    }
    for (int last = m - 1; last < end; last += m) {
      const float* area = cache.BlockArea(layer, table, last);
      const int e = (last % B) / m;
      for (const Dsv4CompressorCache* c : {&layout.compressor, &layout.indexer}) {
        if (c->dim == 0) continue;
        const float* entry = area + c->entries + static_cast<size_t>(e) * c->dim;
        state.insert(state.end(), entry, entry + c->dim);
      }
    }
    return state;
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  std::vector<int32_t> ids_;
  std::vector<float> true_x_, rejected_x_;
  CpuCompute compute_{2};
};

TEST_F(Dsv4VerifyChunkTest, RejectedDraftsLeaveTheCompressedCachesAsIfNeverRun) {
  int compared = 0;
  for (int layer : {1, 2}) {
    ASSERT_NE(cfg_->dsv4->layer_types[layer], Dsv4LayerType::kSlidingWindow);
    auto loaded = LoadAttention(*cfg_, *src_, layer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    Attention& a = **loaded;
    for (int B : {8, 16}) {
      for (int prefill : {12, 13, 14, 15, 16, 17, 29, 30, 31, 32}) {
        ASSERT_LE(prefill, kMaxPrefill);
        for (int accepted = 0; accepted < kVerify; ++accepted) {
          const int kept = accepted + 1, resume = prefill + kept, end = resume + kNext;
          // The verify chunk: the kept positions' true inputs, then rejected ones.
          std::vector<float> verify = Rows(true_x_, prefill, kept);
          const std::vector<float> rejected = Rows(rejected_x_, resume, kVerify - kept);
          verify.insert(verify.end(), rejected.begin(), rejected.end());
          const std::vector<float> next = Rows(true_x_, resume, kNext);

          std::unique_ptr<PagedKvCache> spec = Cache(B);
          Run(a, *spec, 0, Rows(true_x_, 0, prefill), 1);
          const std::vector<float> verified = Run(a, *spec, prefill, verify, kVerify);
          const std::vector<float> got = Run(a, *spec, resume, next, 1);
          const std::vector<float> got_state = CompressedState(*spec, layer, end);
          const std::vector<float> again = Run(a, *spec, resume, next, 1);  // the step run again

          std::unique_ptr<PagedKvCache> plain = Cache(B);
          Run(a, *plain, 0, Rows(true_x_, 0, prefill), 1);
          const std::vector<float> kept_out = Run(a, *plain, prefill, Rows(true_x_, prefill, kept), 1);
          const std::vector<float> want = Run(a, *plain, resume, next, 1);
          const std::vector<float> want_state = CompressedState(*plain, layer, end);

          const std::string where = "layer " + std::to_string(layer) + ", blocks of " + std::to_string(B) +
                                    ", prefill " + std::to_string(prefill) + ", " + std::to_string(accepted) +
                                    " drafts accepted";
          ASSERT_EQ(got_state.size(), want_state.size());
          EXPECT_EQ(std::memcmp(got_state.data(), want_state.data(), got_state.size() * sizeof(float)), 0)
              << where << ": compressed state rel err " << testing::RelativeError(got_state, want_state);
          EXPECT_EQ(CompressedState(*spec, layer, end), want_state) << where << " (run again)";
          ASSERT_EQ(got.size(), want.size());
          EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
              << where << ": next chunk rel err " << testing::RelativeError(got, want);
          EXPECT_EQ(std::memcmp(again.data(), want.data(), again.size() * sizeof(float)), 0) << where << " (run again)";
          // The kept rows of the verify chunk saw only what plain decoding saw.
          EXPECT_LT(testing::RelativeError(Rows(verified, 0, kept), kept_out), 1e-6) << where;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 2 * 2 * 10 * kVerify);
}

// A verify step that failed after the layer ran and is run again (engine/core/engine.h retries a
// failed step's chunks): the run again skips the positions its first run folded until it finds a
// state that run kept, restores it and folds on; every state the first run kept is kept again, so
// the next chunk resumes at any accepted length, as if the step had run once.
TEST_F(Dsv4VerifyChunkTest, VerifyStepRunAgainKeepsEveryState) {
  int compared = 0;
  for (int layer : {1, 2}) {
    auto loaded = LoadAttention(*cfg_, *src_, layer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    Attention& a = **loaded;
    for (int B : {8, 16}) {
      for (int prefill : {12, 13, 14, 15, 16, 17, 29, 30, 31, 32}) {
        for (int accepted = 0; accepted < kVerify; ++accepted) {
          const int kept = accepted + 1, resume = prefill + kept, end = resume + kNext;
          std::vector<float> verify = Rows(true_x_, prefill, kept);
          const std::vector<float> rejected = Rows(rejected_x_, resume, kVerify - kept);
          verify.insert(verify.end(), rejected.begin(), rejected.end());
          const std::vector<float> next = Rows(true_x_, resume, kNext);

          std::unique_ptr<PagedKvCache> spec = Cache(B);
          Run(a, *spec, 0, Rows(true_x_, 0, prefill), 1);
          Run(a, *spec, prefill, verify, kVerify);
          Run(a, *spec, prefill, verify, kVerify);  // the step run again
          const std::vector<float> got = Run(a, *spec, resume, next, 1);

          std::unique_ptr<PagedKvCache> plain = Cache(B);
          Run(a, *plain, 0, Rows(true_x_, 0, prefill), 1);
          Run(a, *plain, prefill, Rows(true_x_, prefill, kept), 1);
          const std::vector<float> want = Run(a, *plain, resume, next, 1);

          const std::string where = "layer " + std::to_string(layer) + ", blocks of " + std::to_string(B) +
                                    ", prefill " + std::to_string(prefill) + ", " + std::to_string(accepted) +
                                    " drafts accepted";
          EXPECT_EQ(CompressedState(*spec, layer, end), CompressedState(*plain, layer, end)) << where;
          ASSERT_EQ(got.size(), want.size());
          EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << where;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 2 * 2 * 10 * kVerify);
}

// Without room for kept states (a cache allocated for plain decoding), a verify chunk is refused
// by name rather than folded past what could be taken back.
TEST_F(Dsv4VerifyChunkTest, VerifyChunkWithoutKeptStatesRefused) {
  auto loaded = LoadAttention(*cfg_, *src_, 1);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::vector<KvLayerShape> layers(cfg_->num_layers);
  for (int l = 0; l < cfg_->num_layers; ++l) layers[l] = {cfg_->KvWidth(l), cfg_->KvBlockFloats(l, 8)};
  PagedKvCache cache(std::move(layers), KvCacheShape{kBlocks, 8, 1, /*max_logit_rows_per_chunk=*/1});
  const StepBatch batch = testing::OneChunkStep(ids_, 0, 3, kBlocks, 3);
  StepTokens tokens;
  ASSERT_TRUE(FlattenStep(batch, cfg_->vocab_size, cache.shape(), cfg_->max_position_embeddings, &tokens).ok());
  AttentionCarry carry;
  const std::vector<float> x = Rows(true_x_, 0, 3);
  std::vector<float> out(x.size());
  const absl::Status st = (*loaded)->Forward(x.data(), tokens, cache, carry, out.data(), compute_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(std::string(st.message()).find("verify chunk"), std::string::npos) << st;
}

// A prompt chunk wanting every position's row (prompt logprobs) keeps nothing, in a cache with
// room for verify rows as without.
TEST_F(Dsv4VerifyChunkTest, PromptPositionRowsKeepNothing) {
  auto loaded = LoadAttention(*cfg_, *src_, 1);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::unique_ptr<PagedKvCache> cache = Cache(8);
  StepBatch batch = testing::OneChunkStep(ids_, 0, 12, kBlocks, 12);
  batch.chunks[0].logit_rows_use = LogitRowsUse::kPromptPositions;
  StepTokens tokens;
  ASSERT_TRUE(FlattenStep(batch, cfg_->vocab_size, cache->shape(), cfg_->max_position_embeddings, &tokens).ok());
  AttentionCarry carry;
  const std::vector<float> x = Rows(true_x_, 0, 12);
  std::vector<float> out(x.size());
  const absl::Status st = (*loaded)->Forward(x.data(), tokens, *cache, carry, out.data(), compute_);
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace exl3::engine

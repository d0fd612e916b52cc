// Rejected drafts and the indexed attentions of the recurrent families: GLM-5.3-Flash's k-pooled
// DSA (engine/cpu/attention/kpool_dsa_attention.h, pools of index_kpool = 4 positions) and Qwen4-Exp's QSA
// (engine/cpu/attention/qsa_attention.h, blocks of indexer_compress_ratio = 4), one layer each with its own
// indexer, on the *_experts fixtures with random inputs. After a prefill of 18 positions, a
// verify chunk of 5 (positions 18..22: its draft at 19 completes the pool / block [16, 20)) keeps
// a + 1 of them (a = 0 .. 3), the rest holding other inputs (rejected drafts); the sequence then
// runs its true next 4 positions from 18 + a + 1. Their outputs equal, bit for bit, those of a
// cache that never saw the rejected inputs (prefill, the a + 1 kept positions, the same next
// chunk): no pool or block key built from rejected positions outlives them.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
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

constexpr int kPrefill = 18, kVerify = 5, kNext = 4, kBlockSize = 4, kBlocks = 16;

class VerifyChunkIndexersTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto cfg = LoadModelConfig(GetParam());
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    auto src = TensorSource::Open(GetParam());
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    while (layer_ < cfg_->num_layers && (cfg_->IsLinearAttentionLayer(layer_) || !HasIndexer(layer_))) ++layer_;
    ASSERT_LT(layer_, cfg_->num_layers) << "no attention layer with its own indexer";
    auto a = LoadAttention(*cfg_, *src_, layer_);
    ASSERT_TRUE(a.ok()) << a.status();
    attention_ = std::move(*a);
    testing::VerifyChunkInputs in =
        testing::RandomVerifyChunkInputs(kPrefill + kVerify + kNext, cfg_->hidden_size, cfg_->vocab_size);
    ids_ = std::move(in.ids);
    true_x_ = std::move(in.true_x);
    rejected_x_ = std::move(in.rejected_x);
  }

  bool HasIndexer(int layer) const {
    return cfg_->attention == AttentionKind::kQsa || cfg_->HasOwnIndexer(layer);
  }

  std::unique_ptr<PagedKvCache> Cache() const {
    std::vector<KvLayerShape> layers(cfg_->num_layers);
    for (int l = 0; l < cfg_->num_layers; ++l) layers[l] = {cfg_->KvWidth(l), cfg_->KvBlockFloats(l, kBlockSize)};
    return std::make_unique<PagedKvCache>(std::move(layers), KvCacheShape{kBlocks, kBlockSize, 1});
  }

  // Positions [start, start + x.size() / hidden) as one chunk with inputs x; its outputs.
  std::vector<float> Run(PagedKvCache& cache, int start, const std::vector<float>& x, int rows) {
    return testing::RunOneChunk(*attention_, *cfg_, ids_, cache, kBlocks, start, x, rows, compute_);
  }

  std::vector<float> Rows(const std::vector<float>& x, int first, int n) const {
    const size_t H = cfg_->hidden_size;
    return std::vector<float>(x.begin() + first * H, x.begin() + (first + n) * H);
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  int layer_ = 0;
  std::unique_ptr<Attention> attention_;
  std::vector<int32_t> ids_;
  std::vector<float> true_x_, rejected_x_;
  CpuCompute compute_{2};
};

TEST_P(VerifyChunkIndexersTest, RejectedDraftsLeaveNoTraceInTheIndexer) {
  for (int accepted = 0; accepted + 1 < kVerify; ++accepted) {
    const int kept = accepted + 1, resume = kPrefill + kept;
    // The verify chunk: the kept positions' true inputs, then rejected ones.
    std::vector<float> verify = Rows(true_x_, kPrefill, kept);
    const std::vector<float> rejected = Rows(rejected_x_, resume, kVerify - kept);
    verify.insert(verify.end(), rejected.begin(), rejected.end());

    std::unique_ptr<PagedKvCache> spec = Cache();
    Run(*spec, 0, Rows(true_x_, 0, kPrefill), 1);
    const std::vector<float> verified = Run(*spec, kPrefill, verify, kVerify);
    const std::vector<float> got = Run(*spec, resume, Rows(true_x_, resume, kNext), 1);

    std::unique_ptr<PagedKvCache> plain = Cache();
    Run(*plain, 0, Rows(true_x_, 0, kPrefill), 1);
    const std::vector<float> kept_out = Run(*plain, kPrefill, Rows(true_x_, kPrefill, kept), 1);
    const std::vector<float> want = Run(*plain, resume, Rows(true_x_, resume, kNext), 1);

    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << GetParam() << " layer " << layer_ << ", " << accepted << " drafts accepted: rel err "
        << testing::RelativeError(got, want);
    // The kept rows of the verify chunk saw only what plain decoding saw.
    EXPECT_LT(testing::RelativeError(Rows(verified, 0, kept), kept_out), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, VerifyChunkIndexersTest,
                         ::testing::Values("tests/fixtures/engine/glm5_next_experts",
                                           "tests/fixtures/engine/qwen4_exp_experts"));

}  // namespace
}  // namespace exl3::engine

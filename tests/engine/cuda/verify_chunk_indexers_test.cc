// Rejected drafts and the GPU engine's indexed attentions of the recurrent families, as
// tests/engine/cpu/attention/verify_chunk_indexers_test.cc checks the CPU engine's: GLM-5.3-Flash's k-pooled DSA
// (engine/cuda/kpool_mixer.h, pools of index_kpool = 4 positions) and Qwen4-Exp's QSA
// (engine/cuda/qsa_mixer.h, blocks of indexer_compress_ratio = 4), one layer each with its own
// indexer, on the *_experts fixtures with random inputs, driven through the mixer kind as CudaModel
// drives it (StepFacts, PackStep, BindStep, Forward). Their kernels form each query's pool / block
// keys afresh from the cache, of the complete pools at or before its own position
// (engine/cuda/kpool_indexer_kernels.h KpoolScores, qsa_kernels.h QsaBlockScores), so nothing of a
// rejected position outlives the next chunk's writing its slot. After a prefill of 18 positions, a
// verify chunk of 5 (positions 18..22: its draft at 19 completes the pool / block [16, 20)) keeps
// a + 1 of them (a = 0 .. 3), the rest holding rejected inputs; the sequence then runs its true
// next 4 positions from 18 + a + 1. Their outputs equal, bit for bit, those of the same steps whose
// verify chunk held the true inputs throughout: the next chunk's outputs do not depend on what the
// rejected positions held. Against a cache that never held more than the kept positions (the kept
// positions run as a chunk of their own, whose linear layers may round differently with the row
// count; keys and gates cached in fp16) they agree to 1e-3. Lines "verify indexers ..." give
// every comparison. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mixer.h"
#include "engine/cuda/kpool_mixer.h"
#include "engine/cuda/qsa_mixer.h"
#include "engine/cuda/step_facts.h"
#include "engine/config/model_config.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

constexpr int kPrefill = 18, kVerify = 5, kNext = 4, kBlockSize = 16, kBlocks = 4;

class CudaVerifyChunkIndexersTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    auto cfg = LoadModelConfig(GetParam());
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    auto src = TensorSource::Open(GetParam());
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    ASSERT_EQ(cublasCreate(&cublas_), CUBLAS_STATUS_SUCCESS);
    ctx_ = CudaLinearContext{cublas_, &workspace_, nullptr};
    while (layer_ < cfg_->num_layers && (cfg_->IsLinearAttentionLayer(layer_) || !HasIndexer(layer_))) ++layer_;
    ASSERT_LT(layer_, cfg_->num_layers) << "no attention layer with its own indexer";
    const int H = cfg_->hidden_size, n = kPrefill + kVerify + kNext;
    std::mt19937 rng(31);
    std::uniform_int_distribution<int32_t> token(0, cfg_->vocab_size - 1);
    for (int i = 0; i < n; ++i) ids_.push_back(token(rng));
    true_x_ = Random(static_cast<size_t>(n) * H, rng);
    rejected_x_ = Random(true_x_.size(), rng);
  }
  void TearDown() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  bool HasIndexer(int layer) const {
    return cfg_->attention == AttentionKind::kQsa || cfg_->HasOwnIndexer(layer);
  }

  // A fresh layer of the fixture's kind with an empty cache.
  struct Layer {
    std::unique_ptr<CudaMixerKind> kind;
    std::unique_ptr<CudaMixer> mixer;
    std::unique_ptr<StepFacts> facts;
  };
  Layer Fresh() const {
    Layer l;
    l.kind = cfg_->attention == AttentionKind::kQsa ? MakeQsaKind(*cfg_, ctx_) : MakeKpoolKind(*cfg_, ctx_);
    auto mixer = l.kind->LoadLayer(*src_, layer_);
    EXPECT_TRUE(mixer.ok()) << mixer.status();
    if (mixer.ok()) l.mixer = std::move(*mixer);
    const absl::Status allocated = l.kind->AllocateCache(Shape(), nullptr);
    EXPECT_TRUE(allocated.ok()) << allocated;
    // The split layout CudaMixers::split_shape gives the model (QSA does not split).
    SplitShape split = l.kind->split_shape();
    if (split.blocks_per_token == 0) split = SplitShape{1};
    l.facts = std::make_unique<StepFacts>(*cfg_, split, /*sm_count=*/8, /*tensor_core_prefill=*/true);
    l.facts->SetCache(Shape());
    return l;
  }
  static KvCacheShape Shape() { return KvCacheShape{kBlocks, kBlockSize, 1}; }

  // Positions [start, start + rows of x) as one chunk of sequence 1 wanting `logit_rows` rows; its
  // outputs.
  std::vector<float> Run(Layer& l, int start, const std::vector<float>& x, int logit_rows) {
    const int H = cfg_->hidden_size, T = static_cast<int>(x.size()) / H;
    StepBatch batch;
    SequenceChunk c;
    c.sequence_id = 1;
    c.tokens.assign(ids_.begin() + start, ids_.begin() + start + T);
    c.start_position = start;
    for (int b = 0; b < kBlocks; ++b) c.block_table.push_back(b);
    c.wants_logits = true;
    c.num_logit_rows = logit_rows;
    batch.chunks.push_back(std::move(c));
    StepTokens tokens;
    const absl::Status flat = FlattenStep(batch, cfg_->vocab_size, Shape(), cfg_->max_position_embeddings, &tokens);
    EXPECT_TRUE(flat.ok()) << flat;
    EXPECT_TRUE(l.kind->BeginStep(batch, nullptr).ok());
    EXPECT_TRUE(l.facts->Pack(tokens, StepLayout{T, 0, 0}).ok());
    EXPECT_TRUE(l.kind->PackStep(tokens, T, &l.facts->host()).ok());
    DeviceArray<int32_t> d_facts;
    auto step = l.facts->Upload(&d_facts, nullptr);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    EXPECT_TRUE(l.kind->BindStep(**step, tokens, d_facts.get(), nullptr).ok());
    bool moved = false;
    EXPECT_TRUE(l.kind->Reserve(T, (*step)->splits, &moved).ok());
    DeviceArray<float> d_x = ToDevice(x), d_out;
    EXPECT_TRUE(d_out.Reserve(x.size()).ok());
    const absl::Status st = l.mixer->Forward(**step, d_x.get(), 0, T, d_out.get());
    EXPECT_TRUE(st.ok()) << st;
    std::vector<float> out = ToHost(d_out, x.size());
    EXPECT_TRUE(l.kind->EndStep(batch, nullptr).ok());
    return out;
  }

  std::vector<float> Rows(const std::vector<float>& x, int first, int n) const {
    const size_t H = cfg_->hidden_size;
    return std::vector<float>(x.begin() + first * H, x.begin() + (first + n) * H);
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  cublasHandle_t cublas_ = nullptr;
  exl3::cuda::Workspace workspace_;
  CudaLinearContext ctx_;
  int layer_ = 0;
  std::vector<int32_t> ids_;
  std::vector<float> true_x_, rejected_x_;
};

TEST_P(CudaVerifyChunkIndexersTest, RejectedDraftsLeaveNoTraceInTheIndexer) {
  for (int accepted = 0; accepted + 1 < kVerify; ++accepted) {
    SCOPED_TRACE(::testing::Message() << GetParam() << ", " << accepted << " drafts accepted");
    const int kept = accepted + 1, resume = kPrefill + kept;
    // The verify chunk: the kept positions' true inputs, then rejected ones.
    std::vector<float> verify = Rows(true_x_, kPrefill, kept);
    const std::vector<float> rejected = Rows(rejected_x_, resume, kVerify - kept);
    verify.insert(verify.end(), rejected.begin(), rejected.end());

    Layer spec = Fresh();
    Run(spec, 0, Rows(true_x_, 0, kPrefill), 1);
    const std::vector<float> verified = Run(spec, kPrefill, verify, kVerify);
    const std::vector<float> got = Run(spec, resume, Rows(true_x_, resume, kNext), 1);

    // The same steps with the true inputs at the rejected positions.
    Layer truth = Fresh();
    Run(truth, 0, Rows(true_x_, 0, kPrefill), 1);
    Run(truth, kPrefill, Rows(true_x_, kPrefill, kVerify), kVerify);
    const std::vector<float> want = Run(truth, resume, Rows(true_x_, resume, kNext), 1);

    // A cache that never held more than the kept positions.
    Layer plain = Fresh();
    Run(plain, 0, Rows(true_x_, 0, kPrefill), 1);
    const std::vector<float> kept_out = Run(plain, kPrefill, Rows(true_x_, kPrefill, kept), 1);
    const std::vector<float> plain_next = Run(plain, resume, Rows(true_x_, resume, kNext), 1);

    ASSERT_EQ(got.size(), want.size());
    const bool equal = std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
    const double plain_rel = RelativeError(got, plain_next);
    const double kept_rel = RelativeError(Rows(verified, 0, kept), kept_out);
    std::printf("verify indexers %s layer %d, %d accepted: next chunk %s the true verify chunk's (rel %.2e); against "
                "a cache of the kept positions only rel %.2e; the verify chunk's kept rows rel %.2e\n",
                GetParam(), layer_, accepted, equal ? "bit-equal to" : "DIFFERS from", RelativeError(got, want),
                plain_rel, kept_rel);
    EXPECT_TRUE(equal) << "the next chunk's outputs depend on the rejected positions' inputs";
    EXPECT_LT(plain_rel, 1e-3);
    EXPECT_LT(kept_rel, 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaVerifyChunkIndexersTest,
                         ::testing::Values("tests/fixtures/engine/glm5_next_experts",
                                           "tests/fixtures/engine/qwen4_exp_experts"));

}  // namespace
}  // namespace exl3::engine::cuda

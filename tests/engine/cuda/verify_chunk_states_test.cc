// The states a verify chunk keeps on the GPU engine (engine/cuda/device_sequence_states.h; the
// kept rows of engine/cuda/recurrent_chunks.h written by the DeltaNet, KDA and PLE kernels), in
// each recurrent block: Qwen3-Next's gated DeltaNet (engine/cuda/cuda_gated_deltanet.h, fused
// projections), Qwen4-Exp's (separate projections) and its PLE layer (engine/cuda/cuda_ple_layer.h),
// GLM-5.3-Flash's KDA (engine/cuda/cuda_kimi_delta_attention.h), on the *_experts fixtures' layers
// with random inputs, driven over the device store as the model drives it (BeginStep, the chunk
// table packed and bound, Forward, CommitStep). As tests/engine/cpu/linear_attention/verify_chunk_states_test.cc on the
// CPU: after a prefill of 7 tokens, a verify chunk of d + 1 = 5 tokens (the last token and 4
// drafts) with a of them accepted (a = 0 .. 4) leaves, for the next chunk starting at 7 + a + 1,
// exactly the state that running only those a + 1 tokens leaves: equal bit for bit, the whole
// layer's state, and the verify chunk's rows for them equal too. The reference runs those a + 1
// tokens as a chunk of their own in a step of the same 5 input rows (the other 4 - a rows another
// sequence's), because the GPU's linear layers may round a row differently with the step's row
// count (docs/engine.md "On the GPU"); against plain decoding, one token a step, the states agree
// to 1e-4. Continuing from the rolled-back state gives the reference's output and state bit for
// bit; a chunk resuming at a length the slot does not hold is refused. Lines "verify states ..."
// give every comparison. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cuda/cuda_gated_deltanet.h"
#include "engine/cuda/cuda_kimi_delta_attention.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_ple_layer.h"
#include "engine/cuda/device_sequence_states.h"
#include "engine/cuda/recurrent_layer_states.h"
#include "engine/config/model_config.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

constexpr int kPrefill = 7, kVerify = 5, kSlots = 2, kBlocksPerSequence = 8, kBlockSize = 16;

struct Fixture {
  std::string dir;
  std::string block;  // "deltanet", "kda" or "ple"
};
void PrintTo(const Fixture& f, std::ostream* os) { *os << f.dir << " " << f.block; }

// A batch of one chunk per (sequence, slot, start, tokens); sequence s on blocks of its own.
struct ChunkSpec {
  int64_t sequence_id;
  int slot, start, count;
  int logit_rows = 1;
};

class CudaVerifyChunkStatesTest : public ::testing::TestWithParam<Fixture> {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    auto cfg = LoadModelConfig(GetParam().dir);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    auto src = TensorSource::Open(GetParam().dir);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    ASSERT_EQ(cublasCreate(&cublas_), CUBLAS_STATUS_SUCCESS);
    ctx_ = CudaLinearContext{cublas_, &workspace_, nullptr};
    const std::string& kind = GetParam().block;
    if (kind == "ple") {
      layer_ = cfg_->qwen4exp->ple.layers.at(0);
      auto ple = CudaPleLayer::Load(*cfg_, *src_, layer_);
      ASSERT_TRUE(ple.ok()) << ple.status();
      ple_ = std::move(*ple);
      width_ = cfg_->qwen4exp->hc_count * cfg_->hidden_size;
      embed_width_ = ple_->embed_dim();
    } else {
      while (!cfg_->IsLinearAttentionLayer(layer_)) ++layer_;
      const int64_t offset = RecurrentLayerStates::StateOffset(*cfg_, layer_);
      if (kind == "kda") {
        auto k = CudaKimiDeltaAttention::Load(*cfg_, *src_, layer_, offset);
        ASSERT_TRUE(k.ok()) << k.status();
        kda_ = std::move(*k);
      } else {
        auto g = CudaGatedDeltaNet::Load(*cfg_, *src_, layer_, offset);
        ASSERT_TRUE(g.ok()) << g.status();
        deltanet_ = std::move(*g);
      }
      width_ = cfg_->hidden_size;
    }
    std::mt19937 rng(31);
    std::uniform_int_distribution<int32_t> token(0, cfg_->vocab_size - 1);
    for (int i = 0; i < kPrefill + kVerify + 2; ++i) ids_.push_back(token(rng));  // up to the token after the next
    x_ = Random(ids_.size() * width_, rng);
    e_ = Random(ids_.size() * embed_width_, rng, 0.5f);
  }
  void TearDown() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  std::unique_ptr<RecurrentLayerStates> Store(int max_kept_states) const {
    auto s = std::make_unique<RecurrentLayerStates>();
    const absl::Status st = s->Allocate(*cfg_, kSlots, max_kept_states);
    EXPECT_TRUE(st.ok()) << st;
    return s;
  }

  StepBatch Batch(const std::vector<ChunkSpec>& specs) const {
    StepBatch batch;
    for (const ChunkSpec& s : specs) {
      SequenceChunk c;
      c.sequence_id = s.sequence_id;
      c.state_slot = s.slot;
      c.start_position = s.start;
      for (int i = 0; i < s.count; ++i) c.tokens.push_back(ids_[(s.start + i) % ids_.size()]);
      for (int b = 0; b < kBlocksPerSequence; ++b) c.block_table.push_back(s.slot * kBlocksPerSequence + b);
      c.wants_logits = true;
      c.num_logit_rows = s.logit_rows;
      batch.chunks.push_back(std::move(c));
    }
    return batch;
  }

  // The layer's state in `row` of the store.
  std::vector<float> StateInRow(const RecurrentLayerStates& states, int32_t row) const {
    const DeviceSequenceStates& store = *states.store();
    return ToHost(store.layer(layer_) + static_cast<size_t>(row) * store.row_floats(),
                  static_cast<size_t>(cfg_->StateFloats(layer_)));
  }

  struct Ran {
    std::vector<float> out;         // [rows, width]
    std::vector<float> state_read;  // the layer's state the first chunk read
  };
  // One step: `batch` over input rows x_[x_first ..] (and e_ for the PLE), committed.
  Ran Run(RecurrentLayerStates& states, const StepBatch& batch, int x_first) {
    Ran ran;
    StepTokens tokens;
    const absl::Status flat = FlattenStep(batch, cfg_->vocab_size,
                                          KvCacheShape{kSlots * kBlocksPerSequence, kBlockSize, kSlots},
                                          cfg_->max_position_embeddings, &tokens);
    EXPECT_TRUE(flat.ok()) << flat;
    if (!flat.ok()) return ran;
    const int T = tokens.num_tokens;
    const absl::Status begun = states.BeginStep(batch, nullptr);
    EXPECT_TRUE(begun.ok()) << begun;
    if (!begun.ok()) return ran;
    ran.state_read = StateInRow(states, states.store()->ReadRow(batch.chunks[0].state_slot));
    std::vector<int32_t> facts;
    EXPECT_TRUE(states.Pack(tokens, T, &facts).ok());
    DeviceArray<int32_t> d_facts = ToDevice(facts);
    states.Bind(T, d_facts.get());
    const RecurrentStep step = states.StepFor(0, T);
    const std::vector<float> x(x_.begin() + static_cast<size_t>(x_first) * width_,
                               x_.begin() + static_cast<size_t>(x_first + T) * width_);
    DeviceArray<float> d_x = ToDevice(x), d_out;
    EXPECT_TRUE(d_out.Reserve(x.size()).ok());
    bool moved = false;
    absl::Status st;
    if (ple_ != nullptr) {
      const std::vector<float> e(e_.begin() + static_cast<size_t>(x_first) * embed_width_,
                                 e_.begin() + static_cast<size_t>(x_first + T) * embed_width_);
      DeviceArray<float> d_e = ToDevice(e);
      EXPECT_TRUE(ple_ws_.Reserve(ple_->shape(), T, &moved).ok());
      st = ple_->Forward(d_x.get(), d_e.get(), 0, T, step, ple_ws_, ctx_);  // the streams in place
      ran.out = ToHost(d_x, x.size());
    } else if (kda_ != nullptr) {
      EXPECT_TRUE(kda_ws_.Reserve(cfg_->linear_attention, T, &moved).ok());
      st = kda_->Forward(d_x.get(), 0, T, step, kda_ws_, ctx_, d_out.get());
      ran.out = ToHost(d_out, x.size());
    } else {
      EXPECT_TRUE(deltanet_ws_.Reserve(cfg_->linear_attention, T, &moved).ok());
      st = deltanet_->Forward(d_x.get(), 0, T, step, deltanet_ws_, ctx_, d_out.get());
      ran.out = ToHost(d_out, x.size());
    }
    EXPECT_TRUE(st.ok()) << st;
    states.CommitStep(batch);
    return ran;
  }

  std::vector<float> Rows(const std::vector<float>& v, int first, int n) const {
    return std::vector<float>(v.begin() + static_cast<size_t>(first) * width_,
                              v.begin() + static_cast<size_t>(first + n) * width_);
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  cublasHandle_t cublas_ = nullptr;
  exl3::cuda::Workspace workspace_;
  CudaLinearContext ctx_;
  int layer_ = 0, width_ = 0, embed_width_ = 0;
  std::unique_ptr<CudaGatedDeltaNet> deltanet_;
  std::unique_ptr<CudaKimiDeltaAttention> kda_;
  std::unique_ptr<CudaPleLayer> ple_;
  DeltaNetWorkspace deltanet_ws_;
  KdaWorkspace kda_ws_;
  PleWorkspace ple_ws_;
  std::vector<int32_t> ids_;
  std::vector<float> x_, e_;  // per token of the sequence: the block's input, the PLE's n-gram rows
};

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_P(CudaVerifyChunkStatesTest, AcceptedPrefixStateEqualsTheShorterChunksBitForBit) {
  const char* block = GetParam().block.c_str();
  for (int accepted = 0; accepted < kVerify; ++accepted) {
    SCOPED_TRACE(::testing::Message() << block << ", " << accepted << " drafts accepted");
    const int kept = accepted + 1, length = kPrefill + kept;
    // Speculative: the prefill, the verify chunk of 5 rows keeping 5 states, then the next token
    // from the length the scheduler kept.
    std::unique_ptr<RecurrentLayerStates> spec = Store(kVerify);
    ASSERT_EQ(spec->store()->num_copies(), kVerify + 1);
    Run(*spec, Batch({{1, 0, 0, kPrefill}}), 0);
    const Ran verified = Run(*spec, Batch({{1, 0, kPrefill, kVerify, kVerify}}), kPrefill);
    const Ran spec_next = Run(*spec, Batch({{1, 0, length, 1}}), length);
    const Ran spec_after = Run(*spec, Batch({{1, 0, length + 1, 1}}), length + 1);

    // The reference: a store without speculation (two copies a slot); the kept tokens as a chunk of
    // their own beside another sequence's chunk on the verify chunk's other input rows.
    std::unique_ptr<RecurrentLayerStates> ref = Store(1);
    ASSERT_EQ(ref->store()->num_copies(), 2);
    Run(*ref, Batch({{1, 0, 0, kPrefill}}), 0);
    std::vector<ChunkSpec> step = {{1, 0, kPrefill, kept}};
    if (kept < kVerify) step.push_back({2, 1, 0, kVerify - kept});
    const Ran kept_run = Run(*ref, Batch(step), kPrefill);
    const Ran ref_next = Run(*ref, Batch({{1, 0, length, 1}}), length);
    const Ran ref_after = Run(*ref, Batch({{1, 0, length + 1, 1}}), length + 1);

    bool any_nonzero = false;
    for (float v : ref_next.state_read) any_nonzero |= v != 0.0f;
    ASSERT_TRUE(any_nonzero) << "the block keeps no state in layer " << layer_;
    const bool state_equal = BitEqual(spec_next.state_read, ref_next.state_read);
    const bool rows_equal = BitEqual(Rows(verified.out, 0, kept), Rows(kept_run.out, 0, kept));
    const bool next_equal =
        BitEqual(spec_next.out, ref_next.out) && BitEqual(spec_after.state_read, ref_after.state_read);
    std::printf("verify states %s layer %d, %d accepted: kept state %s (rel %.2e), verify rows %s, next token %s\n",
                block, layer_, accepted, state_equal ? "bit-equal" : "DIFFERS",
                RelativeError(spec_next.state_read, ref_next.state_read), rows_equal ? "bit-equal" : "DIFFER",
                next_equal ? "bit-equal" : "DIFFERS");
    EXPECT_TRUE(state_equal) << "the state after a verify chunk with " << accepted
                             << " drafts accepted differs from the one its kept tokens leave";
    EXPECT_TRUE(rows_equal) << "the verify chunk's kept rows differ from the kept tokens' own chunk's";
    EXPECT_TRUE(next_equal) << "the chunk after the rollback differs from the reference's";

    // Plain decoding, one token a step (its linear layers over one row): the same up to rounding.
    std::unique_ptr<RecurrentLayerStates> plain = Store(1);
    Run(*plain, Batch({{1, 0, 0, kPrefill}}), 0);
    for (int j = 0; j < kept; ++j) Run(*plain, Batch({{1, 0, kPrefill + j, 1}}), kPrefill + j);
    const Ran plain_next = Run(*plain, Batch({{1, 0, length, 1}}), length);
    const double decode_rel = RelativeError(spec_next.state_read, plain_next.state_read);
    std::printf("verify states %s layer %d, %d accepted: kept state against plain decoding's rel %.2e\n", block,
                layer_, accepted, decode_rel);
    EXPECT_LT(decode_rel, 1e-4);
  }
}

TEST_P(CudaVerifyChunkStatesTest, AChunkResumingAtALengthTheSlotDoesNotHoldIsRefused) {
  std::unique_ptr<RecurrentLayerStates> spec = Store(kVerify);
  Run(*spec, Batch({{1, 0, 0, kPrefill}}), 0);
  Run(*spec, Batch({{1, 0, kPrefill, kVerify, kVerify}}), kPrefill);  // lengths 8 .. 12 held
  for (int length : {kPrefill, kPrefill + kVerify + 1}) {
    const absl::Status st = spec->BeginStep(Batch({{1, 0, length, 1}}), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << length << ": " << st;
  }
  // A chunk keeping more states than the store was made for.
  std::unique_ptr<RecurrentLayerStates> plain = Store(1);
  const absl::Status st = plain->BeginStep(Batch({{1, 0, 0, kVerify, kVerify}}), nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("max_logit_rows_per_chunk"), std::string::npos) << st;
}

INSTANTIATE_TEST_SUITE_P(Blocks, CudaVerifyChunkStatesTest,
                         ::testing::Values(Fixture{"tests/fixtures/engine/qwen3_next_experts", "deltanet"},
                                           Fixture{"tests/fixtures/engine/qwen4_exp_experts", "deltanet"},
                                           Fixture{"tests/fixtures/engine/qwen4_exp_experts", "ple"},
                                           Fixture{"tests/fixtures/engine/glm5_next_experts", "kda"}),
                         [](const ::testing::TestParamInfo<Fixture>& info) {
                           return info.param.dir.substr(info.param.dir.rfind('/') + 1) + "_" + info.param.block;
                         });

}  // namespace
}  // namespace exl3::engine::cuda

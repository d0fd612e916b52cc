// Rejected drafts and DeepSeek-V4's compressed caches on the GPU engine (engine/cuda/dsv4_attention.h
// with the kept accumulators of engine/cuda/dsv4_kept_row_slots.h, driven as Dsv4Mixer drives them:
// plan, fold, commit after a step that succeeded), one compressed layer at a time (layer 1: CSA
// with its indexer, windows of 4; layer 2: HCA, windows of 16) of tests/fixtures/engine/deepseek_v4_experts
// (dense fp32 weights), with random inputs. As tests/engine/cpu/attention/dsv4_verify_chunk_test.cc on the CPU:
// after a prefill of P positions, a verify chunk of d + 1 = 5 (positions P .. P + 4) keeps a + 1 of
// them (a = 0 .. 4), the rest holding other inputs (rejected drafts); the sequence then runs its
// true next 4 positions from P + a + 1. The prefill lengths put the verify chunk and the resume
// point at every offset within a CSA window, across an HCA window's end and across cache blocks
// (of 8 and of 16). The block areas (fold counts, both compressors' accumulators, the entries of
// every window closed by then) and the next chunk's outputs equal, bit for bit, those of a cache
// that never saw the rejected inputs. That reference runs the a + 1 kept positions as a chunk of
// their own in a step of the same 5 input rows (the other 4 - a another sequence's, in blocks of
// its own), because the GPU's linear layers may round a row differently with the step's row count
// (docs/engine.md "On the GPU"). For odd a, the verify step and the next step each fail once
// after the layer ran (not committed) and run again, as the engine retries a failed step; the
// next chunk run again after it succeeded changes nothing. Two verify chunks in a row, the second
// failing once, likewise. Lines "dsv4 verify ..." sum them up. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/config/dsv4_config.h"
#include "engine/config/model_config.h"
#include "engine/config/read_model_config.h"
#include "engine/core/step_tokens.h"
#include "engine/cpu/attention/attention.h"  // FirstVisiblePosition
#include "engine/cuda/dsv4_attention.h"
#include "engine/cuda/dsv4_kept_row_slots.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

constexpr char kFixture[] = "tests/fixtures/engine/deepseek_v4_experts";
constexpr int kVerify = 5, kNext = 4, kBlocks = 12, kMaxPrefill = 40, kSlots = 2;

// One chunk of a step: sequence 0 (the one verified, slot 0, blocks 0 .. kBlocks - 1) or 1 (the
// reference's other rows, slot 1, blocks kBlocks .. 2 kBlocks - 1).
struct ChunkSpec {
  int sequence, start, count;
  int logit_rows = 1;
};

// One layer's cache on the device with its kept states, as Dsv4Mixer holds them.
struct LayerCache {
  DeviceArray<float> blocks;  // 2 kBlocks blocks
  DeviceArray<float> kept;    // the layer's kept accumulators: slots.rows() rows
  Dsv4KeptRowSlots slots;
  Dsv4CacheView view;
};

class CudaDsv4VerifyChunkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cfg = LoadModelConfig(kFixture);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    ASSERT_EQ(cfg_->attention, AttentionKind::kDsv4);
    auto src = TensorSource::Open(kFixture);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    const int H = cfg_->hidden_size, n = kMaxPrefill + kVerify + kNext;
    std::mt19937 rng(31);
    true_x_ = Random(static_cast<size_t>(n) * H, rng);
    rejected_x_ = Random(true_x_.size(), rng);
    other_x_ = Random(static_cast<size_t>(kVerify) * H, rng);
  }

  void TearDown() override {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }

  // A zeroed cache of layer `layer` at blocks of `B`, keeping up to kVerify - 1 states per chunk.
  std::unique_ptr<LayerCache> Cache(int layer, int B) const {
    auto c = std::make_unique<LayerCache>();
    const int stride = B * cfg_->KvWidth(layer) + cfg_->KvBlockFloats(layer, B);
    c->blocks = ToDevice(std::vector<float>(static_cast<size_t>(2 * kBlocks) * stride, 0.0f));
    EXPECT_TRUE(c->slots.Allocate(kSlots, kVerify - 1).ok());
    const Dsv4CacheLayout layout = CacheLayoutFor(*cfg_->dsv4, cfg_->dsv4->layer_types[layer], B);
    c->kept = ToDevice(std::vector<float>(
        static_cast<size_t>(c->slots.rows()) * (layout.accumulators_end - (layout.folded + 1)), 0.0f));
    c->view = Dsv4CacheView{c->blocks.get(), B, cfg_->KvWidth(layer), stride};
    c->view.kept = c->kept.get();
    return c;
  }

  // One step of `chunks` with inputs x [T, hidden] through the layer: its outputs. `succeeded`
  // false: the step fails after the layer ran (nothing committed, as CudaModel leaves it).
  std::vector<float> Step(const CudaDsv4Attention& a, LayerCache& cache, const std::vector<ChunkSpec>& chunks,
                          const std::vector<float>& x, bool succeeded) {
    const int H = cfg_->hidden_size, B = cache.view.block_size;
    StepBatch batch;
    for (const ChunkSpec& s : chunks) {
      SequenceChunk c;
      c.sequence_id = s.sequence;
      c.state_slot = s.sequence;
      c.tokens.assign(s.count, 3);
      c.start_position = s.start;
      for (int b = 0; b < kBlocks; ++b) c.block_table.push_back(s.sequence * kBlocks + b);
      c.wants_logits = true;
      c.num_logit_rows = s.logit_rows;
      batch.chunks.push_back(std::move(c));
    }
    const KvCacheShape shape{2 * kBlocks, B, kSlots, kVerify};
    StepTokens tokens;
    const absl::Status flat = FlattenStep(batch, cfg_->vocab_size, shape, cfg_->max_position_embeddings, &tokens);
    EXPECT_TRUE(flat.ok()) << flat;
    const int T = tokens.num_tokens;
    EXPECT_EQ(static_cast<size_t>(T) * H, x.size());
    // The step's device facts as CudaModel packs them (positions, windows, block tables).
    std::vector<int32_t> position(T), first(T), offset(T), packed;
    for (int t = 0; t < T; ++t) {
      position[t] = tokens.positions[t];
      first[t] = FirstVisiblePosition(position[t], cfg_->sliding_window);
      offset[t] = tokens.chunk_of[t] * kBlocks;
    }
    for (const SequenceChunk& c : batch.chunks) packed.insert(packed.end(), c.block_table.begin(), c.block_table.end());
    DeviceArray<int32_t> d_pos = ToDevice(position), d_first = ToDevice(first), d_offset = ToDevice(offset),
                         d_tables = ToDevice(packed);
    EXPECT_TRUE(ws_.Reserve(*cfg_, T, 2 * kBlocks * B).ok());
    Dsv4Step step;
    EXPECT_TRUE(facts_
                    ->Prepare(tokens, AttentionTokens{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), B},
                              sm_count_, nullptr, &step)
                    .ok());
    std::vector<int32_t> keeping;
    const absl::Status planned = cache.slots.PlanStep(tokens, B, &keeping);
    EXPECT_TRUE(planned.ok()) << planned;
    DeviceArray<int32_t> d_keeping;
    if (cache.slots.enabled()) {
      EXPECT_EQ(keeping.size(), batch.chunks.size() * kDsv4KeepingInts);
      d_keeping = ToDevice(keeping);
      step.chunk_keeping = d_keeping.get();
    } else {
      EXPECT_TRUE(keeping.empty()) << "nothing planned without speculation";
    }
    DeviceArray<float> d_x = ToDevice(x), d_out;
    EXPECT_TRUE(d_out.Reserve(x.size()).ok());
    const CudaLinearContext ctx{handle_, &workspace_, nullptr};
    const absl::Status ran = a.Forward(d_x.get(), T, step, cache.view, ws_, ctx, d_out.get());
    EXPECT_TRUE(ran.ok()) << ran;
    std::vector<float> out = ToHost(d_out, x.size());
    const absl::Status fold = facts_->TakeError(nullptr);
    EXPECT_TRUE(fold.ok()) << fold;
    if (succeeded) cache.slots.CommitStep();
    return out;
  }

  std::vector<float> Rows(const std::vector<float>& x, int first, int n) const {
    const size_t H = cfg_->hidden_size;
    return std::vector<float>(x.begin() + first * H, x.begin() + (first + n) * H);
  }

  // What layer `layer`'s blocks of sequence 0 hold for positions [0, end): per block its fold
  // count and accumulators, then the entry of every window whose last position is before `end`.
  std::vector<float> CompressedState(const LayerCache& cache, int layer, int end) const {
    const Dsv4CacheView& v = cache.view;
    const int B = v.block_size, m = cfg_->dsv4->CompressRate(layer);
    const Dsv4CacheLayout layout = CacheLayoutFor(*cfg_->dsv4, cfg_->dsv4->layer_types[layer], B);
    const std::vector<float> all = ToHost(cache.blocks, static_cast<size_t>(2 * kBlocks) * v.block_stride);
    auto area = [&](int position) {
      return all.data() + static_cast<size_t>(position / B) * v.block_stride + static_cast<size_t>(B) * v.token_floats;
    };
    std::vector<float> state;
    for (int first = 0; first < end; first += B)
      state.insert(state.end(), area(first) + layout.folded, area(first) + layout.accumulators_end);
    for (int last = m - 1; last < end; last += m) {
      const int e = (last % B) / m;
      for (const Dsv4CompressorCache* c : {&layout.compressor, &layout.indexer}) {
        if (c->dim == 0) continue;
        const float* entry = area(last) + c->entries + static_cast<size_t>(e) * c->dim;
        state.insert(state.end(), entry, entry + c->dim);
      }
    }
    return state;
  }

  void StartDevice() {
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    facts_ = std::make_unique<Dsv4StepFacts>(*cfg_);
    ASSERT_TRUE(facts_->Init().ok());
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  std::vector<float> true_x_, rejected_x_, other_x_;
  cublasHandle_t handle_ = nullptr;
  exl3::cuda::Workspace workspace_;
  int sm_count_ = 1;
  std::unique_ptr<Dsv4StepFacts> facts_;
  Dsv4Workspace ws_;
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(CudaDsv4VerifyChunkTest, RejectedDraftsLeaveTheCompressedCachesAsIfNeverRun) {
  REQUIRE_GPU();
  StartDevice();
  int compared = 0;
  for (int layer : {1, 2}) {
    ASSERT_NE(cfg_->dsv4->layer_types[layer], Dsv4LayerType::kSlidingWindow);
    auto loaded = CudaDsv4Attention::Load(*cfg_, *src_, layer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const CudaDsv4Attention& a = **loaded;
    double worst_rows = 0;
    int layer_cases = 0, layer_equal = 0;
    for (int B : {8, 16}) {
      for (int prefill : {12, 13, 14, 15, 16, 17, 29, 30, 31, 32}) {
        ASSERT_LE(prefill, kMaxPrefill);
        for (int accepted = 0; accepted < kVerify; ++accepted) {
          const int kept = accepted + 1, resume = prefill + kept, end = resume + kNext;
          const bool fail_once = accepted % 2 == 1;
          // The verify chunk: the kept positions' true inputs, then rejected ones.
          std::vector<float> verify = Rows(true_x_, prefill, kept);
          const std::vector<float> rejected = Rows(rejected_x_, resume, kVerify - kept);
          verify.insert(verify.end(), rejected.begin(), rejected.end());
          const std::vector<float> next = Rows(true_x_, resume, kNext);
          const std::vector<ChunkSpec> verify_step = {{0, prefill, kVerify, kVerify}}, next_step = {{0, resume, kNext}};

          std::unique_ptr<LayerCache> spec = Cache(layer, B);
          Step(a, *spec, {{0, 0, prefill}}, Rows(true_x_, 0, prefill), true);
          if (fail_once) Step(a, *spec, verify_step, verify, /*succeeded=*/false);
          const std::vector<float> verified = Step(a, *spec, verify_step, verify, true);
          if (fail_once) Step(a, *spec, next_step, next, /*succeeded=*/false);
          const std::vector<float> got = Step(a, *spec, next_step, next, true);
          const std::vector<float> got_state = CompressedState(*spec, layer, end);
          const std::vector<float> again = Step(a, *spec, next_step, next, true);  // run again after success

          // The reference: the kept positions as a chunk of their own in a step of 5 rows.
          std::unique_ptr<LayerCache> plain = Cache(layer, B);
          Step(a, *plain, {{0, 0, prefill}}, Rows(true_x_, 0, prefill), true);
          std::vector<ChunkSpec> kept_step = {{0, prefill, kept}};
          std::vector<float> kept_x = Rows(true_x_, prefill, kept);
          if (kept < kVerify) {
            kept_step.push_back({1, 0, kVerify - kept});
            const std::vector<float> other = Rows(other_x_, 0, kVerify - kept);
            kept_x.insert(kept_x.end(), other.begin(), other.end());
          }
          const std::vector<float> kept_out = Step(a, *plain, kept_step, kept_x, true);
          const std::vector<float> want = Step(a, *plain, next_step, next, true);
          const std::vector<float> want_state = CompressedState(*plain, layer, end);

          const std::string where = "layer " + std::to_string(layer) + ", blocks of " + std::to_string(B) +
                                    ", prefill " + std::to_string(prefill) + ", " + std::to_string(accepted) +
                                    " drafts accepted" + (fail_once ? " (steps failed once)" : "");
          ASSERT_EQ(got_state.size(), want_state.size());
          const bool equal = SameBits(got_state, want_state) && SameBits(got, want);
          EXPECT_TRUE(SameBits(got_state, want_state))
              << where << ": compressed state rel err " << RelativeError(got_state, want_state);
          EXPECT_TRUE(SameBits(CompressedState(*spec, layer, end), want_state)) << where << " (run again)";
          EXPECT_TRUE(SameBits(got, want)) << where << ": next chunk rel err " << RelativeError(got, want);
          EXPECT_TRUE(SameBits(again, want)) << where << " (run again)";
          // The kept rows of the verify chunk saw only what the reference saw.
          const double rows_rel = RelativeError(Rows(verified, 0, kept), Rows(kept_out, 0, kept));
          worst_rows = std::max(worst_rows, rows_rel);
          EXPECT_LT(rows_rel, 1e-6) << where;
          layer_equal += equal ? 1 : 0;
          ++layer_cases;
          ++compared;
        }
      }
    }
    std::printf("dsv4 verify layer %d (%s): %d of %d cases bit for bit (compressed state and next chunk), verify "
                "rows rel %.2e (worst)\n",
                layer, cfg_->dsv4->layer_types[layer] == Dsv4LayerType::kCompressedSparse ? "CSA" : "HCA",
                layer_equal, layer_cases, worst_rows);
  }
  EXPECT_EQ(compared, 2 * 2 * 10 * kVerify);
}

// Two verify chunks in a row (a1, then a2 drafts accepted), the second failing once after the
// layer ran and run again: it restored from a kept row and wrote the slot's other rows, so its run
// again restores from the same intact row. The next chunk's outputs and the compressed state equal,
// bit for bit, those of a reference that ran only the kept positions (each verify step's kept
// positions as a chunk of their own in a step of the same 5 rows).
TEST_F(CudaDsv4VerifyChunkTest, ConsecutiveVerifyChunksWithAFailedStep) {
  REQUIRE_GPU();
  StartDevice();
  int compared = 0, equal = 0;
  for (int layer : {1, 2}) {
    auto loaded = CudaDsv4Attention::Load(*cfg_, *src_, layer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const CudaDsv4Attention& a = **loaded;
    for (int B : {8, 16}) {
      for (int prefill : {13, 15, 30}) {
        for (int a1 = 0; a1 < kVerify; ++a1) {
          for (int a2 = 0; a2 < kVerify; ++a2) {
            const int r1 = prefill + a1 + 1, r2 = r1 + a2 + 1, end = r2 + kNext;
            ASSERT_LE(end, kMaxPrefill + kVerify + kNext);
            // Drafts: true inputs where accepted, rejected ones after (other rows per verify step).
            std::vector<float> v1 = Rows(true_x_, prefill, a1 + 1), v2 = Rows(true_x_, r1, a2 + 1);
            const std::vector<float> j1 = Rows(rejected_x_, r1, kVerify - a1 - 1);
            const std::vector<float> j2 = Rows(other_x_, 0, kVerify - a2 - 1);
            v1.insert(v1.end(), j1.begin(), j1.end());
            v2.insert(v2.end(), j2.begin(), j2.end());
            const std::vector<float> next = Rows(true_x_, r2, kNext);

            std::unique_ptr<LayerCache> spec = Cache(layer, B);
            Step(a, *spec, {{0, 0, prefill}}, Rows(true_x_, 0, prefill), true);
            Step(a, *spec, {{0, prefill, kVerify, kVerify}}, v1, true);
            Step(a, *spec, {{0, r1, kVerify, kVerify}}, v2, /*succeeded=*/false);
            Step(a, *spec, {{0, r1, kVerify, kVerify}}, v2, true);
            const std::vector<float> got = Step(a, *spec, {{0, r2, kNext}}, next, true);

            std::unique_ptr<LayerCache> plain = Cache(layer, B);
            Step(a, *plain, {{0, 0, prefill}}, Rows(true_x_, 0, prefill), true);
            const std::pair<int, int> kept_runs[] = {{prefill, a1 + 1}, {r1, a2 + 1}};  // start, kept
            for (const auto& [start, kept] : kept_runs) {
              std::vector<ChunkSpec> chunks = {{0, start, kept}};
              std::vector<float> x = Rows(true_x_, start, kept);
              if (kept < kVerify) {
                chunks.push_back({1, 0, kVerify - kept});
                const std::vector<float> other = Rows(other_x_, 0, kVerify - kept);
                x.insert(x.end(), other.begin(), other.end());
              }
              Step(a, *plain, chunks, x, true);
            }
            const std::vector<float> want = Step(a, *plain, {{0, r2, kNext}}, next, true);

            const std::string where = "layer " + std::to_string(layer) + ", blocks of " + std::to_string(B) +
                                      ", prefill " + std::to_string(prefill) + ", " + std::to_string(a1) + " then " +
                                      std::to_string(a2) + " drafts accepted";
            const std::vector<float> got_state = CompressedState(*spec, layer, end),
                                     want_state = CompressedState(*plain, layer, end);
            EXPECT_TRUE(SameBits(got_state, want_state))
                << where << ": compressed state rel err " << RelativeError(got_state, want_state);
            EXPECT_TRUE(SameBits(got, want)) << where << ": next chunk rel err " << RelativeError(got, want);
            equal += SameBits(got_state, want_state) && SameBits(got, want) ? 1 : 0;
            ++compared;
          }
        }
      }
    }
  }
  std::printf("dsv4 verify consecutive chunks, the second failing once: %d of %d cases bit for bit\n", equal,
              compared);
  EXPECT_EQ(compared, 2 * 2 * 3 * kVerify * kVerify);
}

// Without kept rows (a cache allocated for plain decoding) the layer folds exactly as before: a
// plain step's keeping restores and keeps nothing, and the outputs and cache equal those of a run
// without any keeping facts.
TEST_F(CudaDsv4VerifyChunkTest, PlainStepsUnchangedByKeeping) {
  REQUIRE_GPU();
  StartDevice();
  auto loaded = CudaDsv4Attention::Load(*cfg_, *src_, 1);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::unique_ptr<LayerCache> with = Cache(1, 8), without = Cache(1, 8);
  without->view.kept = nullptr;
  ASSERT_TRUE(without->slots.Allocate(kSlots, 0).ok());
  const std::vector<std::pair<int, int>> steps = {{0, 13}, {13, 1}, {14, 1}, {15, 6}};
  for (const auto& [start, n] : steps) {
    const std::vector<float> x = Rows(true_x_, start, n);
    const std::vector<float> a = Step(**loaded, *with, {{0, start, n}}, x, true);
    // No kept rows and no keeping facts (the step's chunk_keeping null), as without speculation.
    const std::vector<float> b = Step(**loaded, *without, {{0, start, n}}, x, true);
    EXPECT_TRUE(SameBits(a, b)) << "step at " << start;
  }
  EXPECT_TRUE(SameBits(CompressedState(*with, 1, 21), CompressedState(*without, 1, 21)));
}

}  // namespace
}  // namespace exl3::engine::cuda

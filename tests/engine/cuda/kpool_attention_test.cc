// GLM-5.3-Flash's indexed attention on the GPU (engine/cuda/kpool_attention.h) against the CPU
// engine: the k-pooled indexer's kernels (pool keys and scores, the top-k over pools, the chosen
// positions with the query's own incomplete pool) on random inputs against engine/cpu/attention/kpool_indexer.h's
// functions over the same fp16 cache; then the indexed layers of the glm5_next fixtures (a "full"
// and a "shared" one) against engine/cpu/attention/kpool_dsa_attention.h through prefill chunks across pool
// edges, decode and prefill again, several sequences per step. Lines "kpool ..." give every
// comparison. Skipped where no GPU is visible (ctest label gpu).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "absl/strings/str_cat.h"
#include "engine/cpu/attention/attention.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/kpool_attention.h"
#include "engine/cuda/kpool_indexer_kernels.h"
#include "engine/cuda/latent_attention.h"
#include "engine/cuda/latent_attention_kernels.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/attention/kpool_dsa_attention.h"
#include "engine/cpu/attention/kpool_indexer.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// The indexer's kernels on random inputs.

struct KernelCase {
  int heads, dim, pool, select_pools;
};

TEST(KpoolKernelsTest, ScoresAndSelectionMatchCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  // The fixtures' shape, GLM-5.3-Flash's (32 heads of 128, pools of 16, index_topk 2048), and one
  // between. Each query token its own sequence on shuffled blocks: no pool yet, a pool's edges,
  // fewer pools than select_pools, and many more.
  const std::vector<KernelCase> cases = {{8, 64, 4, 2}, {16, 128, 8, 16}, {32, 128, 16, 128}};
  for (const KernelCase& kc : cases) {
    const KpoolShape cpu_shape{kc.heads, kc.dim, kc.pool, kc.select_pools};
    const int NI = kc.heads, D = kc.dim, P = kc.pool;
    const std::string name = absl::StrCat(NI, " heads of ", D, ", pools of ", P, ", ", kc.select_pools, " chosen");
    SCOPED_TRACE(name);
    std::vector<int32_t> pos = {0, P - 2, P - 1, P, P + 1, 3 * P - 1, kc.select_pools * P + P - 1,
                                kc.select_pools * P + 5 * P + 2, 2100, 3000};
    for (int32_t& p : pos) p = std::max(p, 0);
    const int zero_query = 8;  // a token whose queries are 0: every score 0, the lowest pools chosen (ties)
    const int T = static_cast<int>(pos.size()), bs = 16, R = 32, width = R + 2 * D, key_offset = R;
    int blocks_per_seq = 0;
    for (int p : pos) blocks_per_seq = std::max(blocks_per_seq, p / bs + 1);
    std::vector<int32_t> tables(static_cast<size_t>(T) * blocks_per_seq), offset(T), first(T, 0);
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);
    std::vector<int32_t> slots;  // every position of every sequence up to its query, in order
    for (int t = 0; t < T; ++t) {
      offset[t] = t * blocks_per_seq;
      for (int j = 0; j <= pos[t]; ++j) slots.push_back(tables[offset[t] + j / bs] * bs + j % bs);
    }
    const int written = static_cast<int>(slots.size());
    const size_t cache_halves = tables.size() * bs * width;
    DeviceArray<KvHalf> d_cache = ToDevice(std::vector<KvHalf>(cache_halves, 0));
    {
      const std::vector<float> k = Random(static_cast<size_t>(written) * D, rng),
                               gate = Random(static_cast<size_t>(written) * D, rng, 2.0f);
      DeviceArray<float> d_k = ToDevice(k), d_gate = ToDevice(gate);
      DeviceArray<int32_t> d_slots = ToDevice(slots);
      ASSERT_TRUE(WriteRowsToCache(d_k.get(), written, D, d_slots.get(), d_cache.get(), width, key_offset, nullptr).ok());
      ASSERT_TRUE(
          WriteRowsToCache(d_gate.get(), written, D, d_slots.get(), d_cache.get(), width, key_offset + D, nullptr).ok());
    }
    const std::vector<KvHalf> bits = ToHost(d_cache.get(), cache_halves);
    const std::vector<float> ape = Random(static_cast<size_t>(P) * D, rng, 0.5f);
    std::vector<float> q = Random(static_cast<size_t>(T) * NI * D, rng), wts = Random(static_cast<size_t>(T) * NI, rng);
    std::fill_n(&q[static_cast<size_t>(zero_query) * NI * D], NI * D, 0.0f);
    const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));

    // The CPU's pool keys from the cached fp16 values, its scores (engine/cpu/attention/kpool_indexer.cc's sums)
    // and its choices.
    const int row = 3000 / P + 1;
    std::vector<float> ref(static_cast<size_t>(T) * row, 0.0f);
    std::vector<std::vector<int32_t>> want(T);
    std::vector<char> near_tie(T, 0);
    for (int t = 0; t < T; ++t) {
      const int complete = (pos[t] + 1) / P * P, pools = complete / P;
      std::vector<float> keys(static_cast<size_t>(complete) * D), gates(keys.size());
      for (int j = 0; j < complete; ++j) {
        const size_t slot = static_cast<size_t>(tables[offset[t] + j / bs]) * bs + j % bs;
        for (int c = 0; c < D; ++c) {
          keys[static_cast<size_t>(j) * D + c] = HalfToFloat(bits[slot * width + key_offset + c]);
          gates[static_cast<size_t>(j) * D + c] = HalfToFloat(bits[slot * width + key_offset + D + c]);
        }
      }
      const std::vector<float> pool_keys = KpoolKeys(keys.data(), gates.data(), complete, ape.data(), cpu_shape);
      std::vector<float> w(NI);
      for (int h = 0; h < NI; ++h) w[h] = wts[static_cast<size_t>(t) * NI + h] * head_weight;
      const float* qt = &q[static_cast<size_t>(t) * NI * D];
      for (int p = 0; p < pools; ++p) {
        float s = 0.0f;
        for (int h = 0; h < NI; ++h) {
          float dot = 0.0f;
          for (int c = 0; c < D; ++c) dot += qt[h * D + c] * pool_keys[static_cast<size_t>(p) * D + c];
          s += w[h] * std::max(dot * scale, 0.0f);
        }
        ref[static_cast<size_t>(t) * row + p] = s;
      }
      want[t] = SelectPooledPositions(qt, w.data(), pool_keys.data(), pos[t], cpu_shape);
      // Where the last chosen and the first left-out pool's scores lie within fp32 summation-order
      // noise, either choice is right.
      if (pools > kc.select_pools && t != zero_query) {
        std::vector<float> sorted(ref.begin() + static_cast<size_t>(t) * row,
                                  ref.begin() + static_cast<size_t>(t) * row + pools);
        std::sort(sorted.begin(), sorted.end(), std::greater<float>());
        const float gap = sorted[kc.select_pools - 1] - sorted[kc.select_pools];
        near_tie[t] = gap <= 1e-5f * std::max(std::fabs(sorted[0]), 1e-30f);
      }
    }

    DeviceArray<float> d_q = ToDevice(q), d_wts = ToDevice(wts), d_ape = ToDevice(ape),
                       d_scores = ToDevice(std::vector<float>(ref.size(), 0.0f));
    DeviceArray<int32_t> d_tables = ToDevice(tables), d_offset = ToDevice(offset), d_first = ToDevice(first),
                         d_pos = ToDevice(pos);
    const AttentionTokens at{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), bs};
    const KpoolIndexerShape shape{NI, D, P, width, key_offset};
    for (int blocks : {1, 5}) {
      ASSERT_TRUE(d_scores.Upload(std::vector<float>(ref.size(), 0.0f)).ok());
      const absl::Status st = KpoolScores(d_q.get(), d_wts.get(), head_weight, scale, d_ape.get(), d_cache.get(), at,
                                          shape, 0, T, blocks, d_scores.get(), row, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      const double rel = RelativeError(ToHost(d_scores.get(), ref.size()), ref);
      std::printf("kpool scores %s, blocks per token %d: rel %.2e\n", name.c_str(), blocks, rel);
      EXPECT_LT(rel, 1e-5) << "blocks per token " << blocks;
    }
    // The top select_pools pools of each row, in two groups of tokens (as a prefill step's score
    // groups), then their positions and the tail.
    const int stride = kc.select_pools * P + P;
    DeviceArray<int32_t> d_pools = ToDevice(std::vector<int32_t>(static_cast<size_t>(T) * kc.select_pools, -1)),
                         d_pool_count = ToDevice(std::vector<int32_t>(T, -1)),
                         d_sel = ToDevice(std::vector<int32_t>(static_cast<size_t>(T) * stride, -1)),
                         d_count = ToDevice(std::vector<int32_t>(T, -1));
    const int half = T / 2;
    for (const auto& [t0, n] : {std::pair<int, int>{0, half}, std::pair<int, int>{half, T - half}}) {
      ASSERT_TRUE(IndexerTopk(d_scores.get() + static_cast<size_t>(t0) * row, row, d_pos.get(), t0, n,
                              kc.select_pools, d_pools.get(), d_pool_count.get(), nullptr, P)
                      .ok());
    }
    ASSERT_TRUE(KpoolSelectedPositions(d_pools.get(), d_pool_count.get(), kc.select_pools, d_pos.get(), P, T,
                                       d_sel.get(), d_count.get(), stride, nullptr)
                    .ok());
    const std::vector<int32_t> sel = ToHost(d_sel.get(), static_cast<size_t>(T) * stride),
                               count = ToHost(d_count.get(), T);
    int differ = 0, ties = 0;
    for (int t = 0; t < T; ++t) {
      ties += near_tie[t];
      ASSERT_GE(count[t], 0);
      ASSERT_LE(count[t], stride);
      const std::vector<int32_t> got(sel.begin() + static_cast<size_t>(t) * stride,
                                     sel.begin() + static_cast<size_t>(t) * stride + count[t]);
      if (got == want[t]) continue;
      ++differ;
      if (!near_tie[t])
        ADD_FAILURE() << "token " << t << " (position " << pos[t] << "): " << got.size() << " positions chosen, "
                      << want[t].size() << " on the CPU, or different ones";
    }
    std::printf("kpool selection %s: %d of %d tokens chose differently (%d near a tie)\n", name.c_str(), differ, T,
                ties);
  }
}

// ---------------------------------------------------------------------------------------------
// The fixtures' indexed layers against the CPU engine's, over steps that prefill, decode and
// prefill again: the same inputs, each engine writing its own cache.

void CheckFixtureLayers(const std::string& fixture, double bound, LatentKernel kernel) {
  const char* kernel_name = kernel == LatentKernel::kTensorCores ? "tensor-cores" : "cuda-cores";
  SCOPED_TRACE(fixture + ", " + kernel_name);
  const std::string dir = "tests/fixtures/engine/" + fixture;
  auto cfg_or = LoadModelConfig(dir);
  ASSERT_TRUE(cfg_or.ok()) << cfg_or.status();
  const ModelConfig cfg = *cfg_or;
  ASSERT_EQ(cfg.attention, AttentionKind::kPooledDsa);
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  const int L = cfg.num_layers, H = cfg.hidden_size, P = cfg.glm5next->index_kpool;
  const int select_pools = cfg.indexer.topk / P;
  std::vector<int> layers;  // the indexed layers, in order
  std::vector<std::unique_ptr<KpoolDsaAttention>> cpu(L);
  std::vector<std::unique_ptr<CudaKpoolAttention>> gpu(L);
  bool has_full = false, has_shared = false;
  for (int l = 0; l < L; ++l) {
    if (cfg.IsLinearAttentionLayer(l)) continue;
    layers.push_back(l);
    (cfg.HasOwnIndexer(l) ? has_full : has_shared) = true;
    auto c = KpoolDsaAttention::Load(cfg, **src, l);
    ASSERT_TRUE(c.ok()) << c.status();
    cpu[l] = std::move(*c);
    auto g = CudaKpoolAttention::Load(cfg, **src, l);
    ASSERT_TRUE(g.ok()) << "layer " << l << ": " << g.status();
    gpu[l] = std::move(*g);
  }
  ASSERT_TRUE(has_full && has_shared) << fixture << " should have a full and a shared indexed layer";

  KvCacheShape shape;
  shape.block_size = 16;
  shape.num_blocks = 32;
  const int bs = shape.block_size, kSeqs = 4, kBlocksPerSeq = 8;
  LayerCaches caches = LayerCachesOf(cfg, shape);

  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{handle, &workspace, nullptr};
  CpuCompute compute(2);
  LatentWorkspace latent_ws;
  KpoolWorkspace ws;

  // Four sequences on shuffled blocks. Prefill chunks of P, P - 1, P + 1 and 5P + 3 tokens (pools
  // beyond select_pools), decode twice, prefill again (one sequence decoding beside), decode.
  std::mt19937 rng(13);
  std::vector<int32_t> blocks(shape.num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<std::vector<int32_t>> tables(kSeqs);
  for (int s = 0; s < kSeqs; ++s) tables[s].assign(blocks.begin() + s * kBlocksPerSeq, blocks.begin() + (s + 1) * kBlocksPerSeq);
  const std::vector<std::vector<NextChunk>> steps = {
      {{0, P}, {1, P - 1}, {2, P + 1}, {3, (select_pools + 3) * P + 3}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{3, 1}, {2, 1}, {1, 1}, {0, 1}},
      {{0, 3 * P + 1}, {1, (select_pools + 2) * P}, {2, 1}, {3, 2 * P - 1}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{2, P + 2}, {0, 1}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}}};
  std::vector<int> next_position(kSeqs, 0);
  int step_index = 0, differ_total = 0, selecting_tokens = 0;
  for (const std::vector<NextChunk>& chunks : steps) {
    const StepBatch batch = NextChunks(chunks, tables, &next_position);
    StepTokens tokens;
    ASSERT_TRUE(FlattenStep(batch, cfg.vocab_size, shape, cfg.max_position_embeddings, &tokens).ok());
    const int T = tokens.num_tokens;
    const PagedStepFacts facts = PagedStepFactsOf(batch, tokens, bs);
    const std::vector<int32_t>& pos = facts.positions;
    const int splits = step_index % 2 == 0 ? 1 : 3;
    const int span = cfg.indexer.topk + P;  // the most positions a token attends to
    const DeviceStepFacts d_facts = UploadStepFacts(facts, span, splits);
    const int max_context = std::min(cfg.max_position_embeddings, kBlocksPerSeq * bs);
    bool moved = false;
    ASSERT_TRUE(latent_ws.Reserve(cfg, T, splits, max_context, &moved).ok());
    ASSERT_TRUE(ws.Reserve(cfg, T, max_context, &moved).ok());
    LatentStep step;
    step.tokens = d_facts.tokens(bs);
    step.slot = d_facts.slot.get();
    step.splits = splits;
    step.split_positions = d_facts.split_positions.get();
    step.sm_count = 8;
    step.kernel = kernel;

    AttentionCarry carry;
    // Tokens whose GPU selection differed from the CPU's on this step's full layer: their output
    // there and on the shared layer after it is another attention's, left out.
    std::vector<char> chose_differently(T, 0);
    for (int l : layers) {
      SCOPED_TRACE(absl::StrCat("step ", step_index, " layer ", l));
      const std::vector<float> x = Random(static_cast<size_t>(T) * H, rng);
      std::vector<float> want(x.size());
      ASSERT_TRUE(cpu[l]->Forward(x.data(), tokens, *caches.cpu, carry, want.data(), compute).ok());
      DeviceArray<float> d_x = ToDevice(x), d_out;
      ASSERT_TRUE(d_out.Reserve(x.size()).ok());
      const absl::Status st =
          gpu[l]->Forward(d_x.get(), T, step, caches.gpu_layer(l), latent_ws, ws, ctx, d_out.get());
      ASSERT_TRUE(st.ok()) << st;
      const std::vector<float> got = ToHost(d_out.get(), x.size());
      int differ = 0;
      if (cfg.HasOwnIndexer(l)) {
        const std::vector<int32_t> sel = ToHost(ws.selected.get(), static_cast<size_t>(T) * ws.stride),
                                   count = ToHost(ws.selected_count.get(), T);
        for (int t = 0; t < T; ++t) {
          ASSERT_GE(count[t], 0);
          ASSERT_LE(count[t], ws.stride);
          const std::vector<int32_t> g(sel.begin() + static_cast<size_t>(t) * ws.stride,
                                       sel.begin() + static_cast<size_t>(t) * ws.stride + count[t]);
          if ((pos[t] + 1) / P > select_pools) ++selecting_tokens;
          if (g != carry.topk->positions[t]) {
            ++differ;
            chose_differently[t] = 1;
            std::printf("kpool %s %s step %d layer %d token %d (position %d): GPU and CPU chose different pools\n",
                        fixture.c_str(), kernel_name, step_index, l, t, pos[t]);
          }
        }
      }
      double worst = 0;
      int worst_t = 0;
      std::vector<float> got_kept, want_kept;
      for (int t = 0; t < T; ++t) {
        if (chose_differently[t]) continue;
        const size_t b = static_cast<size_t>(t) * H;
        got_kept.insert(got_kept.end(), got.begin() + b, got.begin() + b + H);
        want_kept.insert(want_kept.end(), want.begin() + b, want.begin() + b + H);
        const double e = RelativeError(std::vector<float>(got.begin() + b, got.begin() + b + H),
                                       std::vector<float>(want.begin() + b, want.begin() + b + H));
        if (!(e <= worst)) worst = e, worst_t = t;
      }
      const double rel = RelativeError(got_kept, want_kept);
      std::printf("kpool %s %s step %d layer %d (%s, %d tokens, splits %d) rel %.2e (worst token %d, position %d: "
                  "%.2e)%s\n",
                  fixture.c_str(), kernel_name, step_index, l, cfg.HasOwnIndexer(l) ? "full" : "shared", T, splits,
                  rel, worst_t, pos[worst_t], worst,
                  differ > 0 ? absl::StrCat(", ", differ, " selections differ").c_str() : "");
      // The bound is the step's; a single token's output (one position seen, say) may stray twice as far.
      EXPECT_LT(rel, bound);
      EXPECT_LT(worst, 2 * bound) << "token " << worst_t << " (position " << pos[worst_t] << ")";
      differ_total += differ;
    }
    ++step_index;
  }
  // The GPU cache holds k_i and the gate in fp16, the CPU's in fp32: where two pools' scores lie
  // within that rounding at the boundary of the chosen ones the choices may differ, rarely: at most
  // one token in 10 of those that select.
  std::printf("kpool %s %s: %d of %d selecting tokens chose differently\n", fixture.c_str(), kernel_name, differ_total,
              selecting_tokens);
  EXPECT_GT(selecting_tokens, 0);
  EXPECT_LE(differ_total, std::max(1, selecting_tokens / 10));
  cublasDestroy(handle);
}

// The experts fixture's attention projections are bf16 (dense on both engines): 1e-3. The all
// fixture's are EXL3, decoded by each engine's own kernels: 5e-3, as the latent layers' test.
TEST(KpoolLayerTest, Glm5NextExpertsLayersMatchCpu) {
  REQUIRE_GPU();
  CheckFixtureLayers("glm5_next_experts", 1e-3, LatentKernel::kCudaCores);
  CheckFixtureLayers("glm5_next_experts", 1e-3, LatentKernel::kTensorCores);
}

TEST(KpoolLayerTest, Glm5NextAllLayersMatchCpu) {
  REQUIRE_GPU();
  CheckFixtureLayers("glm5_next_all", 5e-3, LatentKernel::kCudaCores);
  CheckFixtureLayers("glm5_next_all", 5e-3, LatentKernel::kTensorCores);
}

}  // namespace
}  // namespace exl3::engine::cuda

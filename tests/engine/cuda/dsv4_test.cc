// DeepSeek-V4 on the GPU against the CPU engine, piece by piece on random inputs: the
// hyper-connections' collapse, expand and head (engine/cuda/hyper_connection_kernels.h against
// engine/cpu/residual/hyper_connections.h, with the fixture's weights), the hash-routed gate (against
// model/routing.h's RouteHashed), and each attention layer of the fixtures (sliding window, CSA
// with its indexer, HCA; engine/cuda/dsv4_attention.h against engine/cpu/attention/dsv4_attention.h) through
// steps of prefill chunks and decode tokens of two sequences, comparing every step's output and,
// at the end, the whole cache (slots, compressor accumulators, entries). Whole models:
// tests/engine/cuda/cuda_model_test.cc (Dsv4Family). Skipped where no GPU is visible (label gpu).
#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/config/read_model_config.h"
#include "engine/cuda/dsv4_attention.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cpu/attention/dsv4_attention.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/cuda/hyper_connection_check.h"

namespace exl3::engine::cuda {
namespace {

const char* const kFixtures[] = {"tests/fixtures/engine/deepseek_v4_experts",
                                  "tests/fixtures/engine/deepseek_v4_all"};

TEST(Dsv4KernelsTest, HyperConnectionsMatchTheCpu) {
  REQUIRE_GPU();
  const std::string dir = kFixtures[0];
  auto cfg = LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  const Dsv4Config& d = *cfg->dsv4;
  const int H = cfg->hidden_size, N = d.hc_mult, T = 37;
  const HyperConnectionShape shape{H, N, d.hc_sinkhorn_iters, d.hc_eps, cfg->rms_norm_eps};
  std::mt19937 rng(7);
  for (const char* prefix : {"model.layers.0.hc_attn_", "model.layers.2.hc_ffn_"})
    testing::CheckHyperConnectionAgainstCpu(**src, prefix, shape, T, rng, "dsv4");
  auto head = HyperHead::Load(**src, "model.hc_head.", shape);
  ASSERT_TRUE(head.ok()) << head.status();
  const std::vector<float> streams = Random(static_cast<size_t>(T) * N * H, rng);
  const std::vector<int> rows = {0, 5, 36, 17};
  std::vector<float> want(rows.size() * H);
  head->Collapse(streams.data(), rows, want.data());
  DeviceArray<float> fn = ToDevice(head->fn()), base = ToDevice(head->base()), d_streams = ToDevice(streams), d_out;
  DeviceArray<int32_t> d_rows = ToDevice(std::vector<int32_t>(rows.begin(), rows.end()));
  ASSERT_TRUE(d_out.Reserve(want.size()).ok());
  ASSERT_TRUE(HyperHeadCollapse(fn.get(), base.get(), head->scale(), N, H, d.hc_eps, cfg->rms_norm_eps,
                                d_streams.get(), d_rows.get(), static_cast<int>(rows.size()), d_out.get(), nullptr)
                  .ok());
  const double rel = RelativeError(ToHost(d_out, want.size()), want);
  std::printf("dsv4 hyper-connection head: rel %.2e\n", rel);
  EXPECT_LT(rel, 1e-5);
}

TEST(Dsv4KernelsTest, HashGateMatchesRouteHashed) {
  REQUIRE_GPU();
  const int E = 64, k = 6, vocab = 1000, T = 300;
  MoeConfig mc;
  mc.num_hidden_layers = 1;
  mc.moe_layers = {true};
  mc.hash_routed_layers = {true};
  mc.num_experts = E;
  mc.top_k = k;
  mc.scoring = ScoringFunc::kSqrtSoftplus;
  mc.norm_topk_prob = true;
  mc.routed_scaling_factor = 1.5f;
  std::mt19937 rng(3);
  std::vector<int32_t> table(static_cast<size_t>(vocab) * k), ids32(T);
  for (int v = 0; v < vocab; ++v) {
    std::vector<int32_t> e(E);
    std::iota(e.begin(), e.end(), 0);
    std::shuffle(e.begin(), e.end(), rng);
    std::copy_n(e.begin(), k, table.begin() + static_cast<size_t>(v) * k);
  }
  std::vector<int64_t> ids(T);
  for (int t = 0; t < T; ++t) ids32[t] = static_cast<int32_t>(ids[t] = rng() % vocab);
  const std::vector<float> logits = Random(static_cast<size_t>(T) * E, rng, 3.0f);
  std::vector<int32_t> want_ids(static_cast<size_t>(T) * k);
  std::vector<float> want_w(want_ids.size());
  for (ScoringFunc s : {ScoringFunc::kSqrtSoftplus, ScoringFunc::kSigmoid}) {
    mc.scoring = s;
    ASSERT_TRUE(RouteHashed(mc, 0, logits.data(), table.data(), vocab, ids.data(), T, want_ids.data(), want_w.data())
                    .ok());
    DeviceArray<float> d_logits = ToDevice(logits), d_w;
    DeviceArray<int32_t> d_table = ToDevice(table), d_ids = ToDevice(ids32), d_out;
    ASSERT_TRUE(d_w.Reserve(want_w.size()).ok());
    ASSERT_TRUE(d_out.Reserve(want_ids.size()).ok());
    ASSERT_TRUE(HashRouteOnDevice(GateConfigFor(mc), d_logits.get(), d_table.get(), d_ids.get(), T, d_out.get(),
                                  d_w.get(), nullptr)
                    .ok());
    EXPECT_EQ(ToHost(d_out, want_ids.size()), want_ids);
    const double rel = RelativeError(ToHost(d_w, want_w.size()), want_w);
    std::printf("dsv4 hash gate %s: weights rel %.2e\n", std::string(ScoringFuncName(s)).c_str(), rel);
    EXPECT_LT(rel, 1e-6);
  }
}

// One chunk of a step: `n` tokens of sequence `seq` from position `start`.
struct ChunkPlan {
  int seq, start, n;
};

void CheckAttentionLayers(const std::string& dir, int block_size, double tolerance) {
  auto cfg_or = LoadModelConfig(dir);
  ASSERT_TRUE(cfg_or.ok()) << cfg_or.status();
  const ModelConfig cfg = *cfg_or;
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  const int H = cfg.hidden_size, B = block_size, seqs = 2, per_seq = (48 + B - 1) / B;
  const int num_blocks = seqs * per_seq;
  std::mt19937 rng(11);
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables(seqs);
  for (int s = 0; s < seqs; ++s) tables[s].assign(perm.begin() + s * per_seq, perm.begin() + (s + 1) * per_seq);
  // Prefill chunks opening and closing windows across steps, decode tokens between them; the
  // indexer's selection matters once a sequence sees more than index_topk entries. The last step
  // runs sequence 1's positions 40..44 again (a failed step run again: folded positions are
  // skipped, a block's first position refolds it from its predecessor).
  const std::vector<std::vector<ChunkPlan>> steps = {{{0, 0, 21}, {1, 0, 5}},  {{0, 21, 1}, {1, 5, 25}},
                                                     {{0, 22, 19}, {1, 30, 1}}, {{0, 41, 1}, {1, 31, 1}},
                                                     {{0, 42, 3}, {1, 32, 13}}, {{1, 40, 5}, {0, 45, 1}}};
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{handle, &workspace, nullptr};
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  CpuCompute compute(2);
  const KvCacheShape shape{num_blocks, B, 0};
  for (int l = 0; l < cfg.num_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    auto cpu = Dsv4Attention::Load(cfg, **src, l);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = CudaDsv4Attention::Load(cfg, **src, l);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    std::vector<KvLayerShape> layers(cfg.num_layers);
    for (int i = 0; i < cfg.num_layers; ++i) layers[i] = {cfg.KvWidth(i), cfg.KvBlockFloats(i, B)};
    PagedKvCache cpu_cache(layers, shape);
    const int stride = B * cfg.KvWidth(l) + cfg.KvBlockFloats(l, B);
    DeviceArray<float> gpu_cache = ToDevice(std::vector<float>(static_cast<size_t>(num_blocks) * stride, 0.0f));
    const Dsv4CacheView view{gpu_cache.get(), B, cfg.KvWidth(l), stride};
    Dsv4Workspace ws;
    Dsv4StepFacts facts(cfg);
    ASSERT_TRUE(facts.Init().ok());
    // Every block's slots and area, GPU against CPU.
    auto cache_error = [&]() {
      const std::vector<float> got = ToHost(gpu_cache, static_cast<size_t>(num_blocks) * stride);
      std::vector<float> cpu_blocks;
      for (int b = 0; b < num_blocks; ++b) {
        const float* start = cpu_cache.Slot(l, std::vector<int32_t>{b}, 0);
        cpu_blocks.insert(cpu_blocks.end(), start, start + stride);
      }
      return RelativeError(got, cpu_blocks);
    };
    double worst = 0, worst_cache = 0;
    int selecting = 0, differ = 0;  // CSA tokens that choose among more than index_topk entries
    for (size_t si = 0; si < steps.size(); ++si) {
      StepBatch batch;
      for (const ChunkPlan& p : steps[si]) {
        SequenceChunk c;
        c.sequence_id = p.seq;
        for (int i = 0; i < p.n; ++i) c.tokens.push_back(static_cast<int32_t>(rng() % cfg.vocab_size));
        c.start_position = p.start;
        c.block_table = tables[p.seq];
        c.wants_logits = true;
        batch.chunks.push_back(std::move(c));
      }
      StepTokens tokens;
      ASSERT_TRUE(FlattenStep(batch, cfg.vocab_size, shape, cfg.max_position_embeddings, &tokens).ok());
      const int T = tokens.num_tokens;
      const std::vector<float> x = Random(static_cast<size_t>(T) * H, rng);
      std::vector<float> want(x.size());
      AttentionCarry carry;
      const absl::Status st = (*cpu)->Forward(x.data(), tokens, cpu_cache, carry, want.data(), compute);
      ASSERT_TRUE(st.ok()) << st;

      // The step's device facts as CudaModel packs them (positions, windows, block tables).
      std::vector<int32_t> position(T), first(T), offset(T), packed;
      std::vector<int32_t> chunk_offset;
      for (const SequenceChunk& c : batch.chunks) {
        chunk_offset.push_back(static_cast<int32_t>(packed.size()));
        packed.insert(packed.end(), c.block_table.begin(), c.block_table.end());
      }
      for (int t = 0; t < T; ++t) {
        position[t] = tokens.positions[t];
        first[t] = FirstVisiblePosition(position[t], cfg.sliding_window);
        offset[t] = chunk_offset[tokens.chunk_of[t]];
      }
      DeviceArray<int32_t> d_pos = ToDevice(position), d_first = ToDevice(first), d_offset = ToDevice(offset),
                           d_tables = ToDevice(packed);
      ASSERT_TRUE(ws.Reserve(cfg, T, num_blocks * B).ok());
      Dsv4Step step;
      ASSERT_TRUE(facts
                      .Prepare(tokens, AttentionTokens{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), B},
                               sm_count, nullptr, &step)
                      .ok());
      DeviceArray<float> d_x = ToDevice(x), d_out;
      ASSERT_TRUE(d_out.Reserve(x.size()).ok());
      const absl::Status gst = (*gpu)->Forward(d_x.get(), T, step, view, ws, ctx, d_out.get());
      ASSERT_TRUE(gst.ok()) << gst;
      const std::vector<float> got = ToHost(d_out, x.size());
      const double rel = RelativeError(got, want);
      ASSERT_TRUE(facts.TakeError(nullptr).ok());
      // CSA: the entries the GPU's indexer chose against the CPU's. Where two entries' scores tie
      // within the engines' rounding at the top-k boundary (the EXL3 projections round their input
      // to fp16 on the GPU) the choices may differ, and that token's output is another attention's:
      // left out of the bound, counted, at most one in 16 of the tokens that select.
      std::vector<char> chose_differently(T, 0);
      if (carry.topk) {
        const int k = cfg.dsv4->index_topk;
        const std::vector<int32_t> sel = ToHost(ws.selected, static_cast<size_t>(T) * k),
                                   count = ToHost(ws.selected_count, T);
        for (int t = 0; t < T; ++t) {
          const std::vector<int32_t> g(sel.begin() + static_cast<size_t>(t) * k,
                                       sel.begin() + static_cast<size_t>(t) * k + std::min(count[t], k));
          if (static_cast<int>(carry.topk->positions[t].size()) >= k) ++selecting;
          if (g != carry.topk->positions[t]) {
            chose_differently[t] = 1;
            ++differ;
            std::printf("  dsv4 layer %d step %zu token %d (position %d): GPU and CPU indexers chose different "
                        "entries\n", l, si, t, tokens.positions[t]);
          }
        }
      }
      double kept = 0;
      for (int t = 0; t < T; ++t) {
        if (chose_differently[t]) continue;
        const size_t b = static_cast<size_t>(t) * H;
        kept = std::max(kept, RelativeError(std::vector<float>(got.begin() + b, got.begin() + b + H),
                                            std::vector<float>(want.begin() + b, want.begin() + b + H)));
      }
      // The cache after the step (the kv slots and the compressors' state): where it agrees and the
      // output does not, the indexer or the attention differ.
      const double cache_rel = cache_error();
      worst = std::max(worst, kept);
      worst_cache = std::max(worst_cache, cache_rel);
      EXPECT_LT(kept, tolerance) << "step " << si << " (whole step " << rel << ", cache rel " << cache_rel << ")";
      EXPECT_LT(cache_rel, tolerance) << "step " << si;
    }
    const double cache_rel = worst_cache;
    if (cfg.dsv4->layer_types[l] != Dsv4LayerType::kSlidingWindow) {
      // A chunk that skips positions of its block (47 after 45) is refused after the step, as the
      // CPU engine refuses it.
      StepBatch gap;
      SequenceChunk c;
      c.tokens = {1};
      c.start_position = 47;
      c.block_table = tables[0];
      c.wants_logits = true;
      gap.chunks.push_back(c);
      StepTokens tokens;
      ASSERT_TRUE(FlattenStep(gap, cfg.vocab_size, shape, cfg.max_position_embeddings, &tokens).ok());
      std::vector<int32_t> position = {47}, first = {FirstVisiblePosition(47, cfg.sliding_window)}, offset = {0};
      DeviceArray<int32_t> d_pos = ToDevice(position), d_first = ToDevice(first), d_offset = ToDevice(offset),
                           d_tables = ToDevice(tables[0]);
      ASSERT_TRUE(ws.Reserve(cfg, 1, num_blocks * B).ok());
      Dsv4Step step;
      ASSERT_TRUE(facts
                      .Prepare(tokens, AttentionTokens{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), B},
                               sm_count, nullptr, &step)
                      .ok());
      DeviceArray<float> d_x = ToDevice(Random(H, rng)), d_out;
      ASSERT_TRUE(d_out.Reserve(H).ok());
      ASSERT_TRUE((*gpu)->Forward(d_x.get(), 1, step, view, ws, ctx, d_out.get()).ok());
      ASSERT_TRUE(exl3::cuda::Synchronize().ok());
      const absl::Status refused = facts.TakeError(nullptr);
      EXPECT_FALSE(refused.ok());
      EXPECT_NE(std::string(refused.message()).find("folded positions"), std::string::npos) << refused;
      EXPECT_TRUE(facts.TakeError(nullptr).ok()) << "the error word is cleared once taken";
    }
    std::printf("dsv4 attention %-12s layer %d (%s) blocks of %2d: output rel (worst token) %.2e, cache rel (worst "
                "step) %.2e; %d of %d selecting tokens chose differently\n",
                dir.substr(dir.rfind('/') + 1).c_str(), l,
                cfg.dsv4->layer_types[l] == Dsv4LayerType::kSlidingWindow       ? "sliding"
                : cfg.dsv4->layer_types[l] == Dsv4LayerType::kCompressedSparse ? "CSA"
                                                                                : "HCA",
                B, worst, cache_rel, differ, selecting);
    EXPECT_LE(differ, std::max(1, selecting / 16));
  }
  cublasDestroy(handle);
}

// Dense attention weights (the experts fixture): fp32 on both sides. EXL3 attention (the all
// fixture): the GPU's EXL3 kernels round and sum otherwise than the CPU's (the bound of
// tests/engine/cuda/latent_attention_test.cc's layers).
TEST(Dsv4KernelsTest, AttentionLayersMatchTheCpu) {
  REQUIRE_GPU();
  for (int B : {16, 8}) {
    CheckAttentionLayers(kFixtures[0], B, 1e-4);
    CheckAttentionLayers(kFixtures[1], B, 5e-3);
  }
}

}  // namespace
}  // namespace exl3::engine::cuda

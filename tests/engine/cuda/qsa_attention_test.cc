// Qwen4-Exp's QSA attention on the GPU (engine/cuda/qsa_mixer.h, engine/cuda/qsa_kernels.h)
// against the CPU engine's engine/cpu/attention/qsa_attention.h on fresh random inputs: the selection (the device
// top-k over blocks and the expansion into positions) against QsaSelectedPositions on scores full of
// ties, at every block edge; the block scores against QsaBlockScores over block keys formed as the
// CPU forms them (fixture's shape and a wider one); then the fixture's QSA layer through the mixer
// kind's interface, as CudaModel drives it (StepFacts), through prefill → decode → prefill of four
// sequences on shuffled cache blocks. Each comparison prints a "qsa ..." line with the relative
// error and the worst token. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/attention/attention.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/cuda_mixer.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/kpool_indexer_kernels.h"
#include "engine/cuda/qsa_kernels.h"
#include "engine/cuda/qsa_mixer.h"
#include "engine/cuda/step_facts.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/cpu/attention/qsa_attention.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rms_norm.h"
#include "engine/cpu/rope.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

constexpr const char* kFixture = "tests/fixtures/engine/qwen4_exp_experts";

// Blocks of m positions, `topk` kept: tokens at every edge (no block yet, one short of a block, a
// block just complete, as many blocks as kept, one more, many more), scores drawn from a few
// values (ties everywhere, zeros among them as relu gives them).
TEST(QsaKernelsTest, SelectionMatchesQsaSelectedPositions) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  for (const int m : {1, 4, 16, 64})
    for (const int topk : {1, 2, 5, 32}) {
      std::vector<int32_t> pos;
      for (const int blocks : {0, 1, topk - 1, topk, topk + 1, 3 * topk + 2})
        for (const int in_block : {0, m - 2, m - 1})
          if (blocks >= 0 && in_block >= 0) pos.push_back(blocks * m + in_block);
      const int T = static_cast<int>(pos.size());
      const int row_length = (*std::max_element(pos.begin(), pos.end()) + 1) / m;
      std::uniform_int_distribution<int> level(0, 3);
      std::vector<float> scores(static_cast<size_t>(T) * std::max(row_length, 1));
      for (float& s : scores) s = 0.5f * static_cast<float>(level(rng));
      const QsaIndexerConfig ix{8, 32, topk * m, m};
      const int stride = topk * m + m;
      DeviceArray<float> d_scores = ToDevice(scores);
      DeviceArray<int32_t> d_pos = ToDevice(pos), d_blocks, d_block_count, d_positions, d_count;
      ASSERT_TRUE(d_blocks.Reserve(static_cast<size_t>(T) * topk).ok());
      ASSERT_TRUE(d_block_count.Reserve(T).ok());
      ASSERT_TRUE(d_positions.Reserve(static_cast<size_t>(T) * stride).ok());
      ASSERT_TRUE(d_count.Reserve(T).ok());
      ASSERT_TRUE(IndexerTopk(d_scores.get(), row_length, d_pos.get(), 0, T, topk, d_blocks.get(),
                              d_block_count.get(), nullptr, m)
                      .ok());
      ASSERT_TRUE(KpoolSelectedPositions(d_blocks.get(), d_block_count.get(), topk, d_pos.get(), m, T,
                                         d_positions.get(), d_count.get(), stride, nullptr)
                      .ok());
      const std::vector<int32_t> got = ToHost(d_positions, static_cast<size_t>(T) * stride);
      const std::vector<int32_t> count = ToHost(d_count, T);
      int differ = 0;
      for (int t = 0; t < T; ++t) {
        const int blocks = (pos[t] + 1) / m;
        const std::vector<float> row(scores.begin() + static_cast<size_t>(t) * row_length,
                                     scores.begin() + static_cast<size_t>(t) * row_length + blocks);
        const std::vector<int32_t> want = QsaSelectedPositions(row, pos[t], ix);
        ASSERT_GE(count[t], 0);
        ASSERT_LE(count[t], stride);
        const std::vector<int32_t> g(got.begin() + static_cast<size_t>(t) * stride,
                                     got.begin() + static_cast<size_t>(t) * stride + count[t]);
        if (g != want) {
          ++differ;
          ADD_FAILURE() << "m " << m << " topk " << topk << " token " << t << " position " << pos[t] << ": "
                        << g.size() << " positions on the GPU, " << want.size() << " on the CPU";
        }
      }
      std::printf("qsa selection m %d topk %d: %d tokens, %d differ\n", m, topk, T, differ);
    }
}

// The raw keys of `seqs` sequences in an fp32 paged cache on shuffled blocks, queries at the
// positions `pos` (sequence t % seqs), against the CPU's block keys (engine/cpu/attention/qsa_attention.cc's
// arithmetic) and QsaBlockScores.
void CheckBlockScores(const ModelConfig& cfg, const QsaIndexerConfig& ix, const std::vector<int32_t>& pos,
                      std::mt19937& rng, const std::string& name) {
  const int ID = ix.head_dim, IH = ix.num_heads, m = ix.compress_ratio, T = static_cast<int>(pos.size());
  const int bs = 16, seqs = 3, max_pos = *std::max_element(pos.begin(), pos.end());
  const int blocks_per_seq = max_pos / bs + 1, num_blocks = seqs * blocks_per_seq;
  std::vector<int32_t> blocks(num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  const std::vector<float> raw = Random(static_cast<size_t>(num_blocks) * bs * ID, rng, 1.0f);
  const std::vector<float> iq = Random(static_cast<size_t>(T) * IH * ID, rng, 1.0f);
  std::vector<float> k_norm = Random(ID, rng, 0.2f);
  for (float& w : k_norm) w += 1.0f;
  const Rope rope(cfg.rope, cfg.max_position_embeddings);
  const int half = cfg.rope.rotary_dim / 2, row_length = (max_pos + 1) / m;
  std::vector<float> cos(static_cast<size_t>(std::max(row_length, 1)) * half), sin(cos.size());
  RopeAngles angles;
  for (int b = 0; b < row_length; ++b) {
    rope.Angles(b * m, b * m + 1, &angles);
    std::copy(angles.cos.begin(), angles.cos.end(), cos.begin() + static_cast<size_t>(b) * half);
    std::copy(angles.sin.begin(), angles.sin.end(), sin.begin() + static_cast<size_t>(b) * half);
  }
  std::vector<int32_t> first(T, 0), table_offset(T);
  for (int t = 0; t < T; ++t) table_offset[t] = (t % seqs) * blocks_per_seq;
  DeviceArray<float> d_raw = ToDevice(raw), d_iq = ToDevice(iq), d_norm = ToDevice(k_norm), d_cos = ToDevice(cos),
                     d_sin = ToDevice(sin), d_scores;
  DeviceArray<int32_t> d_pos = ToDevice(pos), d_first = ToDevice(first), d_offset = ToDevice(table_offset),
                       d_tables = ToDevice(blocks);
  ASSERT_TRUE(d_scores.Reserve(static_cast<size_t>(T) * std::max(row_length, 1)).ok());
  const AttentionTokens tokens{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), bs};
  ASSERT_TRUE(QsaBlockScores(d_iq.get(), d_raw.get(), tokens, QsaIndexerShape{IH, ID, m, cfg.rms_norm_eps},
                             d_norm.get(), d_cos.get(), d_sin.get(), half, T, d_scores.get(), row_length, nullptr)
                  .ok());
  const std::vector<float> got = ToHost(d_scores, static_cast<size_t>(T) * std::max(row_length, 1));
  double worst = 0;
  int worst_t = 0;
  for (int t = 0; t < T; ++t) {
    const int nb = (pos[t] + 1) / m;
    const int32_t* table = blocks.data() + table_offset[t];
    std::vector<float> keys(static_cast<size_t>(nb) * ID, 0.0f);
    for (int b = 0; b < nb; ++b) {
      float* kb = &keys[static_cast<size_t>(b) * ID];
      for (int i = 0; i < m; ++i) {
        const int p = b * m + i;
        const float* r = &raw[(static_cast<size_t>(table[p / bs]) * bs + p % bs) * ID];
        for (int d = 0; d < ID; ++d) kb[d] += r[d];
      }
      for (int d = 0; d < ID; ++d) kb[d] /= static_cast<float>(m);
      RmsNorm(kb, k_norm.data(), ID, cfg.rms_norm_eps, kb);
      rope.Apply(kb, 1, ID, b * m, pos[t] + 1);
    }
    std::vector<float> want;
    QsaBlockScores(&iq[static_cast<size_t>(t) * IH * ID], keys.data(), nb, ix, &want);
    if (nb == 0) continue;
    const std::vector<float> g(got.begin() + static_cast<size_t>(t) * row_length,
                               got.begin() + static_cast<size_t>(t) * row_length + nb);
    const double e = RelativeError(g, want);
    if (!(e <= worst)) worst = e, worst_t = t;
  }
  std::printf("qsa block scores %s (%d heads of %d, m %d): %d tokens, worst rel %.2e (token %d, position %d)\n",
              name.c_str(), IH, ID, m, T, worst, worst_t, pos[worst_t]);
  EXPECT_LT(worst, 1e-5) << "token " << worst_t << " position " << pos[worst_t];
}

TEST(QsaKernelsTest, BlockScoresMatchTheCpu) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->qwen4exp, nullptr);
  std::mt19937 rng(23);
  const QsaIndexerConfig& fixture = cfg->qwen4exp->indexer;
  const int m = fixture.compress_ratio;
  std::vector<int32_t> pos = {0, m - 2, m - 1, m, 2 * m - 1, 5 * m + 1, 17 * m - 1, 40 * m, 63 * m - 1};
  CheckBlockScores(*cfg, fixture, pos, rng, "fixture");
  // A wider indexer (128 dims, rope on 64 of them, 16 heads, blocks of 64) past 32 blocks.
  ModelConfig wide = *cfg;
  wide.rope.rotary_dim = 64;
  CheckBlockScores(wide, QsaIndexerConfig{16, 128, 2048, 64}, {0, 63, 64, 1000, 64 * 33 - 1, 64 * 40 + 5}, rng, "wide");
}

// QsaAttention against a double-precision reference on the fp16 values the cache holds: tokens
// attending 1 position, one short of a chunk (64), a chunk, one more, two chunks and one more, many,
// and the most a row takes; one token (the most splits), a few, and enough that nothing splits;
// Qwen3.8-Flash-Next's shape (16 heads over 2 KV heads of 256) and the fixtures' smaller ones.
TEST(QsaKernelsTest, AttentionMatchesTheReferenceAtChunkAndSplitEdges) {
  REQUIRE_GPU();
  std::mt19937 rng(41);
  const std::vector<int> counts = {1, 63, 64, 65, 129, 700, 2052};
  const int stride = 2052, bs = 16, context = 2304, num_blocks = context / bs;
  struct Shape { int NH, KV, D; };
  // (tokens, the count the first token takes): one token at every count, then mixed batches.
  std::vector<std::pair<int, int>> runs;
  for (int c = 0; c < static_cast<int>(counts.size()); ++c) runs.push_back({1, c});
  for (const auto& r : {std::pair{3, 4}, std::pair{40, 0}, std::pair{300, 0}}) runs.push_back(r);
  for (const Shape sh : {Shape{16, 2, 256}, Shape{16, 2, 128}, Shape{2, 1, 64}, Shape{2, 2, 64}, Shape{16, 1, 32}})
    for (const auto& [T, first_count] : runs) {
      const int NH = sh.NH, KV = sh.KV, D = sh.D, kvf = KV * D;
      // One sequence's cache on shuffled blocks, written through WriteKv (fp16, as the model writes it).
      std::vector<int32_t> table(num_blocks);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);
      std::vector<int32_t> slot(context);
      for (int p = 0; p < context; ++p) slot[p] = table[p / bs] * bs + p % bs;
      const std::vector<float> k = Random(static_cast<size_t>(context) * kvf, rng), v = Random(k.size(), rng);
      DeviceArray<float> d_k = ToDevice(k), d_v = ToDevice(v);
      DeviceArray<int32_t> d_slot = ToDevice(slot);
      DeviceArray<KvHalf> d_cache;
      ASSERT_TRUE(d_cache.Reserve(static_cast<size_t>(context) * 2 * kvf).ok());
      ASSERT_TRUE(WriteKv(d_k.get(), d_v.get(), d_slot.get(), context, kvf, d_cache.get(), nullptr).ok());
      const std::vector<KvHalf> cache = ToHost(d_cache, static_cast<size_t>(context) * 2 * kvf);
      // Each token's positions: count[t] distinct ones of the sequence, ascending.
      std::vector<int32_t> positions(static_cast<size_t>(T) * stride, 0), count(T), pos(T, context - 1);
      std::vector<int32_t> all(context);
      std::iota(all.begin(), all.end(), 0);
      for (int t = 0; t < T; ++t) {
        count[t] = counts[(t + first_count) % counts.size()];
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int32_t> chosen(all.begin(), all.begin() + count[t]);
        std::sort(chosen.begin(), chosen.end());
        std::copy(chosen.begin(), chosen.end(), positions.begin() + static_cast<size_t>(t) * stride);
      }
      const std::vector<float> q = Random(static_cast<size_t>(T) * NH * D, rng);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      std::vector<int32_t> first(T, 0), offset(T, 0);
      DeviceArray<float> d_q = ToDevice(q), d_out, d_ws;
      DeviceArray<int32_t> d_pos = ToDevice(pos), d_first = ToDevice(first), d_offset = ToDevice(offset),
                           d_tables = ToDevice(table), d_positions = ToDevice(positions), d_count = ToDevice(count);
      ASSERT_TRUE(d_out.Reserve(static_cast<size_t>(T) * NH * D).ok());
      const size_t ws = QsaAttentionWorkspaceFloats(T, NH, KV, D, stride);
      ASSERT_TRUE(d_ws.Reserve(std::max<size_t>(ws, 1)).ok());
      const AttentionTokens tokens{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), bs};
      ASSERT_TRUE(QsaAttention(d_q.get(), d_cache.get(), tokens, d_positions.get(), d_count.get(), stride, T, NH, KV, D,
                               scale, d_out.get(), d_ws.get(), ws, nullptr)
                      .ok());
      const std::vector<float> got = ToHost(d_out, static_cast<size_t>(T) * NH * D);
      std::vector<float> want(got.size());
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < NH; ++h) {
          const int g = h / (NH / KV);
          const float* qh = &q[(static_cast<size_t>(t) * NH + h) * D];
          std::vector<double> p(count[t]);
          double most = -INFINITY, total = 0;
          for (int i = 0; i < count[t]; ++i) {
            const KvHalf* row = &cache[static_cast<size_t>(slot[positions[static_cast<size_t>(t) * stride + i]]) * 2 * kvf];
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += static_cast<double>(qh[d]) * HalfToFloat(row[g * D + d]);
            p[i] = dot * scale;
            most = std::max(most, p[i]);
          }
          for (double& x : p) total += (x = std::exp(x - most));
          for (int d = 0; d < D; ++d) {
            double acc = 0;
            for (int i = 0; i < count[t]; ++i) {
              const KvHalf* row =
                  &cache[static_cast<size_t>(slot[positions[static_cast<size_t>(t) * stride + i]]) * 2 * kvf];
              acc += p[i] * HalfToFloat(row[kvf + g * D + d]);
            }
            want[(static_cast<size_t>(t) * NH + h) * D + d] = static_cast<float>(acc / total);
          }
        }
      const double e = RelativeError(got, want);
      std::printf("qsa attention %d heads / %d KV heads of %d, %d tokens from %d positions (workspace %zu floats): "
                  "rel %.2e\n", NH, KV, D, T, count[0], ws, e);
      EXPECT_LT(e, 2e-5) << NH << "/" << KV << " heads of " << D << ", " << T << " tokens";
    }
}

TEST(QsaKernelsTest, BadShapesAreRefused) {
  REQUIRE_GPU();
  const AttentionTokens tokens;
  EXPECT_FALSE(QsaBlockScores(nullptr, nullptr, tokens, QsaIndexerShape{8, 512, 4, 1e-6f}, nullptr, nullptr, nullptr,
                              8, 1, nullptr, 4, nullptr)
                   .ok());
  EXPECT_FALSE(QsaBlockScores(nullptr, nullptr, tokens, QsaIndexerShape{8, 32, 4, 1e-6f}, nullptr, nullptr, nullptr,
                              17, 1, nullptr, 4, nullptr)
                   .ok())
      << "rotary dims past the head";
  EXPECT_FALSE(QsaAttention(nullptr, nullptr, tokens, nullptr, nullptr, 64, 1, 16, 2, kQsaMaxHeadDim + 1, 1.0f,
                            nullptr, nullptr, 0, nullptr)
                   .ok());
  EXPECT_FALSE(QsaAttention(nullptr, nullptr, tokens, nullptr, nullptr, 64, 1, 3, 2, 128, 1.0f, nullptr, nullptr, 0,
                            nullptr)
                   .ok());
  EXPECT_FALSE(QsaAttention(nullptr, nullptr, tokens, nullptr, nullptr, 64, 1, 6, 2, 128, 1.0f, nullptr, nullptr, 0,
                            nullptr)
                   .ok())
      << "3 heads a KV head";
  EXPECT_FALSE(QsaAttention(nullptr, nullptr, tokens, nullptr, nullptr, 2048, 1, 16, 2, 128, 1.0f, nullptr, nullptr, 0,
                            nullptr)
                   .ok())
      << "a split step without its workspace";
  // 0 tokens launch nothing.
  EXPECT_TRUE(QsaAttention(nullptr, nullptr, tokens, nullptr, nullptr, 64, 0, 16, 2, 128, 1.0f, nullptr, nullptr, 0,
                           nullptr)
                  .ok());
  EXPECT_TRUE(QsaSplitIndexer(nullptr, nullptr, 0, 8, 32, nullptr, nullptr, nullptr).ok());
}


// The fixture's QSA layer through the kind (LoadLayer, AllocateCache, Reserve, PackStep, BindStep,
// Forward) against the CPU layer on the same random inputs, step by step.
TEST(QsaMixerTest, LayerMatchesTheCpuThroughPrefillDecodePrefill) {
  REQUIRE_GPU();
  auto loaded = LoadModelConfig(kFixture);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const ModelConfig& cfg = *loaded;
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  int layer = -1;
  for (int l = 0; l < cfg.num_layers; ++l)
    if (!cfg.IsLinearAttentionLayer(l)) layer = l;
  ASSERT_GE(layer, 0) << "the fixture has a QSA layer";
  const int H = cfg.hidden_size, m = cfg.qwen4exp->indexer.compress_ratio, topk = cfg.qwen4exp->indexer.block_topk();
  auto cpu = QsaAttention::Load(cfg, **src, layer);
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{handle, &workspace, nullptr};
  std::unique_ptr<CudaMixerKind> kind = MakeQsaKind(cfg, ctx);
  auto gpu = kind->LoadLayer(**src, layer);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  KvCacheShape shape;
  shape.block_size = 16;
  shape.num_blocks = 40;
  const int bs = shape.block_size, kSeqs = 4, kBlocksPerSeq = 10;
  std::vector<KvLayerShape> cpu_layers(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) cpu_layers[l] = {cfg.KvWidth(l), cfg.KvBlockFloats(l, bs)};
  PagedKvCache cpu_cache(std::move(cpu_layers), shape);
  ASSERT_TRUE(kind->AllocateCache(shape, nullptr).ok());
  // The kind does not split its attention: the facts as CudaMixers::split_shape lays them out then.
  ASSERT_EQ(kind->split_shape().blocks_per_token, 0);
  StepFacts facts(cfg, SplitShape{1}, /*sm_count=*/8, /*tensor_core_prefill=*/true);
  facts.SetCache(shape);
  CpuCompute compute(2);

  std::mt19937 rng(31);
  std::vector<int32_t> blocks(shape.num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<std::vector<int32_t>> tables(kSeqs);
  for (int s = 0; s < kSeqs; ++s)
    tables[s].assign(blocks.begin() + s * kBlocksPerSeq, blocks.begin() + (s + 1) * kBlocksPerSeq);
  // Prefills ending inside a block, on its last position and just past it; beyond the kept blocks
  // (topk · m) and long; decodes crossing block edges; a second prefill beside decoding tokens.
  const std::vector<std::vector<NextChunk>> steps = {
      {{0, m - 1}, {1, m}, {2, m + 1}, {3, (topk + 5) * m + 3}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{0, 3 * m + 2}, {1, (topk + 2) * m}, {2, 1}, {3, 2 * m - 1}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{2, 7 * m + 2}, {0, 1}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}}};
  std::vector<int> next_position(kSeqs, 0);
  int step_index = 0;
  for (const std::vector<NextChunk>& chunks : steps) {
    SCOPED_TRACE(absl::StrCat("step ", step_index));
    const StepBatch batch = NextChunks(chunks, tables, &next_position);
    StepTokens tokens;
    ASSERT_TRUE(FlattenStep(batch, cfg.vocab_size, shape, cfg.max_position_embeddings, &tokens).ok());
    const int T = tokens.num_tokens;
    const std::vector<float> x = Random(static_cast<size_t>(T) * H, rng);
    std::vector<float> want(x.size());
    AttentionCarry carry;
    ASSERT_TRUE((*cpu)->Forward(x.data(), tokens, cpu_cache, carry, want.data(), compute).ok());

    ASSERT_TRUE(facts.Pack(tokens, StepLayout{T, 0, 0}).ok());
    ASSERT_TRUE(kind->PackStep(tokens, T, &facts.host()).ok());
    DeviceArray<int32_t> d_facts;
    auto step = facts.Upload(&d_facts, nullptr);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE(kind->BindStep(**step, tokens, d_facts.get(), nullptr).ok());
    bool moved = false;
    ASSERT_TRUE(kind->Reserve(T, (*step)->splits, &moved).ok());
    DeviceArray<float> d_x = ToDevice(x), d_out;
    ASSERT_TRUE(d_out.Reserve(x.size()).ok());
    const absl::Status st = (*gpu)->Forward(**step, d_x.get(), 0, T, d_out.get());
    ASSERT_TRUE(st.ok()) << st;
    const std::vector<float> got = ToHost(d_out, x.size());
    double worst = 0;
    int worst_t = 0;
    for (int t = 0; t < T; ++t) {
      const size_t b = static_cast<size_t>(t) * H;
      const double e = RelativeError(std::vector<float>(got.begin() + b, got.begin() + b + H),
                                     std::vector<float>(want.begin() + b, want.begin() + b + H));
      if (!(e <= worst)) worst = e, worst_t = t;
    }
    const double rel = RelativeError(got, want);
    std::printf("qsa layer %d step %d (%d tokens): rel %.2e, worst token %d (position %d) %.2e\n", layer, step_index,
                T, rel, worst_t, tokens.positions[worst_t], worst);
    // The GPU caches keys and values in fp16 (the CPU in fp32): ~5e-4 relative. A token whose
    // selection differed would stray by far more.
    EXPECT_LT(rel, 3e-3);
    EXPECT_LT(worst, 6e-3) << "token " << worst_t << " (position " << tokens.positions[worst_t] << ")";
    ++step_index;
  }
  // The kind runs any rows of a step (two micro-batches with remote experts).
  EXPECT_TRUE(kind->rows_split());
  cublasDestroy(handle);
}

}  // namespace
}  // namespace exl3::engine::cuda

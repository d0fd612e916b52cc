// GLM-5.3-Flash's KDA layer on the GPU (engine/cuda/cuda_kimi_delta_attention.h, its kernels
// engine/cuda/kda_kernels.h and the chunk table of engine/cuda/recurrent_layer_states.h) against
// the CPU: the delta-rule kernel against engine/cpu/linear_attention/kimi_delta_rule.h's recurrent form (and its chunked
// form) on random inputs up to GLM-5.3-Flash's head dim of 128; then the layer against the CPU
// layer (engine/cpu/linear_attention/kimi_delta_attention.h) on the glm5_next fixtures' KDA layers with fresh random
// inputs through prefill, decode and prefill again, several sequences per step, chunks of 1, 3
// (shorter than the conv window), 63, 64, 65 and 130 tokens (the CPU's chunked form's edges),
// decode steps padded as a decode graph pads them, each step run as two calls (as two micro-batches
// do), outputs and the stored states compared, with the forget gate's lower bound and without.
// Lines "kda ..." give every comparison. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/cuda_kimi_delta_attention.h"
#include "engine/cuda/kda_kernels.h"
#include "engine/cuda/recurrent_layer_states.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/linear_attention/kimi_delta_attention.h"
#include "engine/cpu/linear_attention/kimi_delta_rule.h"
#include "engine/config/model_config.h"
#include "engine/cpu/rms_norm.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// The delta-rule kernel against engine/cpu/linear_attention/kimi_delta_rule.h.

TEST(KdaKernelsTest, DeltaRuleMatchesTheCpuRecurrentForm) {
  REQUIRE_GPU();
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  // Chunk lengths: one decode token, a short run, the chunked form's edges, two chunks and more.
  const std::vector<int> lengths = {1, 5, 63, 64, 65, 130};
  for (const int D : {32, 64, 100, 128}) {
    const KdaDims dims{/*num_heads=*/2, D, /*conv_kernel=*/4};
    ASSERT_TRUE(CheckKdaDims(dims).ok());
    const int NH = dims.num_heads, W = dims.width(), C = dims.conv_channels();
    int T = 0;
    for (int n : lengths) T += n;
    // q, k L2-normalised (q scaled), v as the conv leaves them; the log-decay in (-5, 0) as the
    // bounded gate gives it; β in (0, 1).
    std::vector<float> conv_out = Random(static_cast<size_t>(T) * C, rng);
    for (int t = 0; t < T; ++t) {
      float* row = &conv_out[static_cast<size_t>(t) * C];
      for (int h = 0; h < NH; ++h) {
        L2NormalizeInPlace(row + h * D, D);
        L2NormalizeInPlace(row + W + h * D, D);
        for (int i = 0; i < D; ++i) row[h * D + i] *= 1.0f / std::sqrt(static_cast<float>(D));
      }
    }
    std::vector<float> log_decay(static_cast<size_t>(T) * W), beta(static_cast<size_t>(T) * NH);
    for (float& g : log_decay) g = -5.0f * unit(rng) * unit(rng);  // many near 0, some strong
    for (float& b : beta) b = unit(rng);
    // A store of two rows per chunk (read 2i, write 2i + 1), the read rows random.
    const int64_t row_floats = dims.conv_state_floats() + static_cast<int64_t>(NH) * D * D;
    const int chunks = static_cast<int>(lengths.size());
    std::vector<float> store = Random(static_cast<size_t>(2 * chunks) * row_floats, rng, 0.5f);
    std::vector<int32_t> chunk_of, table;
    int first = 0;
    for (int c = 0; c < chunks; ++c) {
      table.insert(table.end(), {first, lengths[c], 2 * c, 2 * c + 1, /*kept states=*/1, /*slot row=*/2 * c});
      for (int j = 0; j < lengths[c]; ++j) chunk_of.push_back(c);
      first += lengths[c];
    }
    DeviceArray<float> d_conv = ToDevice(conv_out), d_decay = ToDevice(log_decay),
                       d_beta = ToDevice(beta), d_store = ToDevice(store), d_core;
    DeviceArray<int32_t> d_chunk_of = ToDevice(chunk_of), d_table = ToDevice(table);
    ASSERT_TRUE(d_core.Reserve(static_cast<size_t>(T) * W).ok());
    RecurrentChunks rc{d_chunk_of.get(), d_table.get(), d_store.get(), row_floats};
    ASSERT_TRUE(KdaRecurrence(d_conv.get(), d_decay.get(), d_beta.get(), dims, rc, 0, chunks,
                              d_core.get(), nullptr)
                    .ok());
    const std::vector<float> core = ToHost(d_core, static_cast<size_t>(T) * W);
    const std::vector<float> got_store = ToHost(d_store, store.size());

    for (int c = 0; c < chunks; ++c) {
      const int f = table[c * kRecurrentChunkInts], n = lengths[c];
      std::vector<float> want_o(static_cast<size_t>(n) * W), chunked_o(want_o.size()),
          got_o(want_o.size()), want_s, chunked_s, got_s;
      for (int h = 0; h < NH; ++h) {
        const size_t head = dims.conv_state_floats() + static_cast<size_t>(h) * D * D;
        const float* s0 = &store[static_cast<size_t>(2 * c) * row_floats + head];
        std::vector<float> S(s0, s0 + D * D), S2 = S;
        KdaHeadInputs in;
        in.q = &conv_out[static_cast<size_t>(f) * C + h * D];
        in.k = &conv_out[static_cast<size_t>(f) * C + W + h * D];
        in.v = &conv_out[static_cast<size_t>(f) * C + 2 * W + h * D];
        in.g = &log_decay[static_cast<size_t>(f) * W + h * D];
        in.beta = &beta[static_cast<size_t>(f) * NH + h];
        in.qk_stride = in.v_stride = C;
        in.g_stride = W;
        in.beta_stride = NH;
        in.key_dim = in.value_dim = D;
        KdaRecurrent(in, n, S.data(), &want_o[h * D], W);
        KdaChunked(in, n, KimiDeltaAttention::kChunkSize, S2.data(), &chunked_o[h * D], W);
        want_s.insert(want_s.end(), S.begin(), S.end());
        chunked_s.insert(chunked_s.end(), S2.begin(), S2.end());
        const float* g = &got_store[static_cast<size_t>(2 * c + 1) * row_floats + head];
        got_s.insert(got_s.end(), g, g + D * D);
      }
      std::copy_n(&core[static_cast<size_t>(f) * W], got_o.size(), got_o.begin());
      const double out_rel = RelativeError(got_o, want_o), state_rel = RelativeError(got_s, want_s);
      const double chunked_out = RelativeError(got_o, chunked_o), chunked_state = RelativeError(got_s, chunked_s);
      std::printf(
          "kda delta rule D %d chunk %d: against the recurrent form out rel %.2e state rel %.2e; "
          "against the chunked form out rel %.2e state rel %.2e\n",
          D, n, out_rel, state_rel, chunked_out, chunked_state);
      // The kernel runs the recurrent form in fp32 with its sums split over eight lanes: well
      // within 1e-5. The chunked form reorders the arithmetic further: 1e-4.
      EXPECT_LT(out_rel, 1e-5) << "D " << D << " chunk " << n;
      EXPECT_LT(state_rel, 1e-5) << "D " << D << " chunk " << n;
      EXPECT_LT(chunked_out, 1e-4) << "D " << D << " chunk " << n;
      EXPECT_LT(chunked_state, 1e-4) << "D " << D << " chunk " << n;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The convolution (KdaConv) against its formula at prefill sizes.

// conv_out [T, C] of chunks of `lengths` (rows in order, chunk c reading store row 2c) on the host:
// silu(Σ_i w[ch, i] · u(j + i, ch)), u(m) the chunk's conv state row m for m < K − 1, else its token
// m − (K − 1) (engine/cpu/linear_attention/kimi_delta_attention.cc's convolution).
std::vector<float> ConvReference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                 const std::vector<float>& w, const std::vector<float>& store, int64_t row_floats,
                                 const KdaDims& dims, const std::vector<int>& lengths) {
  const int K = dims.conv_kernel, W = dims.width(), C = dims.conv_channels();
  int T = 0;
  for (int n : lengths) T += n;
  std::vector<float> out(static_cast<size_t>(T) * C);
  int first = 0;
  for (size_t c = 0; c < lengths.size(); ++c) {
    const float* prev = &store[2 * c * row_floats];
    for (int ch = 0; ch < C; ++ch) {
      const std::vector<float>& proj = ch < W ? q : ch < 2 * W ? k : v;
      auto input = [&](int m) {
        return m < K - 1 ? prev[static_cast<size_t>(m) * C + ch]
                         : proj[static_cast<size_t>(first + m - (K - 1)) * W + ch % W];
      };
      for (int j = 0; j < lengths[c]; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) acc += w[static_cast<size_t>(ch) * K + i] * input(j + i);
        out[static_cast<size_t>(first + j) * C + ch] = acc / (1.0f + std::exp(-acc));
      }
    }
    first += lengths[c];
  }
  return out;
}

// T = 1, 7, 64, 1024 and 33 (one past a 32-token run of the kernel) in chunks of several lengths
// (1 to 3: shorter than the window, so a token reads the conv state and earlier tokens; chunks
// that start inside a run), launched as two calls split at a chunk boundary; conv kernels of 2 to 4
// (the run kernel) and 5 (the one-thread-a-token kernel); channels not a multiple of a block's.
TEST(KdaKernelsTest, ConvMatchesTheFormulaAtPrefillSizes) {
  REQUIRE_GPU();
  std::mt19937 rng(37);
  struct Case {
    int K, T;
  };
  const std::vector<Case> cases = {{4, 1}, {4, 7}, {4, 33}, {4, 64}, {4, 1024}, {2, 64}, {3, 7}, {3, 100}, {5, 64}};
  for (const Case& cs : cases) {
    const KdaDims dims{/*num_heads=*/3, /*head_dim=*/40, cs.K};
    ASSERT_TRUE(CheckKdaDims(dims).ok());
    const int W = dims.width(), C = dims.conv_channels(), T = cs.T;
    std::vector<int> lengths;
    int left = T;
    for (int n : {1, 2, 3, 29, 5, 40, 1}) {
      if (left == 0) break;
      lengths.push_back(std::min(n, left));
      left -= lengths.back();
    }
    if (left > 0) lengths.push_back(left);
    const int chunks = static_cast<int>(lengths.size());
    const int64_t row_floats = dims.conv_state_floats() + 7;
    const std::vector<float> q = Random(static_cast<size_t>(T) * W, rng), k = Random(q.size(), rng),
                             v = Random(q.size(), rng), w = Random(static_cast<size_t>(C) * cs.K, rng, 0.5f),
                             store = Random(static_cast<size_t>(2 * chunks) * row_floats, rng);
    std::vector<int32_t> chunk_of, table;
    int first = 0, split = 0;
    for (int c = 0; c < chunks; ++c) {
      table.insert(table.end(), {first, lengths[c], 2 * c, 2 * c + 1, /*kept states=*/1, /*slot row=*/2 * c});
      for (int j = 0; j < lengths[c]; ++j) chunk_of.push_back(c);
      first += lengths[c];
      if (c == chunks / 2 - 1) split = first;
    }
    DeviceArray<float> d_q = ToDevice(q), d_k = ToDevice(k), d_v = ToDevice(v), d_w = ToDevice(w),
                       d_store = ToDevice(store), d_out = ToDevice(std::vector<float>(static_cast<size_t>(T) * C, NAN));
    DeviceArray<int32_t> d_chunk_of = ToDevice(chunk_of), d_table = ToDevice(table);
    const RecurrentChunks rc{d_chunk_of.get(), d_table.get(), d_store.get(), row_floats};
    for (const auto& [f, n] : {std::pair<int, int>{0, split}, std::pair<int, int>{split, T - split}})
      ASSERT_TRUE(KdaConv(d_q.get(), d_k.get(), d_v.get(), d_w.get(), dims, rc, f, n, d_out.get(), nullptr).ok());
    const std::vector<float> got = ToHost(d_out, static_cast<size_t>(T) * C);
    const std::vector<float> want = ConvReference(q, k, v, w, store, row_floats, dims, lengths);
    const double rel = RelativeError(got, want);
    std::printf("kda conv K %d T %4d (%d chunks, split at row %d): rel %.2e\n", cs.K, T, chunks, split, rel);
    EXPECT_LT(rel, 1e-6) << "K " << cs.K << " T " << T;
  }
}

// ---------------------------------------------------------------------------------------------
// The layer against the CPU layer.

enum class Gate { kLowerBounded, kSoftplus };

struct LayerCase {
  const char* fixture;  // under tests/fixtures/engine
  Gate gate;
  double bound;
};

std::string CaseName(const LayerCase& c) {
  return std::string(c.fixture) + (c.gate == Gate::kLowerBounded ? "/lower-bound" : "/softplus");
}

class KdaLayerTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(KdaLayerTest, MatchesTheCpuLayerThroughPrefillDecodePrefill) {
  REQUIRE_GPU();
  const LayerCase& lc = GetParam();
  const std::string name = CaseName(lc);
  const std::string dir = std::string("tests/fixtures/engine/") + lc.fixture;
  auto cfg = LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->glm5next, nullptr);
  // The fixtures are made with linear_lower_bound -5; the other form by editing the config (both
  // layers read the gate from cfg.glm5next at load).
  ASSERT_TRUE(cfg->glm5next->gate_lower_bound.has_value());
  if (lc.gate == Gate::kSoftplus) {
    auto g = std::make_shared<Glm5NextConfig>(*cfg->glm5next);
    g->gate_lower_bound.reset();
    cfg->glm5next = g;
  }
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  std::vector<int> layers;
  for (int l = 0; l < cfg->num_layers; ++l)
    if (cfg->IsLinearAttentionLayer(l)) layers.push_back(l);
  ASSERT_FALSE(layers.empty());

  constexpr int kSlots = 6, kBlockSize = 16, kBlocksPerSequence = 16, kPaddingRows = 2;
  auto floats = StateFloatsPerLayer(*cfg, kSlots);
  ASSERT_TRUE(floats.ok()) << floats.status();
  auto cpu_states = SequenceStateStore::Create(*floats, kSlots);
  ASSERT_TRUE(cpu_states.ok()) << cpu_states.status();
  RecurrentLayerStates gpu_states;
  ASSERT_TRUE(gpu_states.Allocate(*cfg, kSlots).ok());
  std::vector<std::unique_ptr<KimiDeltaAttention>> cpu;
  std::vector<std::unique_ptr<CudaKimiDeltaAttention>> gpu;
  for (int l : layers) {
    auto c = KimiDeltaAttention::Load(*cfg, **src, l);
    ASSERT_TRUE(c.ok()) << c.status();
    cpu.push_back(std::move(*c));
    auto g = CudaKimiDeltaAttention::Load(*cfg, **src, l, RecurrentLayerStates::StateOffset(*cfg, l));
    ASSERT_TRUE(g.ok()) << g.status();
    gpu.push_back(std::move(*g));
  }
  CpuCompute compute(2);
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{handle, &workspace, nullptr};
  KdaWorkspace ws;
  const int H = cfg->hidden_size;
  std::mt19937 rng(31);

  // Per step: (sequence, tokens) chunks. Six sequences prefill with chunks of 1, 3, 63, 64, 65 and
  // 130 tokens, decode, prefill again with the lengths the other way round, decode again.
  struct StepPlan {
    const char* phase;
    bool padded;  // run as a decode graph runs it: padding rows after the tokens
    std::vector<std::pair<int, int>> chunks;
  };
  const std::vector<StepPlan> steps = {
      {"prefill", false, {{0, 1}, {1, 3}, {2, 63}, {3, 64}, {4, 65}, {5, 130}}},
      {"decode", true, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}}},
      {"prefill-again", false, {{0, 130}, {1, 65}, {2, 64}, {3, 63}, {4, 3}, {5, 1}}},
      {"decode-again", true, {{5, 1}, {3, 1}, {1, 1}, {0, 1}, {2, 1}, {4, 1}}},
  };
  std::map<int, int> position;
  for (size_t s = 0; s < steps.size(); ++s) {
    const StepPlan& plan = steps[s];
    StepBatch batch;
    for (const auto& [seq, n] : plan.chunks) {
      SequenceChunk c;
      c.sequence_id = seq;
      c.tokens.assign(n, 1);
      c.start_position = position[seq];
      for (int b = 0; b < kBlocksPerSequence; ++b) c.block_table.push_back(seq * kBlocksPerSequence + b);
      c.state_slot = seq;
      c.wants_logits = true;
      position[seq] += n;
      batch.chunks.push_back(std::move(c));
    }
    StepTokens tokens;
    ASSERT_TRUE(FlattenStep(batch, cfg->vocab_size,
                            KvCacheShape{kSlots * kBlocksPerSequence, kBlockSize, kSlots},
                            cfg->max_position_embeddings, &tokens)
                    .ok());
    const int T = tokens.num_tokens;
    // Padding rows get random inputs; their chunks read the store's zero row and write its spare
    // row, which no real slot sees.
    const int rows = plan.padded ? T + kPaddingRows : T;
    ASSERT_TRUE((*cpu_states)->BeginStep(batch).ok());
    ASSERT_TRUE(gpu_states.BeginStep(batch, nullptr).ok());
    std::vector<int32_t> facts;
    ASSERT_TRUE(gpu_states.Pack(tokens, rows, &facts).ok());
    DeviceArray<int32_t> d_facts = ToDevice(facts);
    gpu_states.Bind(rows, d_facts.get());
    bool moved = false;
    ASSERT_TRUE(ws.Reserve(cfg->linear_attention, rows, &moved).ok());
    // Two calls, split where the fourth chunk starts (two micro-batches' rows).
    const int split = batch.chunks.size() > 3 ? [&] {
      int f = 0;
      for (int c = 0; c < 3; ++c) f += static_cast<int>(batch.chunks[c].tokens.size());
      return f;
    }() : 0;

    for (size_t li = 0; li < layers.size(); ++li) {
      const int layer = layers[li];
      const std::vector<float> x = Random(static_cast<size_t>(rows) * H, rng);
      std::vector<float> want(static_cast<size_t>(T) * H);
      ASSERT_TRUE(cpu[li]->Forward(x.data(), tokens, **cpu_states, want.data(), compute).ok());
      DeviceArray<float> d_x = ToDevice(x), d_out;
      ASSERT_TRUE(d_out.Reserve(x.size()).ok());
      for (const auto& [first, n] : {std::pair<int, int>{0, split}, std::pair<int, int>{split, rows - split}}) {
        const absl::Status st =
            gpu[li]->Forward(d_x.get(), first, n, gpu_states.StepFor(first, n), ws, ctx, d_out.get());
        ASSERT_TRUE(st.ok()) << st;
      }
      const std::vector<float> got = ToHost(d_out, static_cast<size_t>(T) * H);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

      // Per chunk: its rows' outputs, and the state it wrote (the other copy, current after the
      // commit below) against the CPU's next copy.
      const DeviceSequenceStates& store = *gpu_states.store();
      const int64_t state_floats = cfg->StateFloats(layer);
      const int64_t offset = RecurrentLayerStates::StateOffset(*cfg, layer);
      double out_worst = 0, state_worst = 0;
      int first = 0;
      for (const SequenceChunk& c : batch.chunks) {
        const int n = static_cast<int>(c.tokens.size());
        const size_t b = static_cast<size_t>(first) * H, e = static_cast<size_t>(first + n) * H;
        const double out_rel = RelativeError(std::vector<float>(got.begin() + b, got.begin() + e),
                                             std::vector<float>(want.begin() + b, want.begin() + e));
        const float* cs = (*cpu_states)->Next(layer, c.state_slot);
        const std::vector<float> gs =
            ToHost(store.layer(0) + static_cast<size_t>(store.WriteRow(c.state_slot)) * store.row_floats() + offset,
                   static_cast<size_t>(state_floats));
        const double state_rel = RelativeError(gs, std::vector<float>(cs, cs + state_floats));
        std::printf("kda %s layer %d step %zu %s sequence %d chunk %d: out rel %.2e state rel %.2e\n", name.c_str(),
                    layer, s, plan.phase, static_cast<int>(c.sequence_id), n, out_rel, state_rel);
        EXPECT_LT(out_rel, lc.bound) << "step " << s << " sequence " << c.sequence_id;
        EXPECT_LT(state_rel, lc.bound) << "step " << s << " sequence " << c.sequence_id;
        out_worst = std::max(out_worst, out_rel);
        state_worst = std::max(state_worst, state_rel);
        first += n;
      }
      const double step_rel = RelativeError(got, want);
      std::printf("kda %s layer %d step %zu %s (%d tokens, %d rows): out rel %.2e (worst chunk %.2e), state rel "
                  "(worst chunk) %.2e\n",
                  name.c_str(), layer, s, plan.phase, T, rows, step_rel, out_worst, state_worst);
      EXPECT_LT(step_rel, lc.bound) << "step " << s;
    }
    (*cpu_states)->CommitStep(batch);
    gpu_states.CommitStep(batch);
  }
  cublasDestroy(handle);
}

// The experts fixture's KDA projections are bf16 (dense on both engines, fp32 sums): the comparison
// is of the kernels' arithmetic and the CPU's chunked form against the GPU's recurrent one, 1e-4.
// The all fixture's are EXL3, decoded by each engine's own kernels: 5e-3, the bound the other
// fixture layer tests (tests/engine/cuda/latent_attention_test.cc) use for EXL3 layers.
INSTANTIATE_TEST_SUITE_P(Fixtures, KdaLayerTest,
                         ::testing::Values(LayerCase{"glm5_next_experts", Gate::kLowerBounded, 1e-4},
                                           LayerCase{"glm5_next_experts", Gate::kSoftplus, 1e-4},
                                           LayerCase{"glm5_next_all", Gate::kLowerBounded, 5e-3},
                                           LayerCase{"glm5_next_all", Gate::kSoftplus, 5e-3}),
                         [](const ::testing::TestParamInfo<LayerCase>& info) {
                           std::string n = CaseName(info.param);
                           std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(ch); }, '_');
                           return n;
                         });

}  // namespace
}  // namespace exl3::engine::cuda

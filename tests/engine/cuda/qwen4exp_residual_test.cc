// Qwen4-Exp's gated residual stream on the GPU against the CPU engine's engine/cpu/residual/gated_residual.h on
// random inputs: one connection (engine/cuda/gated_connection.h and its kernels) at the fixture's
// shape and at synthetic ones (a full-size 4 × 2048, odd sizes, one stream, one token, 0 tokens),
// the head's mixer over logit rows out of order; then the whole stream through the ResidualStream
// interface (engine/cuda/gated_residual_stream.h) over the fixture's layers with random block
// outputs, in two row ranges as two micro-batches run it; the PLE layer (engine/cuda/cuda_ple_layer.h)
// through prefill, decode and prefill again. Each comparison prints a "qwen4 ..." line
// with the relative error and the worst element. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/cuda_ple_layer.h"
#include "engine/cuda/device_sequence_states.h"
#include "engine/cuda/gated_connection.h"
#include "engine/cuda/gated_residual_kernels.h"
#include "engine/cuda/ple_windows.h"
#include "engine/cuda/recurrent_layer_states.h"
#include "engine/cuda/load_residual_stream.h"
#include "engine/cuda/residual_stream.h"
#include "engine/cpu/residual/gated_residual.h"
#include "engine/config/model_config.h"
#include "engine/cpu/residual/ple_layer.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/moe_config.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFixture = "tests/fixtures/engine/qwen4_exp_experts";

// The relative error of got against want, printed with the worst element's index and values.
double Compare(const char* what, const std::string& where, const std::vector<float>& got,
               const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size()) << what << " " << where;
  size_t worst = 0;
  double worst_diff = -1;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (diff > worst_diff || std::isnan(diff)) {
      worst_diff = diff;
      worst = i;
      if (std::isnan(diff)) break;
    }
  }
  const double rel = RelativeError(got, want);
  std::printf("qwen4 %s %s: rel %.2e, worst at %zu (gpu %.7g cpu %.7g)\n", what, where.c_str(), rel, worst,
              got.empty() ? 0.0 : got[worst], want.empty() ? 0.0 : want[worst]);
  return rel;
}

struct Cublas {
  Cublas() { EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS); }
  ~Cublas() { cublasDestroy(handle); }
  cublasHandle_t handle = nullptr;
};

// A connection's tensors of `shape`, random, written to a file of its own.
std::string WriteRandomConnection(const GatedResidualShape& shape, bool with_inject, std::mt19937& rng) {
  const int64_t wide = static_cast<int64_t>(shape.streams) * shape.hidden;
  SafetensorsWriter w;
  const std::vector<float> norm = Random(wide, rng, 0.3f);
  const std::vector<float> down = Random(wide * shape.lowrank, rng, 1.0f / std::sqrt(static_cast<float>(wide)));
  const std::vector<float> up = Random(wide * shape.lowrank, rng, 2.0f / std::sqrt(static_cast<float>(shape.lowrank)));
  const std::vector<float> inject = Random(wide * shape.streams, rng, 4.0f / std::sqrt(static_cast<float>(wide)));
  w.AddF32("c.hc_norm.weight", {wide}, norm.data());
  w.AddF32("c.input_mix_weight_down.weight", {shape.lowrank, wide}, down.data());
  w.AddF32("c.input_mix_weight_up.weight", {wide, shape.lowrank}, up.data());
  if (with_inject) w.AddF32("c.block_inject_weight.weight", {shape.streams, wide}, inject.data());
  const std::string path = (fs::temp_directory_path() /
                            ("qwen4exp_residual_test_" + std::to_string(::getpid()) + "_" +
                             std::to_string(shape.streams) + "x" + std::to_string(shape.hidden) + ".safetensors"))
                               .string();
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

// Collapse (x, inject) and expand of one connection on T random tokens, GPU against CPU; rows: the
// tokens' rows in h when not null (the head's gather), else 0..T-1.
void CheckConnection(const TensorSource& src, const std::string& prefix, const GatedResidualShape& shape,
                     bool with_inject, int T, const std::vector<int>* rows, std::mt19937& rng, const std::string& name) {
  auto cpu = GatedResidual::Load(src, prefix, shape, with_inject);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = CudaGatedConnection::Load(src, prefix, shape, with_inject);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_EQ(gpu->with_inject(), with_inject);
  const int S = shape.streams, H = shape.hidden;
  const size_t wide = static_cast<size_t>(S) * H;
  Cublas cublas;
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{cublas.handle, &workspace, nullptr};
  GatedConnectionWorkspace ws;
  bool moved = false;
  ASSERT_TRUE(ws.Reserve(shape, T, &moved).ok());
  if (T == 0) {  // launches nothing, touches nothing
    EXPECT_TRUE(gpu->Collapse(nullptr, nullptr, 0, ws, nullptr, nullptr, ctx).ok());
    EXPECT_TRUE(gpu->Expand(nullptr, nullptr, 0, nullptr, nullptr).ok() == with_inject);
    return;
  }
  const int h_rows = rows != nullptr ? *std::max_element(rows->begin(), rows->end()) + 1 : T;
  std::vector<float> h = Random(static_cast<size_t>(h_rows) * wide, rng, 2.0f);
  // The CPU collapses the gathered rows.
  std::vector<float> gathered(static_cast<size_t>(T) * wide);
  for (int t = 0; t < T; ++t) {
    const int r = rows != nullptr ? (*rows)[t] : t;
    std::copy_n(h.begin() + static_cast<size_t>(r) * wide, wide, gathered.begin() + static_cast<size_t>(t) * wide);
  }
  CpuCompute compute(2);
  std::vector<float> want_x(static_cast<size_t>(T) * H), want_inject;
  ASSERT_TRUE(cpu->Collapse(gathered.data(), T, want_x.data(), &want_inject, compute).ok());

  DeviceArray<float> d_h = ToDevice(h), d_x, d_inject;
  ASSERT_TRUE(d_x.Reserve(std::max<size_t>(want_x.size(), 1)).ok());
  ASSERT_TRUE(d_inject.Reserve(static_cast<size_t>(std::max(T, 1)) * S).ok());
  DeviceArray<int32_t> d_rows;
  if (rows != nullptr) d_rows = ToDevice(std::vector<int32_t>(rows->begin(), rows->end()));
  ASSERT_TRUE(gpu->Collapse(d_h.get(), rows != nullptr ? d_rows.get() : nullptr, T, ws, d_x.get(),
                            with_inject ? d_inject.get() : nullptr, ctx)
                  .ok());
  const std::string where = name + " " + std::to_string(S) + "x" + std::to_string(H) + " T " + std::to_string(T);
  EXPECT_LT(Compare("collapse x", where, ToHost(d_x, want_x.size()), want_x), 1e-5);
  if (!with_inject) return;
  EXPECT_LT(Compare("collapse inject", where, ToHost(d_inject, want_inject.size()), want_inject), 1e-5);
  // The expand of a random block output, from the CPU's inject weights on both sides (the
  // kernel's arithmetic alone: one product and one sum per value, within an FMA's rounding).
  const std::vector<float> out = Random(static_cast<size_t>(T) * H, rng, 1.5f);
  DeviceArray<float> d_out = ToDevice(out), d_cpu_inject = ToDevice(want_inject), d_g = ToDevice(gathered);
  ASSERT_TRUE(gpu->Expand(d_cpu_inject.get(), d_out.get(), T, d_g.get(), nullptr).ok());
  cpu->Expand(want_inject, out.data(), T, gathered.data());
  const std::vector<float> got = ToHost(d_g, gathered.size());
  EXPECT_LT(Compare("expand", where, got, gathered), 1e-6);
}

TEST(Qwen4ExpResidualTest, FixtureConnectionsMatchTheCpu) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->qwen4exp, nullptr);
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  const GatedResidualShape shape{cfg->hidden_size, cfg->qwen4exp->hc_count, cfg->qwen4exp->hc_lowrank,
                                 cfg->rms_norm_eps};
  std::mt19937 rng(3);
  for (const int T : {1, 29})
    for (const std::string& prefix : {LayerPrefix(cfg->moe, 0) + "attn_hyper_connection.",
                                      LayerPrefix(cfg->moe, 2) + "mlp_hyper_connection."})
      CheckConnection(**src, prefix, shape, true, T, nullptr, rng, prefix);
  // The head's mixer over logit rows out of order, one repeated.
  const std::vector<int> rows = {0, 22, 7, 7, 13};
  CheckConnection(**src, TextModelPrefix(cfg->moe) + "hyper_connection_mixer.", shape, false,
                  static_cast<int>(rows.size()), &rows, rng, "head");
}

TEST(Qwen4ExpResidualTest, SyntheticConnectionsMatchTheCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  struct Case {
    GatedResidualShape shape;
    int tokens;
  };
  // The model's default shape; odd sizes below and above a block of threads; one stream; 0 tokens.
  for (const Case& c : {Case{{2048, 4, 320, 1e-6f}, 3}, Case{{300, 3, 17, 1e-6f}, 29}, Case{{257, 5, 7, 1e-5f}, 1},
                        Case{{64, 1, 8, 1e-6f}, 7}, Case{{128, 4, 32, 1e-6f}, 0}}) {
    const std::string path = WriteRandomConnection(c.shape, true, rng);
    auto src = TensorSource::Open(path);
    ASSERT_TRUE(src.ok()) << src.status();
    CheckConnection(**src, "c.", c.shape, true, c.tokens, nullptr, rng, "synthetic");
    const std::vector<int> rows = {c.tokens + 2, 0, 1};
    CheckConnection(**src, "c.", c.shape, false, 3, &rows, rng, "synthetic head");
    fs::remove(path);
  }
}

TEST(Qwen4ExpResidualTest, BadShapesAreRefused) {
  REQUIRE_GPU();
  EXPECT_FALSE(GatedStreamNorm(nullptr, nullptr, 1, 0, 64, nullptr, 1e-6f, nullptr, nullptr).ok());
  EXPECT_FALSE(GatedStreamMix(nullptr, nullptr, -1, 4, 64, nullptr, nullptr).ok());
  EXPECT_FALSE(GatedExpand(nullptr, nullptr, 1, 4, 0, nullptr, nullptr).ok());
  // 0 tokens launch nothing.
  EXPECT_TRUE(GatedExpand(nullptr, nullptr, 0, 4, 64, nullptr, nullptr).ok());
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  // The fixture's connection read at another shape is refused naming the tensor.
  auto wrong = CudaGatedConnection::Load(**src, "model.language_model.layers.0.attn_hyper_connection.",
                                         GatedResidualShape{128, 4, 16, 1e-6f}, true);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(std::string(wrong.status().message()).find("input_mix_weight_down"), std::string::npos) << wrong.status();
}

// The stream through the interface CudaModel's layer loop calls, against the CPU's connections run
// in the same order (engine/cpu/cpu_model.cc RunGatedResidualLayer): the embeddings broadcast, then per
// layer the mixer input, a random mixer output expanded and the MLP input, a random MLP output
// expanded; the head's input for logit rows out of order. Rows in two ranges [0, 11), [11, T).
TEST(Qwen4ExpResidualTest, StreamMatchesTheCpuThroughTheLayers) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  // The connections alone: the fixture's PLE layer (its own test below) left out of the stream.
  auto without_ple = std::make_shared<Qwen4ExpConfig>(*cfg->qwen4exp);
  without_ple->ple.layers.clear();
  cfg->qwen4exp = without_ple;
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  const int H = cfg->hidden_size, S = cfg->qwen4exp->hc_count, T = 19;
  const GatedResidualShape shape{H, S, cfg->qwen4exp->hc_lowrank, cfg->rms_norm_eps};
  const size_t wide = static_cast<size_t>(S) * H;
  Cublas cublas;
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{cublas.handle, &workspace, nullptr};
  auto stream = LoadResidualStream(*cfg, **src, ctx);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_EQ((*stream)->streams(), S);
  const std::vector<int32_t> logit_rows = {18, 3, 10, 11, 3};
  const int R = static_cast<int>(logit_rows.size());
  bool moved = false;
  ASSERT_TRUE((*stream)->Reserve(T, R, &moved).ok());

  // The embeddings (fp32 in the fixture) of random ids.
  auto emb = (*src)->Get(TextModelPrefix(cfg->moe) + "embed_tokens.weight");
  ASSERT_TRUE(emb.ok()) << emb.status();
  auto table = ToFloat32(*emb);
  ASSERT_TRUE(table.ok()) << table.status();
  std::mt19937 rng(29);
  std::vector<int32_t> ids(T);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % cfg->vocab_size);
  std::vector<float> h(static_cast<size_t>(T) * wide);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k)
      std::copy_n(table->begin() + static_cast<size_t>(ids[t]) * H, H, h.begin() + (static_cast<size_t>(t) * S + k) * H);
  DeviceArray<float> d_table = ToDevice(*table), d_x, d_d;
  DeviceArray<int32_t> d_ids = ToDevice(ids), d_logit_rows = ToDevice(logit_rows);
  ASSERT_TRUE(d_x.Reserve(static_cast<size_t>(T) * H).ok());
  ASSERT_TRUE(d_d.Reserve(static_cast<size_t>(T) * H).ok());
  ASSERT_TRUE((*stream)->Embed(d_table.get(), EmbeddingDType::kF32, d_ids.get(), T, d_x.get()).ok());

  CpuCompute compute(2);
  const int ranges[2][2] = {{0, 11}, {11, T - 11}};
  std::vector<float> x(static_cast<size_t>(T) * H), inject;
  for (int l = 0; l < cfg->num_layers; ++l) {
    const std::string p = LayerPrefix(cfg->moe, l);
    auto attn = GatedResidual::Load(**src, p + "attn_hyper_connection.", shape, true);
    auto mlp = GatedResidual::Load(**src, p + "mlp_hyper_connection.", shape, true);
    ASSERT_TRUE(attn.ok() && mlp.ok());
    const std::string where = "layer " + std::to_string(l);
    for (const auto& r : ranges) ASSERT_TRUE((*stream)->MixerInput(l, r[0], r[1], d_d.get(), d_x.get()).ok());
    ASSERT_TRUE(attn->Collapse(h.data(), T, x.data(), &inject, compute).ok());
    EXPECT_LT(Compare("stream mixer input", where, ToHost(d_x, x.size()), x), 1e-5);
    std::vector<float> out = Random(x.size(), rng, 1.0f);
    ASSERT_TRUE(d_d.Upload(out).ok());
    for (const auto& r : ranges) ASSERT_TRUE((*stream)->MlpInput(l, r[0], r[1], d_d.get(), d_x.get()).ok());
    attn->Expand(inject, out.data(), T, h.data());
    ASSERT_TRUE(mlp->Collapse(h.data(), T, x.data(), &inject, compute).ok());
    EXPECT_LT(Compare("stream mlp input", where, ToHost(d_x, x.size()), x), 1e-5);
    out = Random(x.size(), rng, 1.0f);
    ASSERT_TRUE(d_d.Upload(out).ok());
    for (const auto& r : ranges) ASSERT_TRUE((*stream)->MlpOutput(l, r[0], r[1], d_d.get()).ok());
    mlp->Expand(inject, out.data(), T, h.data());
  }
  auto head = GatedResidual::Load(**src, TextModelPrefix(cfg->moe) + "hyper_connection_mixer.", shape, false);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> rows_h(static_cast<size_t>(R) * wide), want(static_cast<size_t>(R) * H);
  for (int r = 0; r < R; ++r)
    std::copy_n(h.begin() + static_cast<size_t>(logit_rows[r]) * wide, wide, rows_h.begin() + r * wide);
  ASSERT_TRUE(head->Collapse(rows_h.data(), R, want.data(), nullptr, compute).ok());
  DeviceArray<float> d_head;
  ASSERT_TRUE(d_head.Reserve(want.size()).ok());
  ASSERT_TRUE((*stream)->HeadInput(T, d_d.get(), d_logit_rows.get(), R, d_head.get()).ok());
  EXPECT_LT(Compare("stream head input", "", ToHost(d_head, want.size()), want), 1e-5);
}

// The PLE layer (engine/cuda/cuda_ple_layer.h with the host's windows, engine/cuda/ple_windows.h)
// against the CPU layer (engine/cpu/residual/ple_layer.cc) on random residual streams and random token ids,
// through prefill, decode and prefill again: several sequences per step, chunks shorter than the
// context (ngram_size - 1 tokens) and than the conv's carried inputs, long ones; the streams after
// the layer and every slot's carried conv inputs compared after each step.
TEST(Qwen4ExpResidualTest, PleLayerMatchesTheCpuThroughPrefillDecodePrefill) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_FALSE(cfg->qwen4exp->ple.layers.empty()) << "the fixture has a PLE layer";
  const int layer = cfg->qwen4exp->ple.layers.front();
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  auto cpu = PleLayer::Load(*cfg, **src, layer);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = CudaPleLayer::Load(*cfg, **src, layer);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  constexpr int kSlots = 6;
  auto floats = StateFloatsPerLayer(*cfg, kSlots);
  ASSERT_TRUE(floats.ok()) << floats.status();
  auto cpu_states = SequenceStateStore::Create(*floats, kSlots);
  ASSERT_TRUE(cpu_states.ok()) << cpu_states.status();
  RecurrentLayerStates gpu_states;
  ASSERT_TRUE(gpu_states.Allocate(*cfg, kSlots).ok());
  const DeviceSequenceStates* store = gpu_states.store();
  PleWindows windows(cfg->qwen4exp->ple);
  CpuCompute compute(2);
  Cublas cublas;
  exl3::cuda::Workspace workspace;
  const CudaLinearContext ctx{cublas.handle, &workspace, nullptr};
  PleWorkspace ws;
  const int S = cfg->qwen4exp->hc_count, H = cfg->hidden_size, E = (*gpu)->embed_dim();
  const size_t wide = static_cast<size_t>(S) * H;
  // The carried conv inputs within the layer's part of a row: after the DeltaNet's state and the
  // context tokens.
  const int64_t conv_at = cfg->linear_attention.ConvStateFloats() + cfg->linear_attention.RecurrentStateFloats() +
                          cfg->qwen4exp->ple.context_tokens();
  const size_t conv_floats = static_cast<size_t>(cfg->qwen4exp->ple.conv_state_positions()) * wide;
  std::mt19937 rng(41);
  const std::vector<std::vector<std::pair<int, int>>> steps = {
      {{0, 5}, {1, 17}, {2, 1}, {3, 2}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},
      {{0, 9}, {1, 1}, {2, 30}, {3, 3}, {4, 12}},
      {{0, 1}, {2, 1}, {4, 1}},
      {{4, 2}, {5, 3}, {1, 1}},
  };
  std::map<int, int> position;
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE(::testing::Message() << "step " << s);
    StepBatch batch;
    for (const auto& [seq, n] : steps[s]) {
      SequenceChunk c;
      c.sequence_id = seq;
      for (int i = 0; i < n; ++i) c.tokens.push_back(static_cast<int32_t>(rng() % cfg->vocab_size));
      c.start_position = position[seq];
      for (int b = 0; b < 16; ++b) c.block_table.push_back(seq * 16 + b);
      c.state_slot = seq;
      c.wants_logits = true;
      position[seq] += n;
      batch.chunks.push_back(std::move(c));
    }
    StepTokens tokens;
    ASSERT_TRUE(FlattenStep(batch, cfg->vocab_size, KvCacheShape{kSlots * 16, 16, kSlots},
                            cfg->max_position_embeddings, &tokens)
                    .ok());
    const int T = tokens.num_tokens;
    const std::vector<float> h = Random(static_cast<size_t>(T) * wide, rng, 1.0f);
    std::vector<float> want = h;
    ASSERT_TRUE((*cpu_states)->BeginStep(batch).ok());
    ASSERT_TRUE((*cpu)->Forward(want.data(), tokens, **cpu_states, compute).ok());
    (*cpu_states)->CommitStep(batch);

    std::vector<int32_t> w;
    ASSERT_TRUE(windows.Build(tokens, &w).ok());
    std::vector<float> e(static_cast<size_t>(T) * E);
    ASSERT_TRUE((*gpu)->Embed(w.data(), T, e.data()).ok());
    ASSERT_TRUE(gpu_states.BeginStep(batch, nullptr).ok());
    std::vector<int32_t> facts;
    ASSERT_TRUE(gpu_states.Pack(tokens, T, &facts).ok());
    DeviceArray<int32_t> d_facts = ToDevice(facts);
    gpu_states.Bind(T, d_facts.get());
    bool moved = false;
    ASSERT_TRUE(ws.Reserve((*gpu)->shape(), T, &moved).ok());
    DeviceArray<float> d_h = ToDevice(h), d_e = ToDevice(e);
    ASSERT_TRUE((*gpu)->Forward(d_h.get(), d_e.get(), 0, T, gpu_states.StepFor(0, T), ws, ctx).ok());
    const std::vector<float> got = ToHost(d_h, h.size());
    gpu_states.CommitStep(batch);
    windows.Commit();

    // Every slot's carried conv inputs as the step left them (the current copies after the commit).
    double state_rel = 0;
    for (const auto& [seq, n] : steps[s]) {
      const float* c = (*cpu_states)->Current(layer, seq) + conv_at;
      const std::vector<float> g =
          ToHost(store->layer(layer) + static_cast<size_t>(store->ReadRow(seq)) * store->row_floats() + conv_at,
                 conv_floats);
      state_rel = std::max(state_rel, RelativeError(g, std::vector<float>(c, c + conv_floats)));
    }
    const double rel = Compare("ple streams", "step " + std::to_string(s) + " (" + std::to_string(T) + " tokens)",
                               got, want);
    std::printf("qwen4 ple step %zu: carried conv inputs rel (worst slot) %.2e\n", s, state_rel);
    EXPECT_LT(rel, 1e-5);
    EXPECT_LT(state_rel, 1e-5);
  }
  // A resumed chunk whose slot holds no context is refused by name.
  StepBatch stray;
  SequenceChunk c;
  c.sequence_id = 9;
  c.tokens = {1};
  c.start_position = 4;
  c.block_table = {0};
  c.state_slot = kSlots - 1 + 10;
  stray.chunks.push_back(c);
  StepTokens stray_tokens;
  stray_tokens.batch = &stray;
  stray_tokens.num_tokens = 1;
  stray_tokens.positions = {4};
  stray_tokens.chunk_of = {0};
  std::vector<int32_t> w;
  const absl::Status refused = windows.Build(stray_tokens, &w);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.message()).find("sequence 9"), std::string::npos) << refused;
}

}  // namespace
}  // namespace exl3::engine::cuda

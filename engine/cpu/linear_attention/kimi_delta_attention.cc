#include "engine/cpu/linear_attention/kimi_delta_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/linear_attention/kimi_delta_rule.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// transformers' softplus in the forget gate: x itself above 20.
float Softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

}  // namespace

KimiDeltaAttention::KimiDeltaAttention(const ModelConfig& cfg, int layer)
    : cfg_(cfg), shape_(cfg.linear_attention), layer_(layer), lower_bound_(cfg.glm5next->gate_lower_bound) {}

absl::StatusOr<KdaWeights> KdaWeights::Load(const ModelConfig& cfg, const TensorSource& src, int layer) {
  const std::string p = LayerPrefix(cfg.moe, layer) + "self_attn.";
  const LinearAttentionConfig& shape = cfg.linear_attention;
  const int H = cfg.hidden_size, NH = shape.num_key_heads, D = shape.key_head_dim;
  const int K = shape.conv_kernel, W = NH * D;
  KdaWeights w;
  auto has_layer = [&](const std::string& name) { return src.Has(name + ".trellis") || src.Has(name + ".weight"); };
  // exllamav3 stores q, k and v as one projection, qkv_proj [3 W] (q, then k, then v), and their
  // convolutions as one conv1d [3 W, 1, K], in that order too (tests/fixtures/exllamav3/README.md).
  const bool fused = has_layer(p + "qkv_proj");
  if (fused && has_layer(p + "q_proj"))
    return absl::InvalidArgumentError(absl::StrCat(p, "qkv_proj and ", p, "q_proj: both the fused and the "
                                                   "separate q/k/v projections are stored"));
  if (fused) {
    EXL3_ASSIGN_OR_RETURN(w.q, Linear::LoadOutputSlice(src, p + "qkv_proj", H, 3 * W, 0, W));
    EXL3_ASSIGN_OR_RETURN(w.k, Linear::LoadOutputSlice(src, p + "qkv_proj", H, 3 * W, W, W));
    EXL3_ASSIGN_OR_RETURN(w.v, Linear::LoadOutputSlice(src, p + "qkv_proj", H, 3 * W, 2 * W, W));
  } else {
    EXL3_ASSIGN_OR_RETURN(w.q, Linear::Load(src, p + "q_proj", H, W));
    EXL3_ASSIGN_OR_RETURN(w.k, Linear::Load(src, p + "k_proj", H, W));
    EXL3_ASSIGN_OR_RETURN(w.v, Linear::Load(src, p + "v_proj", H, W));
  }
  EXL3_ASSIGN_OR_RETURN(w.f_a, Linear::Load(src, p + "f_a_proj", H, D));
  EXL3_ASSIGN_OR_RETURN(w.f_b, Linear::Load(src, p + "f_b_proj", D, W));
  EXL3_ASSIGN_OR_RETURN(w.b, Linear::Load(src, p + "b_proj", H, NH));
  EXL3_ASSIGN_OR_RETURN(w.g_a, Linear::Load(src, p + "g_a_proj", H, D));
  EXL3_ASSIGN_OR_RETURN(w.g_b, Linear::Load(src, p + "g_b_proj", D, W));
  EXL3_ASSIGN_OR_RETURN(w.o, Linear::Load(src, p + "o_proj", W, H));
  const bool fused_conv = src.Has(p + "conv1d.weight");
  if (fused_conv && src.Has(p + "q_conv1d.weight"))
    return absl::InvalidArgumentError(absl::StrCat(p, "conv1d and ", p, "q_conv1d: both the fused and the "
                                                   "separate q/k/v convolutions are stored"));
  const std::vector<const char*> convs =
      fused_conv ? std::vector<const char*>{"conv1d"} : std::vector<const char*>{"q_conv1d", "k_conv1d", "v_conv1d"};
  const int channels = fused_conv ? 3 * W : W;
  for (const char* conv : convs) {
    const std::string name = p + conv + ".weight";
    EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
    if (t.info->shape != std::vector<int64_t>{channels, 1, K})
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected shape [", channels, ", 1, ", K, "]"));
    if (src.Has(p + conv + ".bias"))
      return absl::InvalidArgumentError(absl::StrCat(p, conv, ".bias: KDA's convolutions have no bias"));
    EXL3_ASSIGN_OR_RETURN(std::vector<float> c, ToFloat32(t));
    w.conv_weight.insert(w.conv_weight.end(), c.begin(), c.end());
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> a_log, LoadVector(src, p + "A_log", NH));
  for (float v : a_log) w.decay_rate.push_back(std::exp(v));
  EXL3_ASSIGN_OR_RETURN(w.dt_bias, LoadVector(src, p + "dt_bias", W));
  EXL3_ASSIGN_OR_RETURN(w.o_norm, LoadVector(src, p + "o_norm.weight", D));
  return w;
}

absl::StatusOr<std::unique_ptr<KimiDeltaAttention>> KimiDeltaAttention::Load(const ModelConfig& cfg,
                                                                              const TensorSource& src,
                                                                              int layer) {
  std::unique_ptr<KimiDeltaAttention> a(new KimiDeltaAttention(cfg, layer));
  EXL3_ASSIGN_OR_RETURN(a->w_, KdaWeights::Load(cfg, src, layer));
  return a;
}

absl::Status KimiDeltaAttention::Forward(const float* x, const StepTokens& tokens,
                                         SequenceStateStore& states, float* out,
                                         CpuCompute& compute) const {
  const int T = tokens.num_tokens, NH = shape_.num_key_heads, D = shape_.key_head_dim;
  const int K = shape_.conv_kernel, W = NH * D, C = 3 * W;
  const size_t TW = static_cast<size_t>(T) * W;
  // Projections: q, k, v side by side per token (the conv's channel order), the gates.
  std::vector<float> proj(TW), mixed(static_cast<size_t>(T) * C);
  for (int which = 0; which < 3; ++which) {
    const Linear& l = which == 0 ? w_.q : which == 1 ? w_.k : w_.v;
    EXL3_RETURN_IF_ERROR(l.Forward(x, T, proj.data(), compute));
    for (int t = 0; t < T; ++t)
      std::copy_n(&proj[static_cast<size_t>(t) * W], W, &mixed[static_cast<size_t>(t) * C + which * W]);
  }
  std::vector<float> low(static_cast<size_t>(T) * D), log_decay(TW), gate(TW), beta(static_cast<size_t>(T) * NH);
  EXL3_RETURN_IF_ERROR(w_.f_a.Forward(x, T, low.data(), compute));
  EXL3_RETURN_IF_ERROR(w_.f_b.Forward(low.data(), T, log_decay.data(), compute));
  EXL3_RETURN_IF_ERROR(w_.g_a.Forward(x, T, low.data(), compute));
  EXL3_RETURN_IF_ERROR(w_.g_b.Forward(low.data(), T, gate.data(), compute));
  EXL3_RETURN_IF_ERROR(w_.b.Forward(x, T, beta.data(), compute));
  for (float& b : beta) b = Sigmoid(b);
  for (size_t i = 0; i < TW; ++i) {
    const int h = static_cast<int>(i % W) / D;
    const float g = log_decay[i] + w_.dt_bias[i % W];
    log_decay[i] = lower_bound_ ? *lower_bound_ * Sigmoid(w_.decay_rate[h] * g) : -w_.decay_rate[h] * Softplus(g);
  }

  const std::vector<ChunkRun> runs = ChunkRuns(tokens);
  auto slot_of = [&](const ChunkRun& run) { return tokens.batch->chunks[run.chunk].state_slot; };

  // The causal depthwise convolutions over [conv state, the chunk's inputs], SiLU; the new conv
  // state is the last K − 1 inputs of that window.
  std::vector<float> conv(mixed.size());
  constexpr int kChannelsPerItem = 64;
  const int channel_items = (C + kChannelsPerItem - 1) / kChannelsPerItem;
  compute.ParallelFor(static_cast<int>(runs.size()) * channel_items, [&](int item) {
    const ChunkRun& run = runs[item / channel_items];
    const int c0 = (item % channel_items) * kChannelsPerItem, c1 = std::min(C, c0 + kChannelsPerItem);
    const int slot = slot_of(run), kept = states.NumKeptStates(slot);
    const float* prev = states.Current(layer_, slot);  // [K − 1, C]
    auto input = [&](int u, int c) {
      return u < K - 1 ? prev[static_cast<size_t>(u) * C + c]
                       : mixed[static_cast<size_t>(run.first_token + u - (K - 1)) * C + c];
    };
    for (int c = c0; c < c1; ++c) {
      const float* w = &w_.conv_weight[static_cast<size_t>(c) * K];
      for (int j = 0; j < run.num_tokens; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) acc += w[i] * input(j + i, c);
        conv[static_cast<size_t>(run.first_token + j) * C + c] = acc * Sigmoid(acc);
      }
      for (int k = 0; k < kept; ++k) {  // after the chunk's first `folded` tokens, per kept state
        float* conv_state = states.KeptState(layer_, slot, k);
        const int folded = run.num_tokens - kept + 1 + k;
        for (int i = 0; i < K - 1; ++i) conv_state[static_cast<size_t>(i) * C + c] = input(folded + i, c);
      }
    }
  });
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int t = 0; t < T; ++t) {
    float* row = &conv[static_cast<size_t>(t) * C];
    for (int h = 0; h < NH; ++h) {
      L2NormalizeInPlace(row + h * D, D);
      L2NormalizeInPlace(row + W + h * D, D);
      for (int i = 0; i < D; ++i) row[h * D + i] *= q_scale;
    }
  }

  // The delta rule per (chunk, head), then the gated norm.
  const int64_t conv_state_floats = shape_.ConvStateFloats();
  std::vector<float> core(TW);
  compute.ParallelFor(static_cast<int>(runs.size()) * NH, [&](int item) {
    const ChunkRun& run = runs[item / NH];
    const int h = item % NH, slot = slot_of(run), kept = states.NumKeptStates(slot);
    const size_t head_floats = static_cast<size_t>(D) * D;
    const int64_t head_offset = conv_state_floats + h * head_floats;
    const float* prev = states.Current(layer_, slot) + head_offset;
    float* S = states.Next(layer_, slot) + head_offset;
    std::copy_n(prev, head_floats, S);
    const size_t first = static_cast<size_t>(run.first_token);
    KdaHeadInputs in;
    in.q = &conv[first * C + h * D];
    in.k = &conv[first * C + W + h * D];
    in.v = &conv[first * C + 2 * W + h * D];
    in.g = &log_decay[first * W + h * D];
    in.beta = &beta[first * NH + h];
    in.qk_stride = C;
    in.g_stride = W;
    in.v_stride = C;
    in.beta_stride = NH;
    in.key_dim = in.value_dim = D;
    float* o = &core[first * W + h * D];
    if (kept > 1) {
      // A verify chunk: token by token in the recurrent form, as plain decoding runs each of its
      // tokens (so every kept state is decoding's, bit for bit), S copied after each kept token.
      const int first_kept_token = run.num_tokens - kept;
      for (int j = 0; j < run.num_tokens; ++j) {
        KdaHeadInputs at = in;
        at.q += static_cast<size_t>(j) * C;
        at.k += static_cast<size_t>(j) * C;
        at.v += static_cast<size_t>(j) * C;
        at.g += static_cast<size_t>(j) * W;
        at.beta += static_cast<size_t>(j) * NH;
        KdaRecurrent(at, 1, S, o + static_cast<size_t>(j) * W, W);
        if (j >= first_kept_token && j < run.num_tokens - 1)
          std::copy_n(S, head_floats, states.KeptState(layer_, slot, j - first_kept_token) + head_offset);
      }
    } else if (run.num_tokens == 1) {
      KdaRecurrent(in, 1, S, o, W);
    } else {
      KdaChunked(in, run.num_tokens, kChunkSize, S, o, W);
    }
    for (int j = 0; j < run.num_tokens; ++j) {
      float* oj = o + static_cast<size_t>(j) * W;
      RmsNorm(oj, w_.o_norm.data(), D, cfg_.rms_norm_eps, oj);
      const float* gj = &gate[(first + j) * W + h * D];
      for (int e = 0; e < D; ++e) oj[e] *= Sigmoid(gj[e]);
    }
  });
  return w_.o.Forward(core.data(), T, out, compute);
}

}  // namespace exl3::engine

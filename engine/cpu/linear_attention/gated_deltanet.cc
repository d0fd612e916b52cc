#include "engine/cpu/linear_attention/gated_deltanet.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float Silu(float x) { return x * Sigmoid(x); }
// torch's softplus (beta 1, threshold 20): x itself above the threshold.
float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace

absl::StatusOr<std::unique_ptr<GatedDeltaNet>> GatedDeltaNet::Load(const ModelConfig& cfg,
                                                                   const TensorSource& src,
                                                                   int layer) {
  std::unique_ptr<GatedDeltaNet> d(new GatedDeltaNet(cfg, layer));
  const LinearAttentionConfig& s = d->shape_;
  const std::string p = LayerPrefix(cfg.moe, layer) + "linear_attn.";
  const int H = cfg.hidden_size;
  if (cfg.qwen4exp != nullptr) {
    d->layout_ = ProjectionLayout::kSeparate;
    d->gate_activation_ = cfg.qwen4exp->output_gate;
    EXL3_ASSIGN_OR_RETURN(d->qkv_, Linear::Load(src, p + "in_proj_qkv", H, s.conv_channels()));
    EXL3_ASSIGN_OR_RETURN(d->z_, Linear::Load(src, p + "in_proj_z", H, s.value_dim()));
    EXL3_ASSIGN_OR_RETURN(d->b_, Linear::Load(src, p + "in_proj_b", H, s.num_value_heads));
    EXL3_ASSIGN_OR_RETURN(d->a_, Linear::Load(src, p + "in_proj_a", H, s.num_value_heads));
  } else {
    EXL3_ASSIGN_OR_RETURN(d->qkvz_, Linear::Load(src, p + "in_proj_qkvz", H,
                                                 2 * s.key_dim() + 2 * s.value_dim()));
    EXL3_ASSIGN_OR_RETURN(d->ba_, Linear::Load(src, p + "in_proj_ba", H, 2 * s.num_value_heads));
  }
  EXL3_ASSIGN_OR_RETURN(d->out_, Linear::Load(src, p + "out_proj", s.value_dim(), H));

  const std::string conv = p + "conv1d.weight";
  EXL3_ASSIGN_OR_RETURN(TensorView cw, src.Get(conv));
  const std::vector<int64_t> want = {s.conv_channels(), 1, s.conv_kernel};
  if (cw.info->shape != want)
    return absl::InvalidArgumentError(absl::StrCat(conv, ": expected shape [", s.conv_channels(),
                                                   ", 1, ", s.conv_kernel, "]"));
  EXL3_ASSIGN_OR_RETURN(d->conv_weight_, ToFloat32(cw));
  if (src.Has(p + "conv1d.bias"))
    return absl::InvalidArgumentError(absl::StrCat(
        p, "conv1d.bias: the DeltaNet convolution has no bias; this checkpoint is not one"));

  EXL3_ASSIGN_OR_RETURN(std::vector<float> a_log, LoadVector(src, p + "A_log", s.num_value_heads));
  for (float v : a_log) d->neg_a_.push_back(-std::exp(v));
  EXL3_ASSIGN_OR_RETURN(d->dt_bias_, LoadVector(src, p + "dt_bias", s.num_value_heads));
  EXL3_ASSIGN_OR_RETURN(d->norm_weight_, LoadVector(src, p + "norm.weight", s.value_head_dim));
  return d;
}

absl::Status GatedDeltaNet::Project(const float* x, int T, Projected* pr, CpuCompute& compute) const {
  const int NK = shape_.num_key_heads, NV = shape_.num_value_heads;
  const int DK = shape_.key_head_dim, DV = shape_.value_head_dim;
  const int ratio = NV / NK, C = shape_.conv_channels(), KD = shape_.key_dim();
  std::vector<float>& mixed = pr->mixed;
  std::vector<float>& z = pr->z;
  std::vector<float>& beta = pr->beta;
  std::vector<float>& log_decay = pr->log_decay;
  mixed.resize(static_cast<size_t>(T) * C);
  z.resize(static_cast<size_t>(T) * NV * DV);
  beta.resize(static_cast<size_t>(T) * NV);
  log_decay.resize(static_cast<size_t>(T) * NV);
  if (layout_ == ProjectionLayout::kSeparate) {
    std::vector<float> b(beta.size()), a(beta.size());
    EXL3_RETURN_IF_ERROR(qkv_.Forward(x, T, mixed.data(), compute));
    EXL3_RETURN_IF_ERROR(z_.Forward(x, T, z.data(), compute));
    EXL3_RETURN_IF_ERROR(b_.Forward(x, T, b.data(), compute));
    EXL3_RETURN_IF_ERROR(a_.Forward(x, T, a.data(), compute));
    for (size_t i = 0; i < beta.size(); ++i) {
      const int h = static_cast<int>(i % NV);
      beta[i] = Sigmoid(b[i]);
      log_decay[i] = neg_a_[h] * Softplus(a[i] + dt_bias_[h]);
    }
    return absl::OkStatus();
  }
  const int qkvz_width = 2 * shape_.key_dim() + 2 * shape_.value_dim();
  const int per_key_head = 2 * DK + 2 * ratio * DV;  // q, k, v, z of one key head's group
  std::vector<float> qkvz(static_cast<size_t>(T) * qkvz_width), ba(static_cast<size_t>(T) * 2 * NV);
  EXL3_RETURN_IF_ERROR(qkvz_.Forward(x, T, qkvz.data(), compute));
  EXL3_RETURN_IF_ERROR(ba_.Forward(x, T, ba.data(), compute));

  // Regroup per token: conv input [q of every key head | k of every key head | v of every value
  // head], z [value heads, DV], β and the log-decay per value head.
  for (int t = 0; t < T; ++t) {
    const float* row = &qkvz[static_cast<size_t>(t) * qkvz_width];
    float* m = &mixed[static_cast<size_t>(t) * C];
    float* zt = &z[static_cast<size_t>(t) * NV * DV];
    const float* bat = &ba[static_cast<size_t>(t) * 2 * NV];
    for (int g = 0; g < NK; ++g) {
      const float* grp = row + static_cast<size_t>(g) * per_key_head;
      std::copy_n(grp, DK, m + g * DK);
      std::copy_n(grp + DK, DK, m + KD + g * DK);
      std::copy_n(grp + 2 * DK, ratio * DV, m + 2 * KD + g * ratio * DV);
      std::copy_n(grp + 2 * DK + ratio * DV, ratio * DV, zt + g * ratio * DV);
      for (int r = 0; r < ratio; ++r) {
        const int h = g * ratio + r;
        beta[static_cast<size_t>(t) * NV + h] = Sigmoid(bat[g * 2 * ratio + r]);
        log_decay[static_cast<size_t>(t) * NV + h] =
            neg_a_[h] * Softplus(bat[g * 2 * ratio + ratio + r] + dt_bias_[h]);
      }
    }
  }

  return absl::OkStatus();
}

absl::Status GatedDeltaNet::Forward(const float* x, const StepTokens& tokens,
                                    SequenceStateStore& states, float* out,
                                    CpuCompute& compute) const {
  const int T = tokens.num_tokens;
  const int NK = shape_.num_key_heads, NV = shape_.num_value_heads;
  const int DK = shape_.key_head_dim, DV = shape_.value_head_dim, K = shape_.conv_kernel;
  const int ratio = NV / NK, C = shape_.conv_channels(), KD = shape_.key_dim();

  Projected pr;
  EXL3_RETURN_IF_ERROR(Project(x, T, &pr, compute));
  const std::vector<float>& mixed = pr.mixed;
  const std::vector<float>& z = pr.z;
  const std::vector<float>& beta = pr.beta;
  const std::vector<float>& log_decay = pr.log_decay;

  const std::vector<ChunkRun> runs = ChunkRuns(tokens);
  auto slot_of = [&](const ChunkRun& run) { return tokens.batch->chunks[run.chunk].state_slot; };

  // The causal depthwise convolution over [conv state of K - 1 inputs, the chunk's inputs], SiLU;
  // the conv state after the chunk's first f tokens is the K - 1 inputs before window input
  // f + K - 1, kept for each state the chunk keeps (the last: after all its tokens).
  const int64_t conv_state_floats = shape_.ConvStateFloats();
  std::vector<float> conv_out(mixed.size());
  constexpr int kChannelsPerItem = 64;
  const int channel_items = (C + kChannelsPerItem - 1) / kChannelsPerItem;
  compute.ParallelFor(static_cast<int>(runs.size()) * channel_items, [&](int item) {
    const ChunkRun& run = runs[item / channel_items];
    const int c0 = (item % channel_items) * kChannelsPerItem, c1 = std::min(C, c0 + kChannelsPerItem);
    const int slot = slot_of(run);
    const float* prev = states.Current(layer_, slot);  // [K - 1, C]
    const int n = run.num_tokens, kept = states.NumKeptStates(slot);
    // Input u of the window (u < K - 1: the state, oldest first; else the chunk's token u - K + 1).
    auto input = [&](int u, int c) {
      return u < K - 1 ? prev[static_cast<size_t>(u) * C + c]
                       : mixed[static_cast<size_t>(run.first_token + u - (K - 1)) * C + c];
    };
    for (int c = c0; c < c1; ++c) {
      const float* w = &conv_weight_[static_cast<size_t>(c) * K];
      for (int j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) acc += w[i] * input(j + i, c);
        conv_out[static_cast<size_t>(run.first_token + j) * C + c] = Silu(acc);
      }
      for (int k = 0; k < kept; ++k) {
        float* conv_state = states.KeptState(layer_, slot, k);
        const int folded = n - kept + 1 + k;  // the chunk's tokens in that state
        for (int i = 0; i < K - 1; ++i) conv_state[static_cast<size_t>(i) * C + c] = input(folded + i, c);
      }
    }
  });

  // q and k normalised per key head; q scaled.
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(DK));
  for (int t = 0; t < T; ++t) {
    float* m = &conv_out[static_cast<size_t>(t) * C];
    for (int g = 0; g < NK; ++g) {
      L2NormalizeInPlace(m + g * DK, DK);
      L2NormalizeInPlace(m + KD + g * DK, DK);
      for (int i = 0; i < DK; ++i) m[g * DK + i] *= q_scale;
    }
  }

  // The delta rule, token by token, per (chunk, value head); then the gated RMSNorm. S runs in
  // the state after the chunk; a verify chunk's earlier kept states are copies of it on the way.
  std::vector<float> core(static_cast<size_t>(T) * NV * DV);
  compute.ParallelFor(static_cast<int>(runs.size()) * NV, [&](int item) {
    const ChunkRun& run = runs[item / NV];
    const int h = item % NV, g = h / ratio, slot = slot_of(run);
    const size_t head_floats = static_cast<size_t>(DK) * DV;
    const int64_t head_offset = conv_state_floats + h * head_floats;
    const float* prev = states.Current(layer_, slot) + head_offset;
    float* S = states.Next(layer_, slot) + head_offset;  // [DK, DV]
    const int kept = states.NumKeptStates(slot), first_kept_token = run.num_tokens - kept;
    std::copy_n(prev, head_floats, S);
    std::vector<float> delta(DV);
    for (int j = 0; j < run.num_tokens; ++j) {
      const int t = run.first_token + j;
      const float* m = &conv_out[static_cast<size_t>(t) * C];
      const float* q = m + g * DK;
      const float* k = m + KD + g * DK;
      const float* v = m + 2 * KD + h * DV;
      const float decay = std::exp(log_decay[static_cast<size_t>(t) * NV + h]);
      const float b = beta[static_cast<size_t>(t) * NV + h];
      for (size_t i = 0; i < head_floats; ++i) S[i] *= decay;
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int a = 0; a < DK; ++a) {
        const float* Sa = S + static_cast<size_t>(a) * DV;
        for (int e = 0; e < DV; ++e) delta[e] += Sa[e] * k[a];  // (Sᵀk)[e]
      }
      for (int e = 0; e < DV; ++e) delta[e] = (v[e] - delta[e]) * b;
      float* o = &core[(static_cast<size_t>(t) * NV + h) * DV];
      std::fill_n(o, DV, 0.0f);
      for (int a = 0; a < DK; ++a) {
        float* Sa = S + static_cast<size_t>(a) * DV;
        for (int e = 0; e < DV; ++e) {
          Sa[e] += k[a] * delta[e];
          o[e] += Sa[e] * q[a];
        }
      }
      RmsNorm(o, norm_weight_.data(), DV, cfg_.rms_norm_eps, o);
      const float* zh = &z[(static_cast<size_t>(t) * NV + h) * DV];
      if (gate_activation_ == OutputGateActivation::kSigmoid) {
        for (int e = 0; e < DV; ++e) o[e] *= Sigmoid(zh[e]);
      } else {
        for (int e = 0; e < DV; ++e) o[e] *= Silu(zh[e]);
      }
      if (j >= first_kept_token && j < run.num_tokens - 1)
        std::copy_n(S, head_floats, states.KeptState(layer_, slot, j - first_kept_token) + head_offset);
    }
  });
  return out_.Forward(core.data(), T, out, compute);
}

}  // namespace exl3::engine

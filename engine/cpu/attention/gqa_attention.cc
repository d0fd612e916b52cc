#include "engine/cpu/attention/gqa_attention.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {

GqaAttention::GqaAttention(const ModelConfig& cfg, int layer)
    : cfg_(cfg), layer_(layer), rope_(cfg.rope, cfg.max_position_embeddings) {}

absl::StatusOr<std::unique_ptr<GqaAttention>> GqaAttention::Load(const ModelConfig& cfg,
                                                                 const TensorSource& src,
                                                                 int layer) {
  std::unique_ptr<GqaAttention> a(new GqaAttention(cfg, layer));
  const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.");
  const int H = cfg.hidden_size, q_out = cfg.num_heads * cfg.head_dim,
            kv_out = cfg.num_kv_heads * cfg.head_dim;
  a->output_gate_ = cfg.attention_output_gate;
  EXL3_ASSIGN_OR_RETURN(a->q_, Linear::Load(src, p + "q_proj", H, a->output_gate_ ? 2 * q_out : q_out));
  EXL3_ASSIGN_OR_RETURN(a->k_, Linear::Load(src, p + "k_proj", H, kv_out));
  EXL3_ASSIGN_OR_RETURN(a->v_, Linear::Load(src, p + "v_proj", H, kv_out));
  EXL3_ASSIGN_OR_RETURN(a->o_, Linear::Load(src, p + "o_proj", q_out, H));
  if (cfg.qk_norm) {
    EXL3_ASSIGN_OR_RETURN(a->q_norm_, LoadNormWeight(src, p + "q_norm.weight", cfg.head_dim,
                                                     cfg.norm_weights));
    EXL3_ASSIGN_OR_RETURN(a->k_norm_, LoadNormWeight(src, p + "k_norm.weight", cfg.head_dim,
                                                     cfg.norm_weights));
  }
  return a;
}

absl::Status GqaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                   AttentionCarry& /*carry*/, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, D = cfg_.head_dim, NH = cfg_.num_heads, KV = cfg_.num_kv_heads;
  const int group = NH / KV;
  std::vector<float> q(static_cast<size_t>(T) * NH * D), k(static_cast<size_t>(T) * KV * D),
      v(static_cast<size_t>(T) * KV * D);
  std::vector<float> gate;  // [T, NH * D] with the output gate
  if (output_gate_) {
    // q_proj's row: per head, the query then its gate.
    std::vector<float> qg(static_cast<size_t>(T) * NH * 2 * D);
    EXL3_RETURN_IF_ERROR(q_.Forward(x, T, qg.data(), compute));
    gate.resize(q.size());
    for (size_t th = 0; th < static_cast<size_t>(T) * NH; ++th) {
      std::copy_n(&qg[th * 2 * D], D, &q[th * D]);
      std::copy_n(&qg[th * 2 * D + D], D, &gate[th * D]);
    }
  } else {
    EXL3_RETURN_IF_ERROR(q_.Forward(x, T, q.data(), compute));
  }
  EXL3_RETURN_IF_ERROR(k_.Forward(x, T, k.data(), compute));
  EXL3_RETURN_IF_ERROR(v_.Forward(x, T, v.data(), compute));
  if (!q_norm_.empty()) {
    RmsNormRows(q.data(), q_norm_.data(), T * NH, D, cfg_.rms_norm_eps, q.data());
    RmsNormRows(k.data(), k_norm_.data(), T * KV, D, cfg_.rms_norm_eps, k.data());
  }
  RopeAngles angles;
  for (int t = 0; t < T; ++t) {
    rope_.Angles(tokens.positions[t], tokens.seq_len_after[t], &angles);
    rope_.Apply(angles, &q[static_cast<size_t>(t) * NH * D], NH, D);
    rope_.Apply(angles, &k[static_cast<size_t>(t) * KV * D], KV, D);
    float* slot = cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]);
    std::copy_n(&k[static_cast<size_t>(t) * KV * D], KV * D, slot);
    std::copy_n(&v[static_cast<size_t>(t) * KV * D], KV * D, slot + KV * D);
  }

  std::vector<float> attn(static_cast<size_t>(T) * NH * D);
  const float scale = cfg_.attention_scale;
  compute.ParallelFor(T * NH, [&](int item) {
    const int t = item / NH, h = item % NH, g = h / group;
    const int pos = tokens.positions[t];
    const int first = FirstVisiblePosition(pos, cfg_.sliding_window);
    const std::vector<int32_t>& table = tokens.block_table(t);
    const float* qh = &q[(static_cast<size_t>(t) * NH + h) * D];
    std::vector<float> scores(pos - first + 1);
    for (int j = first; j <= pos; ++j) {
      const float* kj = cache.Slot(layer_, table, j) + g * D;
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += qh[d] * kj[d];
      scores[j - first] = s * scale;
    }
    SoftmaxInPlace(scores.data(), static_cast<int>(scores.size()));
    float* o = &attn[(static_cast<size_t>(t) * NH + h) * D];
    std::fill_n(o, D, 0.0f);
    for (int j = first; j <= pos; ++j) {
      const float* vj = cache.Slot(layer_, table, j) + KV * D + g * D;
      const float p = scores[j - first];
      for (int d = 0; d < D; ++d) o[d] += p * vj[d];
    }
  });
  if (output_gate_)
    for (size_t i = 0; i < attn.size(); ++i) attn[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  return o_.Forward(attn.data(), T, out, compute);
}

}  // namespace exl3::engine

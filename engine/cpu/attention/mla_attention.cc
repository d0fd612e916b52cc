#include "engine/cpu/attention/mla_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {
MlaAttention::MlaAttention(const ModelConfig& cfg, int layer)
    : cfg_(cfg), layer_(layer), rope_(cfg.rope, cfg.max_position_embeddings) {}

absl::StatusOr<std::unique_ptr<MlaAttention>> MlaAttention::Load(const ModelConfig& cfg,
                                                                 const TensorSource& src,
                                                                 int layer) {
  std::unique_ptr<MlaAttention> a(new MlaAttention(cfg, layer));
  const std::string p = LayerPrefix(cfg.moe, layer) + "self_attn.";
  const int H = cfg.hidden_size, NH = cfg.num_heads;
  const int qd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
  a->q_low_rank_ = cfg.q_lora_rank > 0;
  if (a->q_low_rank_) {
    EXL3_ASSIGN_OR_RETURN(a->q_a_, Linear::Load(src, p + "q_a_proj", H, cfg.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(a->q_a_norm_, LoadVector(src, p + "q_a_layernorm.weight", cfg.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(a->q_b_, Linear::Load(src, p + "q_b_proj", cfg.q_lora_rank, NH * qd));
  } else {
    EXL3_ASSIGN_OR_RETURN(a->q_, Linear::Load(src, p + "q_proj", H, NH * qd));
  }
  EXL3_ASSIGN_OR_RETURN(a->kv_a_, Linear::Load(src, p + "kv_a_proj_with_mqa", H,
                                               cfg.kv_lora_rank + cfg.qk_rope_head_dim));
  EXL3_ASSIGN_OR_RETURN(a->kv_a_norm_, LoadVector(src, p + "kv_a_layernorm.weight", cfg.kv_lora_rank));
  EXL3_ASSIGN_OR_RETURN(Linear kv_b, Linear::Load(src, p + "kv_b_proj", cfg.kv_lora_rank,
                                                  NH * (cfg.qk_nope_head_dim + cfg.v_head_dim)));
  if (kv_b.has_bias()) return absl::UnimplementedError(p + "kv_b_proj has a bias (not absorbed)");
  a->kv_b_ = kv_b.DenseWeight();
  EXL3_ASSIGN_OR_RETURN(a->o_, Linear::Load(src, p + "o_proj", NH * cfg.v_head_dim, H));
  return a;
}

absl::Status MlaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                   AttentionCarry& /*carry*/, float* out, CpuCompute& compute) {
  std::vector<float> q, q_resid;
  EXL3_RETURN_IF_ERROR(ProjectAndCache(x, tokens, cache, &q, &q_resid, compute));
  return AttendAndProject(q, tokens, cache, /*selection=*/nullptr, out, compute);
}

absl::Status MlaAttention::ForwardSelected(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                           AttentionCarry& carry, const SelectPositions& select,
                                           const char* no_selection, float* out, CpuCompute& compute) const {
  std::vector<float> q, q_resid;
  EXL3_RETURN_IF_ERROR(ProjectAndCache(x, tokens, cache, &q, &q_resid, compute));
  if (select) {
    TopkSelection selection;
    EXL3_RETURN_IF_ERROR(select(x, q_resid, tokens, cache, &selection, compute));
    carry.topk = std::move(selection);
  } else if (!carry.topk || static_cast<int>(carry.topk->positions.size()) != tokens.num_tokens) {
    return absl::InternalError(absl::StrCat("layer ", layer_, " ", no_selection));
  }
  return AttendAndProject(q, tokens, cache, &*carry.topk, out, compute);
}

absl::Status MlaAttention::ProjectAndCache(const float* x, const StepTokens& tokens,
                                           PagedKvCache& cache, std::vector<float>* q,
                                           std::vector<float>* q_resid, CpuCompute& compute) const {
  const int T = tokens.num_tokens, NH = cfg_.num_heads, R = cfg_.kv_lora_rank;
  const int nope = cfg_.qk_nope_head_dim, rope_d = cfg_.qk_rope_head_dim;
  const int qd = nope + rope_d, W = R + rope_d;
  q->assign(static_cast<size_t>(T) * NH * qd, 0.0f);
  q_resid->clear();
  if (q_low_rank_) {
    q_resid->resize(static_cast<size_t>(T) * cfg_.q_lora_rank);
    EXL3_RETURN_IF_ERROR(q_a_.Forward(x, T, q_resid->data(), compute));
    RmsNormRows(q_resid->data(), q_a_norm_.data(), T, cfg_.q_lora_rank, cfg_.latent_norm_eps, q_resid->data());
    EXL3_RETURN_IF_ERROR(q_b_.Forward(q_resid->data(), T, q->data(), compute));
  } else {
    EXL3_RETURN_IF_ERROR(q_.Forward(x, T, q->data(), compute));
  }
  std::vector<float> ckv(static_cast<size_t>(T) * W);
  EXL3_RETURN_IF_ERROR(kv_a_.Forward(x, T, ckv.data(), compute));
  RopeAngles angles;
  for (int t = 0; t < T; ++t) {
    float* c = &ckv[static_cast<size_t>(t) * W];
    RmsNorm(c, kv_a_norm_.data(), R, cfg_.latent_norm_eps, c);
    rope_.Angles(tokens.positions[t], tokens.seq_len_after[t], &angles);
    rope_.Apply(angles, c + R, 1, rope_d);
    rope_.Apply(angles, &(*q)[static_cast<size_t>(t) * NH * qd] + nope, NH, qd);
    std::copy_n(c, W, cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]));
  }
  return absl::OkStatus();
}

absl::Status MlaAttention::AttendAndProject(const std::vector<float>& q, const StepTokens& tokens,
                                            PagedKvCache& cache, const TopkSelection* selection,
                                            float* out, CpuCompute& compute) const {
  const int T = tokens.num_tokens, NH = cfg_.num_heads, R = cfg_.kv_lora_rank;
  const int nope = cfg_.qk_nope_head_dim, rope_d = cfg_.qk_rope_head_dim, vd = cfg_.v_head_dim;
  const int qd = nope + rope_d;
  std::vector<float> attn(static_cast<size_t>(T) * NH * vd);
  const float scale = cfg_.attention_scale;
  compute.ParallelFor(T * NH, [&](int item) {
    const int t = item / NH, h = item % NH;
    const int pos = tokens.positions[t];
    const std::vector<int32_t>& table = tokens.block_table(t);
    // The positions seen: the causal range [first, pos], or the selection's list.
    const int32_t* list = selection != nullptr ? selection->positions[t].data() : nullptr;
    const int first = FirstVisiblePosition(pos, cfg_.sliding_window);
    const int n = list != nullptr ? static_cast<int>(selection->positions[t].size()) : pos - first + 1;
    auto position = [&](int i) { return list != nullptr ? list[i] : first + i; };
    const float* qh = &q[(static_cast<size_t>(t) * NH + h) * qd];
    const float* w_uk = &kv_b_[static_cast<size_t>(h) * (nope + vd) * R];  // [nope, R]
    const float* w_uv = w_uk + static_cast<size_t>(nope) * R;             // [vd, R]
    std::vector<float> q_latent(R, 0.0f);
    for (int d = 0; d < nope; ++d)
      for (int r = 0; r < R; ++r) q_latent[r] += qh[d] * w_uk[static_cast<size_t>(d) * R + r];
    std::vector<float> scores(n);
    for (int i = 0; i < n; ++i) {
      const float* slot = cache.Slot(layer_, table, position(i));
      float s = 0.0f;
      for (int r = 0; r < R; ++r) s += q_latent[r] * slot[r];
      for (int d = 0; d < rope_d; ++d) s += qh[nope + d] * slot[R + d];
      scores[i] = s * scale;
    }
    SoftmaxInPlace(scores.data(), n);
    std::vector<float> o_latent(R, 0.0f);
    for (int i = 0; i < n; ++i) {
      const float* slot = cache.Slot(layer_, table, position(i));
      const float p = scores[i];
      for (int r = 0; r < R; ++r) o_latent[r] += p * slot[r];
    }
    float* o = &attn[(static_cast<size_t>(t) * NH + h) * vd];
    for (int e = 0; e < vd; ++e) {
      const float* row = w_uv + static_cast<size_t>(e) * R;
      float s = 0.0f;
      for (int r = 0; r < R; ++r) s += row[r] * o_latent[r];
      o[e] = s;
    }
  });
  return o_.Forward(attn.data(), T, out, compute);
}

}  // namespace exl3::engine

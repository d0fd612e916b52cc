#include "tools/test_model/attention_layout.h"

#include <utility>

namespace exl3 {
namespace {

using layer_kind::kCsa;
using layer_kind::kLinear;
using layer_kind::kSliding;

// DeepSeek-V4's attention of layer L (`attn.*`, engine/cpu/attention/dsv4_attention.h): the shared-KV
// projections, the grouped output projection, sinks, and per layer type its compressor and the
// CSA indexer.
void AddDsv4Attention(const TestModelSpec& s, int L, const std::string& p,
                      const LinearAdder& linear, bool exl3, std::vector<GenTensor>* t) {
  const int H = s.hidden, NH = s.heads, D = s.head_dim, G = s.o_groups, R = s.o_lora_rank;
  linear("attn.wq_a", s.q_lora_rank, H);
  t->push_back(NormTensor(p + "attn.q_norm.weight", s.q_lora_rank));
  linear("attn.wq_b", NH * D, s.q_lora_rank);
  linear("attn.wkv", D, H);
  t->push_back(NormTensor(p + "attn.norm.weight", D));
  if (exl3 && R % 128 == 0) {  // as the converter writes it: a layer per group (PlanGroupedWoA)
    for (int g = 0; g < G; ++g) linear("attn.wo_a.slice." + std::to_string(g), R, NH * D / G);
  } else {
    linear("attn.wo_a", G * R, NH * D / G);
  }
  linear("attn.wo_b", H, G * R);
  t->push_back({p + "attn.attn_sink", DType::kBF16, {NH}, GenTensor::kGaussian, 0.5f});
  const std::string& type = s.layer_types[L];
  if (type == kSliding) return;
  const bool csa = type == kCsa;
  const int m = csa ? s.csa_compress_rate : s.hca_compress_rate;
  auto compressor = [&](const std::string& q, int dim) {
    const int width = (csa ? 2 : 1) * dim;  // CSA's overlapping windows: twice the width
    linear(q + "wkv", width, H);
    linear(q + "wgate", width, H);
    t->push_back({p + q + "ape", DType::kBF16, {m, width}, GenTensor::kGaussian, 0.1f});
    t->push_back(NormTensor(p + q + "norm.weight", dim));
  };
  compressor("attn.compressor.", D);
  if (!csa) return;
  linear("attn.indexer.wq_b", s.index_heads * s.index_head_dim, s.q_lora_rank);
  // Router-like: kept dense (as the converter keeps it), never EXL3.
  t->push_back({p + "attn.indexer.weights_proj.weight", DType::kBF16, {s.index_heads, H},
                GenTensor::kGaussian, 0.02f});
  compressor("attn.indexer.compressor.", s.index_head_dim);
}

// What both gated DeltaNet layouts share after their input projections: the convolution over q, k
// and v, A_log, dt_bias, the gated norm's weight (used as stored) and out_proj.
void AddDeltaNetRecurrence(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                           std::vector<GenTensor>* t) {
  const int kd = s.linear_key_heads * s.linear_key_head_dim, vd = s.linear_value_heads * s.linear_value_head_dim,
            nv = s.linear_value_heads;
  t->push_back({p + "linear_attn.conv1d.weight", DType::kBF16, {2 * kd + vd, 1, s.linear_conv_kernel},
                GenTensor::kGaussian, 0.3f});
  // Decay rates exp(A_log) in [0.02, 0.5]: the state remembers a few to a few hundred tokens.
  t->push_back({p + "linear_attn.A_log", DType::kBF16, {nv}, GenTensor::kLogUniform, 0.02f, 0, 0.5f});
  t->push_back({p + "linear_attn.dt_bias", DType::kBF16, {nv}, GenTensor::kBias, 0.5f});
  t->push_back(NormTensor(p + "linear_attn.norm.weight", s.linear_value_head_dim));  // used as stored
  linear("linear_attn.out_proj", s.hidden, vd);
}

// Qwen3-Next's gated DeltaNet of one layer (`linear_attn.*`, engine/cpu/linear_attention/gated_deltanet.h).
void AddGatedDeltaNet(const TestModelSpec& s, const std::string& p,
                      const LinearAdder& linear, std::vector<GenTensor>* t) {
  const int H = s.hidden, kd = s.linear_key_heads * s.linear_key_head_dim,
            vd = s.linear_value_heads * s.linear_value_head_dim, nv = s.linear_value_heads;
  linear("linear_attn.in_proj_qkvz", 2 * kd + 2 * vd, H);
  linear("linear_attn.in_proj_ba", 2 * nv, H);
  AddDeltaNetRecurrence(s, p, linear, t);
}

// GLM-5.3-Flash's Kimi delta attention of one layer (self_attn.*, engine/cpu/linear_attention/kimi_delta_attention.h):
// q/k/v/o projections (EXL3 where the converter quantizes them: then q, k and v as one `qkv_proj`
// and the three convolutions as one `conv1d`, as the converter and exllamav3 write them,
// model/encoder/checkpoint_converter.cc PlanKdaLayout), the low-rank forget and output gates and
// beta's b_proj (kept as stored, checkpoint_converter.cc's IsKdaGateProjection), the short
// convolutions, A_log, dt_bias and the gated output norm.
void AddKimiDeltaAttention(const TestModelSpec& s, const std::string& p,
                           const LinearAdder& linear, bool exl3,
                           std::vector<GenTensor>* t) {
  const int H = s.hidden, NH = s.linear_heads, D = s.linear_head_dim, W = NH * D;
  const bool fused = exl3 && W % 128 == 0 && H % 128 == 0;
  if (fused) {
    linear("self_attn.qkv_proj", 3 * W, H);
  } else {
    linear("self_attn.q_proj", W, H);
    linear("self_attn.k_proj", W, H);
    linear("self_attn.v_proj", W, H);
  }
  linear("self_attn.o_proj", H, W);
  for (const char* gate : {"f_a_proj", "g_a_proj"})
    t->push_back({p + "self_attn." + gate + ".weight", DType::kBF16, {D, H}, GenTensor::kGaussian, 0.02f});
  for (const char* gate : {"f_b_proj", "g_b_proj"})
    t->push_back({p + "self_attn." + gate + ".weight", DType::kBF16, {W, D}, GenTensor::kGaussian, 0.02f});
  t->push_back({p + "self_attn.b_proj.weight", DType::kBF16, {NH, H}, GenTensor::kGaussian, 0.02f});
  if (fused) {
    t->push_back({p + "self_attn.conv1d.weight", DType::kBF16, {3 * W, 1, s.linear_conv_kernel},
                  GenTensor::kGaussian, 0.3f});
  } else {
    for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"})
      t->push_back({p + "self_attn." + conv + ".weight", DType::kBF16, {W, 1, s.linear_conv_kernel},
                    GenTensor::kGaussian, 0.3f});
  }
  // exp(A_log) in [1, 16]: the forget gate's slope (its decay is bounded by linear_lower_bound).
  t->push_back({p + "self_attn.A_log", DType::kBF16, {NH}, GenTensor::kLogUniform, 1.0f, 0, 16.0f});
  t->push_back({p + "self_attn.dt_bias", DType::kBF16, {W}, GenTensor::kBias, 0.5f});
  t->push_back(NormTensor(p + "self_attn.o_norm.weight", D));
}

// Qwen3-Next's gated full attention: q_proj holds query and gate.
void AddGatedFullAttention(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                           std::vector<GenTensor>* t) {
  const int H = s.hidden, heads = s.heads, hd = s.head_dim, kv = s.kv_heads;
  linear("self_attn.q_proj", 2 * heads * hd, H);
  linear("self_attn.k_proj", kv * hd, H);
  linear("self_attn.v_proj", kv * hd, H);
  linear("self_attn.o_proj", H, heads * hd);
  t->push_back(FamilyNormTensor(s, p + "self_attn.q_norm.weight", hd));
  t->push_back(FamilyNormTensor(s, p + "self_attn.k_norm.weight", hd));
}

// Qwen4-Exp's gated DeltaNet of one layer (`linear_attn.*`, engine/cpu/linear_attention/gated_deltanet.h's
// separate-projection layout, Qwen3.5's): in_proj_qkv [q of every key head | k | v of every value
// head], in_proj_z, and in_proj_b / in_proj_a (kept as stored, as the converter and exllamav3 keep
// them), the convolution over q, k and v, A_log, dt_bias, the gated norm's weight (used as stored)
// and out_proj.
void AddQwen4ExpDeltaNet(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                         std::vector<GenTensor>* t) {
  const int H = s.hidden, kd = s.linear_key_heads * s.linear_key_head_dim,
            vd = s.linear_value_heads * s.linear_value_head_dim, nv = s.linear_value_heads;
  linear("linear_attn.in_proj_qkv", 2 * kd + vd, H);
  linear("linear_attn.in_proj_z", vd, H);
  for (const char* gate : {"in_proj_b", "in_proj_a"})
    t->push_back({p + "linear_attn." + gate + ".weight", DType::kBF16, {nv, H}, GenTensor::kGaussian, 0.02f});
  AddDeltaNetRecurrence(s, p, linear, t);
}

// Qwen4-Exp's QSA attention (`self_attn.*`, engine/cpu/attention/qsa_attention.h): Qwen3-Next's gated
// GQA (q_proj holds query and gate) with zero-centred q/k norms, and the block indexer's
// index_qk_proj (indexer_n_heads query heads and one key head) and its zero-centred norms.
void AddQsaAttention(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                     std::vector<GenTensor>* t) {
  AddGatedFullAttention(s, p, linear, t);
  linear("self_attn.indexer.index_qk_proj", (s.index_heads + 1) * s.index_head_dim, s.hidden);
  t->push_back(FamilyNormTensor(s, p + "self_attn.indexer.q_layernorm.weight", s.index_head_dim));
  t->push_back(FamilyNormTensor(s, p + "self_attn.indexer.k_layernorm.weight", s.index_head_dim));
}

// MLA (DeepSeek-V3; GLM-MoE-DSA with its lightning indexer; GLM-5.3-Flash's NoPE MLA with the
// k-pooled indexer).
void AddLatentAttention(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                        std::vector<GenTensor>* t) {
  const int H = s.hidden, heads = s.heads;
  const int qd = s.qk_nope_head_dim + s.qk_rope_head_dim;
  linear("self_attn.q_a_proj", s.q_lora_rank, H);
  t->push_back(NormTensor(p + "self_attn.q_a_layernorm.weight", s.q_lora_rank));
  linear("self_attn.q_b_proj", heads * qd, s.q_lora_rank);
  linear("self_attn.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, H);
  t->push_back(NormTensor(p + "self_attn.kv_a_layernorm.weight", s.kv_lora_rank));
  // kv_b_proj and the indexer's wk: kept dense (as the converter and exllamav3 keep them), never EXL3.
  auto dense = [&](const std::string& name, int64_t out_f, int64_t in_f) {
    t->push_back({p + name + ".weight", DType::kBF16, {out_f, in_f}, GenTensor::kGaussian, 0.02f});
  };
  dense("self_attn.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank);
  linear("self_attn.o_proj", H, heads * s.v_head_dim);
  if (s.arch == "glm_moe_dsa" || s.arch == "glm5_next") {  // the lightning indexer
    linear("self_attn.indexer.wq_b", s.index_heads * s.index_head_dim, s.q_lora_rank);
    dense("self_attn.indexer.wk", s.index_head_dim, H);
    t->push_back(NormTensor(p + "self_attn.indexer.k_norm.weight", s.index_head_dim));
    t->push_back({p + "self_attn.indexer.k_norm.bias", DType::kBF16, {s.index_head_dim},
                  GenTensor::kBias, 0.05f});
    // Router-like: kept dense (as the converter keeps it), never EXL3.
    t->push_back({p + "self_attn.indexer.weights_proj.weight", DType::kBF16,
                  {s.index_heads, H}, GenTensor::kGaussian, 0.02f});
  }
  if (s.arch == "glm5_next") {  // the k-pooled indexer's pool compressor (no ".weight": as stored)
    t->push_back({p + "self_attn.indexer.index_kpool_compress_gate", DType::kBF16, {s.index_head_dim, H},
                  GenTensor::kGaussian, 0.02f});
    t->push_back({p + "self_attn.indexer.index_kpool_compress_ape", DType::kBF16,
                  {s.index_kpool, s.index_head_dim}, GenTensor::kGaussian, 0.1f});
  }
}

// Grouped-query attention (GLM-4 MoE with q/k/v biases, Qwen3-MoE with q/k norms, Mixtral).
void AddGroupedQueryAttention(const TestModelSpec& s, const std::string& p, const LinearAdder& linear,
                              std::vector<GenTensor>* t) {
  const int H = s.hidden, heads = s.heads, hd = s.head_dim, kv = s.kv_heads;
  linear("self_attn.q_proj", heads * hd, H);
  linear("self_attn.k_proj", kv * hd, H);
  linear("self_attn.v_proj", kv * hd, H);
  linear("self_attn.o_proj", H, heads * hd);
  if (s.arch == "glm4_moe") {  // attention_bias
    t->push_back({p + "self_attn.q_proj.bias", DType::kBF16, {heads * hd}, GenTensor::kGaussian, 0.02f});
    t->push_back({p + "self_attn.k_proj.bias", DType::kBF16, {kv * hd}, GenTensor::kGaussian, 0.02f});
    t->push_back({p + "self_attn.v_proj.bias", DType::kBF16, {kv * hd}, GenTensor::kGaussian, 0.02f});
  }
  if (s.arch == "qwen3_moe") {
    t->push_back(NormTensor(p + "self_attn.q_norm.weight", hd));
    t->push_back(NormTensor(p + "self_attn.k_norm.weight", hd));
  }
}

}  // namespace

GenTensor FamilyNormTensor(const TestModelSpec& s, std::string name, int64_t n) {
  if (s.arch == "qwen3_next" || s.arch == "qwen4_exp") return GenTensor{std::move(name), DType::kBF16, {n}, GenTensor::kGaussian, 0.1f};
  return NormTensor(std::move(name), n);
}

void AddHyperConnection(const TestModelSpec& s, const std::string& prefix, std::vector<GenTensor>* t) {
  const int64_t hc = s.hc_mult, mixes = (2 + hc) * hc;
  t->push_back({prefix + "fn", DType::kBF16, {mixes, hc * s.hidden}, GenTensor::kGaussian, 0.02f});
  t->push_back({prefix + "base", DType::kBF16, {mixes}, GenTensor::kGaussian, 0.1f});
  t->push_back({prefix + "scale", DType::kBF16, {3}, GenTensor::kUniform, 0.5f, 0, 1.5f});
}

void AddGatedResidual(const TestModelSpec& s, const std::string& prefix, bool with_inject,
                      std::vector<GenTensor>* t) {
  const int64_t wide = static_cast<int64_t>(s.hc_mult) * s.hidden;
  t->push_back(FamilyNormTensor(s, prefix + "hc_norm.weight", wide));
  t->push_back({prefix + "input_mix_weight_down.weight", DType::kBF16, {s.hc_lowrank, wide}, GenTensor::kGaussian,
                0.02f});
  t->push_back({prefix + "input_mix_weight_up.weight", DType::kBF16, {wide, s.hc_lowrank}, GenTensor::kGaussian,
                0.02f});
  if (with_inject)
    t->push_back({prefix + "block_inject_weight.weight", DType::kBF16, {s.hc_mult, wide}, GenTensor::kGaussian,
                  0.02f});
}

void AddAttentionTensors(const TestModelSpec& s, int L, const std::string& p, const LinearAdder& linear,
                         bool exl3, std::vector<GenTensor>* t) {
  if (s.arch == "deepseek_v4") {
    AddDsv4Attention(s, L, p, linear, exl3, t);
  } else if (s.arch == "qwen3_next" && s.layer_types[L] == kLinear) {
    AddGatedDeltaNet(s, p, linear, t);
  } else if (s.arch == "glm5_next" && s.layer_types[L] == kLinear) {
    AddKimiDeltaAttention(s, p, linear, exl3, t);
  } else if (s.arch == "qwen4_exp" && s.layer_types[L] == kLinear) {
    AddQwen4ExpDeltaNet(s, p, linear, t);
  } else if (s.arch == "qwen4_exp") {
    AddQsaAttention(s, p, linear, t);
  } else if (s.arch == "qwen3_next") {
    AddGatedFullAttention(s, p, linear, t);
  } else if (IsLatentAttention(s.arch)) {
    AddLatentAttention(s, p, linear, t);
  } else {
    AddGroupedQueryAttention(s, p, linear, t);
  }
}

}  // namespace exl3

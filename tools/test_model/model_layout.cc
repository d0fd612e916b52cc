#include "tools/test_model/model_layout.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "tools/test_model/attention_layout.h"
#include "tools/test_model/exl3_linear_tensors.h"

namespace exl3 {
namespace {

// One linear layer [out_f, in_f]: EXL3 with random trellis bits (exl3, both dimensions multiples
// of 128) or an HF bf16 weight. expert >= 0: a routed expert's linear, whose K and codebook
// SyntheticOptions' per-expert cycles may set.
void AddLinear(const std::string& prefix, int out_f, int in_f, LinearRole role, bool exl3,
               const SyntheticOptions* so, std::vector<GenTensor>* out, int expert = -1) {
  if (!exl3 || out_f % 128 != 0 || in_f % 128 != 0) {
    out->push_back({prefix + ".weight", DType::kBF16, {out_f, in_f}, GenTensor::kGaussian, 0.02f});
    return;
  }
  int K = BitsOf(*so, role);
  Codebook codebook = so->codebook;
  if (expert >= 0 && !so->expert_bits_cycle.empty()) {
    K = so->expert_bits_cycle[expert % so->expert_bits_cycle.size()];
  }
  if (expert >= 0 && !so->expert_codebook_cycle.empty()) {
    codebook = so->expert_codebook_cycle[expert % so->expert_codebook_cycle.size()];
  }
  // |svh| = 1 / (1.24 sqrt(in)): unit-variance inputs give roughly unit-variance outputs.
  const Exl3SignForm signs{SignVectors::kHalf, 1.0f,
                           static_cast<float>(1.0 / (1.24 * std::sqrt(static_cast<double>(in_f))))};
  AddExl3Linear(prefix, out_f, in_f, K, codebook, signs, out);
}

// The expert-related tensors of MoE layer L in HF form (bf16 weights) or EXL3 form.
void AddMoeTensors(const TestModelSpec& s, const MoeConfig& cfg, int L, bool exl3,
                   const SyntheticOptions* so, std::vector<GenTensor>* out) {
  const int H = s.hidden;
  out->push_back({RouterWeightKey(cfg, L), DType::kBF16, {s.experts, H}, GenTensor::kGaussian, 0.02f});
  const std::string bias = CorrectionBiasKey(cfg, L);
  // GLM-5.3-Flash's checkpoints (tests/fixtures/engine/glm5_next_all) store the bias in bf16.
  const DType bias_dtype = s.arch == "glm5_next" ? DType::kBF16 : DType::kF32;
  if (!bias.empty()) out->push_back({bias, bias_dtype, {s.experts}, GenTensor::kBias, 0.05f});
  const std::string hash = HashTableKey(cfg, L);
  if (!hash.empty()) {  // DeepSeek-V4's hash-routed layers: top_k distinct experts per token id
    GenTensor t{hash, DType::kI64, {s.vocab, s.top_k}, GenTensor::kHashTable};
    t.flag = s.top_k;
    t.high = static_cast<float>(s.experts);
    out->push_back(t);
  }
  const std::string shared_gate = SharedExpertGateKey(cfg, L);
  if (!shared_gate.empty()) {
    out->push_back({shared_gate, DType::kBF16, {1, H}, GenTensor::kGaussian, 0.02f});
  }
  const int I = s.intermediate;
  for (int e = 0; e < s.experts; ++e) {
    AddLinear(RoutedExpertPrefix(cfg, L, e, Projection::kGate), I, H, LinearRole::kExpert, exl3, so, out, e);
    AddLinear(RoutedExpertPrefix(cfg, L, e, Projection::kUp), I, H, LinearRole::kExpert, exl3, so, out, e);
    AddLinear(RoutedExpertPrefix(cfg, L, e, Projection::kDown), H, I, LinearRole::kExpertDown, exl3, so, out, e);
  }
  if (cfg.has_shared_expert()) {
    const int SI = cfg.shared_intermediate_size;
    AddLinear(SharedExpertPrefix(cfg, L, Projection::kGate), SI, H, LinearRole::kExpert, exl3, so, out);
    AddLinear(SharedExpertPrefix(cfg, L, Projection::kUp), SI, H, LinearRole::kExpert, exl3, so, out);
    AddLinear(SharedExpertPrefix(cfg, L, Projection::kDown), H, SI, LinearRole::kExpertDown, exl3, so, out);
  }
}

// Qwen4-Exp's MoE block under layer prefix p (the trunk's layers and the MTP head's, whose names
// follow the same pattern): softmax router, per-expert routed experts, the gated shared expert.
void AddQwen4ExpMoe(const TestModelSpec& s, const std::string& p, bool exl3, const SyntheticOptions* so,
                    std::vector<GenTensor>* t) {
  const int H = s.hidden, I = s.intermediate;
  t->push_back({p + "mlp.gate.weight", DType::kBF16, {s.experts, H}, GenTensor::kGaussian, 0.02f});
  t->push_back({p + "mlp.shared_expert_gate.weight", DType::kBF16, {1, H}, GenTensor::kGaussian, 0.02f});
  for (int e = 0; e < s.experts; ++e) {
    const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
    AddLinear(x + "gate_proj", I, H, LinearRole::kExpert, exl3, so, t, e);
    AddLinear(x + "up_proj", I, H, LinearRole::kExpert, exl3, so, t, e);
    AddLinear(x + "down_proj", H, I, LinearRole::kExpertDown, exl3, so, t, e);
  }
  AddLinear(p + "mlp.shared_expert.gate_proj", I, H, LinearRole::kExpert, exl3, so, t);
  AddLinear(p + "mlp.shared_expert.up_proj", I, H, LinearRole::kExpert, exl3, so, t);
  AddLinear(p + "mlp.shared_expert.down_proj", H, I, LinearRole::kExpertDown, exl3, so, t);
}

// Qwen4-Exp's PLE layer under layer prefix p (engine/cpu/residual/ple_layer.h): the n-gram table
// in split_ngram_parts pieces (every piece but the last of ceil(rows / parts) rows, as
// transformers saves it and exllamav3 routes rows), the hashing constants transformers saves as
// buffers (exllamav3 reads them; the engine checks them), key_proj / value_proj and the per-stream
// norms (kept as stored: exllamav3 runs them in fp16), and the dilated conv.
void AddPleLayer(const TestModelSpec& s, int ple_index, const std::string& p, std::vector<GenTensor>* t) {
  const engine::NgramHash hash = Qwen4ExpNgramHash(s, ple_index);
  const int64_t wide = static_cast<int64_t>(s.hc_mult) * s.hidden, E = s.ple_embed_dim,
                D = E / hash.num_heads(), rows = hash.table_rows();
  const std::string e = p + "ple.ple_embedding.";
  const int64_t chunk = (rows + s.split_ngram_parts - 1) / s.split_ngram_parts;
  for (int i = 0; i < s.split_ngram_parts; ++i) {
    t->push_back({absl::StrCat(e, "ngram_embedding.shard_", i, ".weight"), DType::kBF16,
                  {std::min(chunk, rows - i * chunk), D}, GenTensor::kGaussian, 0.02f});
  }
  auto constants = [&](const std::string& name, std::vector<int64_t> values) {
    GenTensor c{e + name, DType::kI64, {static_cast<int64_t>(values.size())}, GenTensor::kInt64Values};
    c.values = std::move(values);
    t->push_back(std::move(c));
  };
  constants("layer_multipliers", {hash.multipliers().begin(), hash.multipliers().end()});
  std::vector<int64_t> offsets;
  int64_t first = 0;
  for (int64_t size : hash.head_sizes()) {
    offsets.push_back(first);
    first += size;
  }
  constants("ngram_heads_offsets", offsets);
  constants("ngram_heads_vocab_sizes", hash.head_sizes());
  t->push_back({p + "ple.key_proj.weight", DType::kBF16, {wide, E}, GenTensor::kGaussian, 0.02f});
  t->push_back({p + "ple.value_proj.weight", DType::kBF16, {s.hidden, E}, GenTensor::kGaussian, 0.02f});
  for (const char* norm : {"norm_key", "norm_query", "norm_conv"})
    t->push_back(FamilyNormTensor(s, p + "ple." + norm + ".weight", wide));
  t->push_back({p + "ple.conv1d.weight", DType::kBF16, {wide, 1, s.ple_conv_kernel}, GenTensor::kGaussian, 0.3f});
}

// Qwen4-Exp's decoder block under prefix p (layer L's kind from s.layer_types): the two gated
// residuals, the PLE layer where s.ple_layer_ids names it (ple: true), the DeltaNet or QSA, the MoE.
void AddQwen4ExpBlock(const TestModelSpec& s, int L, const std::string& p, bool ple, bool exl3,
                      const SyntheticOptions* so, std::vector<GenTensor>* t) {
  auto linear = [&](const std::string& name, int out_f, int in_f) {
    AddLinear(p + name, out_f, in_f, LinearRole::kAttentionOrDense, exl3, so, t);
  };
  AddGatedResidual(s, p + "attn_hyper_connection.", /*with_inject=*/true, t);
  AddGatedResidual(s, p + "mlp_hyper_connection.", /*with_inject=*/true, t);
  if (ple) {
    const auto at = std::find(s.ple_layer_ids.begin(), s.ple_layer_ids.end(), L + 1);
    AddPleLayer(s, static_cast<int>(at - s.ple_layer_ids.begin()), p, t);
  }
  AddAttentionTensors(s, L, p, linear, exl3, t);
  AddQwen4ExpMoe(s, p, exl3, so, t);
}

// Qwen4-Exp's MTP head (engine/cpu/mtp/qwen4exp_mtp_head.h): fc_hidden / fc_embedding and their
// norms, one QSA MoE block mtp.layers.0.*, the combine-less mixer.
void AddQwen4ExpMtp(const TestModelSpec& s, bool exl3, const SyntheticOptions* so, std::vector<GenTensor>* t) {
  const int H = s.hidden;
  TestModelSpec mtp = s;  // its block: full (QSA) attention
  mtp.layer_types = {layer_kind::kIndexed};
  AddQwen4ExpBlock(mtp, 0, "mtp.layers.0.", /*ple=*/false, exl3, so, t);
  t->push_back(FamilyNormTensor(s, "mtp.pre_fc_norm_hidden.weight", static_cast<int64_t>(s.hc_mult) * H));
  t->push_back(FamilyNormTensor(s, "mtp.pre_fc_norm_embedding.weight", H));
  AddLinear("mtp.fc_hidden", H, H, LinearRole::kAttentionOrDense, exl3, so, t);
  AddLinear("mtp.fc_embedding", H, H, LinearRole::kAttentionOrDense, exl3, so, t);
  AddGatedResidual(s, "mtp.hyper_connection_mixer.", /*with_inject=*/false, t);
}

// Every tensor of decoder layer L: norms, attention (the family's), dense MLP or MoE block.
void AddLayerTensors(const TestModelSpec& s, const MoeConfig& cfg, int L, bool exl3,
                     const SyntheticOptions* so, std::vector<GenTensor>* t) {
  const int H = s.hidden;
  const std::string p = LayerPrefix(cfg, L);
  auto linear = [&](const std::string& name, int out_f, int in_f) {
    AddLinear(p + name, out_f, in_f, LinearRole::kAttentionOrDense, exl3, so, t);
  };
  if (s.arch == "qwen4_exp") {  // gated residuals instead of norms; every layer MoE
    const bool ple = std::find(s.ple_layer_ids.begin(), s.ple_layer_ids.end(), L + 1) != s.ple_layer_ids.end();
    AddQwen4ExpBlock(s, L, p, ple, exl3, so, t);
    return;
  }
  if (s.arch == "deepseek_v4") {  // its original names; every layer MoE
    t->push_back(NormTensor(p + "attn_norm.weight", H));
    t->push_back(NormTensor(p + "ffn_norm.weight", H));
    AddHyperConnection(s, p + "hc_attn_", t);
    AddHyperConnection(s, p + "hc_ffn_", t);
    AddAttentionTensors(s, L, p, linear, exl3, t);
    AddMoeTensors(s, cfg, L, exl3, so, t);
    return;
  }
  t->push_back(FamilyNormTensor(s, p + "input_layernorm.weight", H));
  if (s.arch == "glm5_next" && L < s.layers) {  // hyper-connections around both sublayers of every
                                                 // decoder layer (the MTP layer, L == layers, has none)
    AddHyperConnection(s, p + "hc_attn_", t);
    AddHyperConnection(s, p + "hc_ffn_", t);
  }
  AddAttentionTensors(s, L, p, linear, exl3, t);
  t->push_back(FamilyNormTensor(s, p + "post_attention_layernorm.weight", H));
  if (cfg.IsMoeLayer(L)) {
    AddMoeTensors(s, cfg, L, exl3, so, t);
  } else {
    linear("mlp.gate_proj", s.dense_intermediate, H);
    linear("mlp.up_proj", s.dense_intermediate, H);
    linear("mlp.down_proj", H, s.dense_intermediate);
  }
}

}  // namespace

engine::NgramHash Qwen4ExpNgramHash(const TestModelSpec& s, int ple_index) {
  engine::PleConfig ple;
  ple.embed_dim = s.ple_embed_dim;
  ple.conv_kernel = s.ple_conv_kernel;
  ple.ngram_size = s.ngram_size;
  ple.heads_per_ngram = s.heads_per_ngram;
  ple.vocab_size_base = s.ngram_vocab_size_base;
  ple.vocab_divisor = 128;  // make_ngram_vocab_size_divisible_by, as family_config.cc writes it
  ple.seed = 1234;          // seed
  ple.split_parts = s.split_ngram_parts;
  ple.eos_token_id = 1;
  return engine::NgramHash::Build(ple, s.vocab, ple_index);
}

int BitsOf(const SyntheticOptions& so, LinearRole role) {
  switch (role) {
    case LinearRole::kExpertDown: return so.down_bits > 0 ? so.down_bits : so.bits;
    case LinearRole::kAttentionOrDense: return so.attention_bits > 0 ? so.attention_bits : so.bits;
    case LinearRole::kHead: return so.head_bits > 0 ? so.head_bits : so.bits;
    case LinearRole::kExpert: break;
  }
  return so.bits;
}

std::vector<std::vector<GenTensor>> WholeModelShards(const TestModelSpec& s, const MoeConfig& cfg,
                                                     bool exl3, const SyntheticOptions* so) {
  std::vector<std::vector<GenTensor>> shards(s.layers);
  shards[0].push_back({TextModelPrefix(cfg) + "embed_tokens.weight", DType::kBF16, {s.vocab, s.hidden},
                       GenTensor::kGaussian, 0.02f});
  for (int L = 0; L < s.layers; ++L) AddLayerTensors(s, cfg, L, exl3, so, &shards[L]);
  std::vector<GenTensor>& last = shards.back();
  if (s.arch == "qwen4_exp") {  // no final norm: the mixer collapses the streams before the head
    AddGatedResidual(s, TextModelPrefix(cfg) + "hyper_connection_mixer.", /*with_inject=*/false, &last);
  } else {
    last.push_back(FamilyNormTensor(s, TextModelPrefix(cfg) + "norm.weight", s.hidden));
  }
  if (s.arch == "deepseek_v4") {  // hc_head collapses the streams before the final norm
    const int64_t hc = s.hc_mult;
    last.push_back({"model.hc_head.hc_fn", DType::kBF16, {hc, hc * s.hidden}, GenTensor::kGaussian, 0.02f});
    last.push_back({"model.hc_head.hc_base", DType::kBF16, {hc}, GenTensor::kGaussian, 0.1f});
    last.push_back({"model.hc_head.hc_scale", DType::kBF16, {1}, GenTensor::kUniform, 0.5f, 0, 1.5f});
  }
  AddLinear(s.arch == "deepseek_v4" ? "head" : "lm_head", s.vocab, s.hidden, LinearRole::kHead, exl3,
            so, &last);
  if (s.mtp && s.arch == "qwen4_exp") {
    AddQwen4ExpMtp(s, exl3, so, &shards.emplace_back());
  } else if (s.mtp) {  // the MTP layer: a MoE decoder layer at index s.layers plus its own tensors
    MoeConfig with_mtp = cfg;
    with_mtp.num_hidden_layers = s.layers + 1;
    with_mtp.moe_layers.resize(s.layers + 1, false);
    with_mtp.moe_layers[s.layers] = true;
    with_mtp.hash_routed_layers.resize(s.layers + 1, false);
    std::vector<GenTensor>& mtp = shards.emplace_back();
    TestModelSpec mtp_spec = s;  // GLM-5.3-Flash's MTP layer: MLA with its own k-pooled indexer
    if (s.arch == "glm5_next") mtp_spec.layer_types.push_back(layer_kind::kIndexed);
    AddLayerTensors(mtp_spec, with_mtp, s.layers, exl3, so, &mtp);
    const std::string p = LayerPrefix(cfg, s.layers);
    for (const char* norm : {"enorm.weight", "hnorm.weight", "shared_head.norm.weight"})
      mtp.push_back(FamilyNormTensor(s, p + norm, s.hidden));
    AddLinear(p + "eh_proj", s.hidden, 2 * s.hidden, LinearRole::kAttentionOrDense, exl3, so, &mtp);
  }
  return shards;
}

std::vector<std::vector<GenTensor>> SyntheticShards(const TestModelSpec& s, const MoeConfig& cfg,
                                                    const SyntheticOptions& so) {
  if (so.whole_model) return WholeModelShards(s, cfg, /*exl3=*/true, &so);
  std::vector<std::vector<GenTensor>> shards;
  for (int L : cfg.MoeLayers()) {
    shards.emplace_back();
    AddMoeTensors(s, cfg, L, /*exl3=*/true, &so, &shards.back());
  }
  return shards;
}

}  // namespace exl3

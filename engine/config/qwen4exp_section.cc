#include "engine/config/qwen4exp_section.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "engine/config/fields.h"
#include "engine/config/qwen3next_section.h"
#include "engine/config/qwen4exp_config.h"

namespace exl3::engine {
namespace {

using nlohmann::json;

bool Has(const json& j, const char* f) { return j.contains(f) && !j[f].is_null(); }

// An integer field: `fallback` when absent (or null, as transformers writes unset fields).
absl::StatusOr<int64_t> IntField(const json& j, const char* f, int64_t fallback, const std::string& source) {
  if (!Has(j, f)) return fallback;
  if (!j[f].is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(source, ": text_config.", f, " is not an integer"));
  return j[f].get<int64_t>();
}

}  // namespace

// Qwen4-Exp's own fields (hyper-connections, QSA indexer, PLE, the output gate, the image and
// video token ids) into cfg->qwen4exp.
absl::Status ReadQwen4ExpFields(const json& text, const json& top, const std::string& source,
                                ModelConfig* cfg) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", why));
  };
  auto q = std::make_shared<Qwen4ExpConfig>();
  EXL3_ASSIGN_OR_RETURN(int64_t hc_count, IntField(text, "hc_count", 4, source));
  EXL3_ASSIGN_OR_RETURN(int64_t hc_lowrank, IntField(text, "hc_lowrank", 320, source));
  if (hc_count <= 1 || hc_count > 64) return bad(absl::StrCat("hc_count ", hc_count, " (Qwen4-Exp needs 2..64 streams)"));
  if (hc_lowrank <= 0 || hc_lowrank > (1 << 20)) return bad(absl::StrCat("hc_lowrank ", hc_lowrank, " must be positive"));
  q->hc_count = static_cast<int>(hc_count);
  q->hc_lowrank = static_cast<int>(hc_lowrank);

  std::string gate = "silu";  // hidden_act (ReadQwen3NextLayers accepted silu only)
  if (Has(text, "output_gate_type")) {
    if (!text["output_gate_type"].is_string()) return bad("text_config.output_gate_type is not a string");
    gate = text["output_gate_type"].get<std::string>();
  }
  if (gate == "silu") {
    q->output_gate = OutputGateActivation::kSilu;
  } else if (gate == "sigmoid") {
    q->output_gate = OutputGateActivation::kSigmoid;
  } else {
    return absl::UnimplementedError(
        absl::StrCat(source, ": output_gate_type '", gate, "' (Qwen4-Exp's is sigmoid or silu)"));
  }

  // QSA: every indexed_attention layer has an indexer, so its five fields are needed.
  const bool has_attention = std::count(cfg->layer_mixers.begin(), cfg->layer_mixers.end(),
                                        TokenMixer::kAttention) > 0;
  const char* qsa_fields[] = {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                              "indexer_budget", "indexer_compress_ratio"};
  std::vector<std::string> missing;
  for (const char* f : qsa_fields)
    if (!Has(text, f)) missing.push_back(f);
  if (has_attention && !missing.empty())
    return bad(absl::StrCat("indexed_attention layers need the QSA fields; missing: ",
                            absl::StrJoin(missing, ", ")));
  if (missing.empty()) {
    int64_t v[5];
    for (int i = 0; i < 5; ++i) {
      EXL3_ASSIGN_OR_RETURN(v[i], IntField(text, qsa_fields[i], 0, source));
      if (v[i] <= 0 || v[i] > (1 << 24)) return bad(absl::StrCat(qsa_fields[i], " ", v[i], " must be positive"));
    }
    if (v[1] != 1) return bad(absl::StrCat("indexer_kv_heads ", v[1], " (Qwen4-Exp's QSA has one key head)"));
    if (v[3] % v[4] != 0)
      return bad(absl::StrCat("indexer_budget ", v[3], " is not a multiple of indexer_compress_ratio ", v[4]));
    q->indexer = {static_cast<int>(v[0]), static_cast<int>(v[2]), static_cast<int>(v[3]),
                  static_cast<int>(v[4])};
  }

  // PLE.
  PleConfig& p = q->ple;
  std::vector<int> ids;
  if (Has(text, "ple_layer_ids")) {
    if (!text["ple_layer_ids"].is_array()) return bad("text_config.ple_layer_ids is not a list");
    for (const json& e : text["ple_layer_ids"]) {
      if (!e.is_number_integer()) return bad("text_config.ple_layer_ids holds a non-integer");
      const int64_t id = e.get<int64_t>();
      if (id < 1 || id > cfg->num_layers)
        return bad(absl::StrCat("ple_layer_ids holds ", id, ": one-based layer ids in [1, ", cfg->num_layers, "]"));
      ids.push_back(static_cast<int>(id));
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (int id : ids) {
    if (cfg->layer_mixers[id - 1] != TokenMixer::kLinearAttention)
      return bad(absl::StrCat("ple_layer_ids holds ", id, ": PLE sits on linear_attention layers only"));
    p.layers.push_back(id - 1);
  }
  EXL3_ASSIGN_OR_RETURN(int64_t embed_dim, IntField(text, "ple_embed_dim", cfg->hidden_size, source));
  EXL3_ASSIGN_OR_RETURN(int64_t conv_kernel, IntField(text, "ple_conv_kernel_size", 4, source));
  EXL3_ASSIGN_OR_RETURN(int64_t ngram_size, IntField(text, "ngram_size", 3, source));
  EXL3_ASSIGN_OR_RETURN(int64_t heads, IntField(text, "heads_per_ngram", 8, source));
  EXL3_ASSIGN_OR_RETURN(p.vocab_size_base, IntField(text, "ngram_vocab_size_base", 20000000, source));
  EXL3_ASSIGN_OR_RETURN(int64_t divisor, IntField(text, "make_ngram_vocab_size_divisible_by", 128, source));
  EXL3_ASSIGN_OR_RETURN(p.seed, IntField(text, "seed", 1234, source));
  EXL3_ASSIGN_OR_RETURN(int64_t parts, IntField(text, "split_ngram_parts", 512, source));
  if (!p.layers.empty()) {
    if (ngram_size < 2 || ngram_size > 16 || heads < 1 || heads > 1024)
      return bad(absl::StrCat("ngram_size ", ngram_size, " / heads_per_ngram ", heads,
                              ": PLE needs n-grams of 2..16 tokens and at least one head"));
    const int64_t n_heads = (ngram_size - 1) * heads;
    if (embed_dim <= 0 || embed_dim % n_heads != 0 || embed_dim > (1 << 20))
      return bad(absl::StrCat("ple_embed_dim ", embed_dim, " must be a positive multiple of the ",
                              n_heads, " n-gram heads"));
    if (conv_kernel < 1 || conv_kernel > 64) return bad(absl::StrCat("ple_conv_kernel_size ", conv_kernel));
    if (p.vocab_size_base < 2 || p.vocab_size_base > (int64_t{1} << 40))
      return bad(absl::StrCat("ngram_vocab_size_base ", p.vocab_size_base));
    if (divisor < 1 || divisor > (1 << 20)) return bad(absl::StrCat("make_ngram_vocab_size_divisible_by ", divisor));
    if (parts < 1 || parts > (1 << 20)) return bad(absl::StrCat("split_ngram_parts ", parts));
    if (!Has(text, "eos_token_id")) return bad("text_config.eos_token_id must be set when PLE layers are enabled");
    const json& eos = text["eos_token_id"];
    if (eos.is_number_integer()) {
      p.eos_token_id = eos.get<int32_t>();
    } else if (eos.is_array() && !eos.empty() && eos[0].is_number_integer()) {
      p.eos_token_id = eos[0].get<int32_t>();  // transformers uses the first
    } else {
      return bad("text_config.eos_token_id must be set when PLE layers are enabled");
    }
    if (p.eos_token_id < 0 || p.eos_token_id >= cfg->vocab_size)
      return bad(absl::StrCat("eos_token_id ", p.eos_token_id, " outside the vocabulary"));
  }
  p.embed_dim = static_cast<int>(embed_dim);
  p.conv_kernel = static_cast<int>(conv_kernel);
  p.ngram_size = static_cast<int>(ngram_size);
  p.heads_per_ngram = static_cast<int>(heads);
  p.vocab_divisor = static_cast<int>(divisor);
  p.split_parts = static_cast<int>(parts);

  EXL3_ASSIGN_OR_RETURN(cfg->media_placeholders, ReadMediaPlaceholders(top, 248056, 248057, cfg->vocab_size, source));
  cfg->qwen4exp = std::move(q);
  return absl::OkStatus();
}

absl::Status ReadQwen4ExpSection(const ConfigFile& file, ModelConfig* cfg) {
  const std::string& source = file.source();
  cfg->qk_norm = true;
  cfg->attention_output_gate = true;
  cfg->norm_weights = NormWeightConvention::kOffsetFromOne;
  cfg->attention = AttentionKind::kQsa;
  EXL3_RETURN_IF_ERROR(ReadQwen3NextLayers(file.text(), source, /*indexed=*/true, cfg));
  EXL3_RETURN_IF_ERROR(ReadQwen4ExpFields(file.text(), file.top(), source, cfg));
  // Qwen4ExpTextConfig skips Qwen3.5's 0.25 default partial_rotary_factor.
  EXL3_RETURN_IF_ERROR(ReadRope(file.text(), cfg->head_dim, /*default_partial=*/1.0,
                                cfg->max_position_embeddings, source, &cfg->rope));
  if (cfg->rope.rotary_dim > cfg->qwen4exp->indexer.head_dim && cfg->qwen4exp->indexer.head_dim > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the rotary dimensions (", cfg->rope.rotary_dim,
        ") must fit the QSA index head (indexer_head_dim ", cfg->qwen4exp->indexer.head_dim, ")"));
  cfg->attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg->head_dim)));
  return absl::OkStatus();
}

}  // namespace exl3::engine

#include "tools/test_model/resolve_test_model_spec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/moe_config.h"
#include "tools/test_model/family_config.h"
#include "tools/test_model/model_layout.h"

namespace exl3 {
namespace {

using layer_kind::kCsa;
using layer_kind::kFull;
using layer_kind::kHca;
using layer_kind::kIndexed;
using layer_kind::kLinear;
using layer_kind::kSliding;

// DeepSeek-V4's and Qwen3-Next's per-layer layer_types: the family default when none are
// given, else checked.
absl::Status ResolveLayerTypes(TestModelSpec& s) {
  if (s.arch != "deepseek_v4" && s.arch != "qwen3_next" && s.arch != "glm5_next" && s.arch != "qwen4_exp") {
    if (!s.layer_types.empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "--layer-types applies to deepseek_v4, qwen3_next, glm5_next and qwen4_exp, not ", s.arch));
    return absl::OkStatus();
  }
  const bool v4 = s.arch == "deepseek_v4";
  // Qwen3-Next's full attention, GLM-5.3-Flash's and Qwen4-Exp's indexed attention (Qwen4-Exp's
  // release name full_attention is read as indexed_attention, as transformers reads it).
  const char* attention = s.arch == "glm5_next" || s.arch == "qwen4_exp" ? kIndexed : kFull;
  if (s.arch == "qwen4_exp")
    for (std::string& t : s.layer_types)
      if (t == kFull) t = kIndexed;
  if (s.layer_types.empty()) {
    // DeepSeek-V4: layer 0 sliding window, then CSA and HCA alternating (every kind present from
    // three layers on). Qwen3-Next (GLM-5.3-Flash): every full_attention_interval-th layer full
    // (indexed) attention, the rest linear: transformers' pattern of three to one.
    int interval = s.full_attention_interval > 0 ? s.full_attention_interval : std::min(4, std::max(s.layers, 1));
    for (int l = 0; l < s.layers; ++l) {
      if (v4) {
        s.layer_types.push_back(l == 0 ? kSliding : (l % 2 == 1 ? kCsa : kHca));
      } else {
        s.layer_types.push_back((l + 1) % interval == 0 ? attention : kLinear);
      }
    }
  } else if (s.full_attention_interval > 0) {
    return absl::InvalidArgumentError("--layer-types and --full-attention-interval both name the layer kinds");
  }
  if (static_cast<int>(s.layer_types.size()) != s.layers)
    return absl::InvalidArgumentError(absl::StrCat("--layer-types names ", s.layer_types.size(),
                                                   " layers; the model has ", s.layers));
  for (const std::string& t : s.layer_types) {
    const bool ok = v4 ? (t == kSliding || t == kCsa || t == kHca) : (t == kLinear || t == attention);
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat(
          "--layer-types holds '", t, "' (", s.arch, ": ",
          v4 ? absl::StrCat(kSliding, ", ", kCsa, " or ", kHca) : absl::StrCat(kLinear, " or ", attention), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckDsv4Shape(const TestModelSpec& s) {
  auto bad = [](const std::string& why) { return absl::InvalidArgumentError(why); };
  if (s.kv_heads != 1) return bad("deepseek_v4 has one shared key/value head (--kv-heads 1)");
  if (s.shared != 1) return bad("deepseek_v4 has exactly one shared expert (--shared 1)");
  if (s.dense_layers != 0) return bad("deepseek_v4 has no dense layers (--dense-layers 0)");
  if (s.qk_rope_head_dim < 2 || s.qk_rope_head_dim % 2 != 0 || s.qk_rope_head_dim > s.head_dim)
    return bad(absl::StrCat("--qk-rope-head-dim ", s.qk_rope_head_dim, " must be even and within --head-dim ",
                            s.head_dim));
  if (s.q_lora_rank < 1 || s.sliding_window < 1 || s.csa_compress_rate < 1 || s.hca_compress_rate < 1 ||
      s.hc_mult < 1 || s.hc_sinkhorn_iters < 1 || s.o_groups < 1 || s.o_lora_rank < 1)
    return bad("--q-lora-rank, --sliding-window, --compress-rates, --hc-mult, --hc-sinkhorn-iters, --o-groups "
               "and --o-lora-rank must be positive");
  if ((s.heads * s.head_dim) % s.o_groups != 0)
    return bad(absl::StrCat("--o-groups ", s.o_groups, " must divide heads x head_dim (", s.heads * s.head_dim, ")"));
  if (s.hash_layers < 0 || s.hash_layers > s.layers)
    return bad(absl::StrCat("--hash-layers must be in 0..", s.layers));
  if (std::find(s.layer_types.begin(), s.layer_types.end(), kCsa) != s.layer_types.end() &&
      (s.index_heads < 1 || s.index_topk < 1 || s.index_head_dim < s.qk_rope_head_dim))
    return bad(absl::StrCat("--index-heads ", s.index_heads, " and --index-topk ", s.index_topk,
                            " must be >= 1 and --index-head-dim ", s.index_head_dim, " >= --qk-rope-head-dim ",
                            s.qk_rope_head_dim, " (a compressed_sparse_attention layer exists)"));
  return absl::OkStatus();
}

absl::Status CheckQwen3NextShape(const TestModelSpec& s) {
  if (s.linear_key_heads < 1 || s.linear_value_heads < 1 || s.linear_key_head_dim < 1 ||
      s.linear_value_head_dim < 1 || s.linear_conv_kernel < 1 ||
      s.linear_value_heads % s.linear_key_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "--linear-key-heads ", s.linear_key_heads, ", --linear-value-heads ", s.linear_value_heads,
        ", --linear-key-head-dim ", s.linear_key_head_dim, ", --linear-value-head-dim ",
        s.linear_value_head_dim, ", --linear-conv-kernel ", s.linear_conv_kernel,
        ": sizes must be positive and value heads a multiple of key heads"));
  if (s.shared > 1) return absl::InvalidArgumentError("qwen3_next has at most one (gated) shared expert (--shared 0 or 1)");
  return absl::OkStatus();
}

// What Glm5NextTextConfig and the engine (engine/config/glm5next_config.h) require of the shape.
absl::Status CheckGlm5NextShape(const TestModelSpec& s) {
  auto bad = [](const std::string& why) { return absl::InvalidArgumentError(why); };
  if (s.qk_rope_head_dim != 0)
    return bad(absl::StrCat("glm5_next's attention has no rope (--qk-rope-head-dim 0), got ", s.qk_rope_head_dim));
  if (s.kv_heads != s.heads)
    return bad(absl::StrCat("glm5_next's MLA has as many KV heads as heads (--kv-heads ", s.heads, ")"));
  if (s.q_lora_rank < 1 || s.kv_lora_rank < 1 || s.qk_nope_head_dim < 1 || s.v_head_dim < 1)
    return bad("--q-lora-rank, --kv-lora-rank, --qk-nope-head-dim and --v-head-dim must be positive");
  if (s.linear_heads < 1 || s.linear_head_dim < 1 || s.linear_conv_kernel < 1)
    return bad(absl::StrCat("--linear-heads ", s.linear_heads, ", --linear-head-dim ", s.linear_head_dim,
                            ", --linear-conv-kernel ", s.linear_conv_kernel, " must be positive"));
  if (s.index_heads < 1 || s.index_head_dim < 1 || s.index_kpool < 1 || s.index_topk < 1 ||
      s.index_topk % s.index_kpool != 0)
    return bad(absl::StrCat("--index-heads ", s.index_heads, ", --index-head-dim ", s.index_head_dim,
                            " and --index-kpool ", s.index_kpool, " must be positive and --index-topk ",
                            s.index_topk, " a positive multiple of --index-kpool"));
  if (s.hc_mult < 1 || s.hc_sinkhorn_iters < 1) return bad("--hc-mult and --hc-sinkhorn-iters must be positive");
  return absl::OkStatus();
}

// What Qwen4ExpTextConfig, the engine (engine/config/qwen4exp_section.cc) and, with the release
// layout, exllamav3 1.6.5 require of the shape; fills ple_layer_ids and ple_embed_dim.
absl::Status CheckQwen4ExpShape(TestModelSpec& s) {
  auto bad = [](const std::string& why) { return absl::InvalidArgumentError(why); };
  EXL3_RETURN_IF_ERROR(CheckQwen3NextShape(s));
  if (s.shared != 1) return bad("qwen4_exp has exactly one (gated) shared expert (--shared 1)");
  if (s.dense_layers != 0) return bad("qwen4_exp has every layer MoE (--dense-layers 0)");
  if (s.hc_mult < 2 || s.hc_mult > 64 || s.hc_lowrank < 1)
    return bad(absl::StrCat("--hc-mult ", s.hc_mult, " must be in 2..64 and --hc-lowrank ", s.hc_lowrank,
                            " positive (hc_count, hc_lowrank)"));
  if (s.index_heads < 1 || s.index_head_dim < 1 || s.index_kpool < 1 || s.index_topk < 1 ||
      s.index_topk % s.index_kpool != 0)
    return bad(absl::StrCat("--index-heads ", s.index_heads, " and --index-head-dim ", s.index_head_dim,
                            " (indexer_n_heads, indexer_head_dim) must be positive and --index-topk ", s.index_topk,
                            " (indexer_budget) a positive multiple of --index-kpool ", s.index_kpool,
                            " (indexer_compress_ratio)"));
  // Rope on a quarter of each head (Qwen3.5's partial_rotary_factor): even, within the index head.
  if (s.head_dim % 8 != 0 || s.head_dim / 4 > s.index_head_dim)
    return bad(absl::StrCat("qwen4_exp rotates a quarter of each head: --head-dim ", s.head_dim,
                            " must be a multiple of 8 and a quarter of it fit --index-head-dim ", s.index_head_dim));
  if (s.ngram_size < 2 || s.ngram_size > 16 || s.heads_per_ngram < 1 || s.ple_conv_kernel < 1 ||
      s.ngram_vocab_size_base < 2 || s.ngram_vocab_size_base > (int64_t{1} << 40) || s.split_ngram_parts < 0)
    return bad(absl::StrCat("--ngram-size ", s.ngram_size, " (2..16), --heads-per-ngram ", s.heads_per_ngram,
                            ", --ple-conv-kernel ", s.ple_conv_kernel, ", --ngram-vocab-size-base ",
                            s.ngram_vocab_size_base, " (>= 2) and --split-ngram-parts ", s.split_ngram_parts,
                            " must be positive"));
  if (s.ple_layer_ids.empty()) {  // the first linear-attention layer, if any
    for (int l = 0; l < s.layers; ++l) {
      if (s.layer_types[l] == kLinear) {
        s.ple_layer_ids.push_back(l + 1);
        break;
      }
    }
  }
  std::sort(s.ple_layer_ids.begin(), s.ple_layer_ids.end());
  s.ple_layer_ids.erase(std::unique(s.ple_layer_ids.begin(), s.ple_layer_ids.end()), s.ple_layer_ids.end());
  for (int id : s.ple_layer_ids) {
    if (id < 1 || id > s.layers || s.layer_types[id - 1] != kLinear)
      return bad(absl::StrCat("--ple-layer-ids holds ", id, ": one-based ids of linear_attention layers in 1..",
                              s.layers));
  }
  if (s.ple_embed_dim <= 0) s.ple_embed_dim = s.hidden;
  const int ngram_heads = (s.ngram_size - 1) * s.heads_per_ngram;
  if (s.ple_embed_dim % ngram_heads != 0)
    return bad(absl::StrCat("--ple-embed-dim ", s.ple_embed_dim, " must be a multiple of the ", ngram_heads,
                            " n-gram heads ((ngram_size - 1) x heads_per_ngram)"));
  // The table's pieces: every one but the last of ceil(rows / parts) rows (the engine reads exactly
  // split_ngram_parts of them; exllamav3 routes rows by the first piece's size).
  auto splits = [&](int parts) {
    for (size_t k = 0; k < s.ple_layer_ids.size(); ++k) {
      const int64_t rows = Qwen4ExpNgramHash(s, static_cast<int>(k)).table_rows();
      if ((rows + parts - 1) / parts * (parts - 1) >= rows) return false;
    }
    return true;
  };
  if (s.split_ngram_parts == 0) s.split_ngram_parts = splits(512) ? 512 : 128;
  if (!splits(s.split_ngram_parts))
    return bad(absl::StrCat("--split-ngram-parts ", s.split_ngram_parts, " does not cut the n-gram table of ",
                            Qwen4ExpNgramHash(s, 0).table_rows(), " rows into that many pieces of ceil(rows / parts)"));
  if (s.release_layout) {  // exllamav3 1.6.5's limits (tests/fixtures/engine/README.md)
    if (!s.ple_layer_ids.empty() && (s.ple_embed_dim / ngram_heads != 160 || s.ple_embed_dim % 128 != 0))
      return bad(absl::StrCat("--release-layout: exllamav3 takes n-gram rows of 160 and ple_embed_dim a multiple "
                              "of 128 (--ple-embed-dim 160 x ", ngram_heads, " = ", 160 * ngram_heads,
                              "), got rows of ", s.ple_embed_dim / ngram_heads));
    if (s.index_head_dim % 128 != 0)
      return bad(absl::StrCat("--release-layout: exllamav3 takes --index-head-dim a multiple of 128, got ",
                              s.index_head_dim));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TestModelSpec> ResolveTestModelSpec(const TestModelSpec& in) {
  TestModelSpec s = in;
  if (s.arch != "glm4_moe" && s.arch != "deepseek_v3" && s.arch != "qwen3_moe" &&
      s.arch != "mixtral" && s.arch != "glm_moe_dsa" && s.arch != "deepseek_v4" &&
      s.arch != "qwen3_next" && s.arch != "glm5_next" && s.arch != "qwen4_exp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown --arch '", s.arch,
        "' (glm4_moe, deepseek_v3, qwen3_moe, mixtral, glm_moe_dsa, deepseek_v4, qwen3_next, glm5_next or "
        "qwen4_exp)"));
  }
  if (s.release_layout && s.arch != "glm5_next" && s.arch != "qwen4_exp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--release-layout applies to glm5_next and qwen4_exp (the layout exllamav3 reads), not ", s.arch));
  }
  if (s.mtp && s.arch != "glm4_moe" && s.arch != "deepseek_v3" && s.arch != "glm_moe_dsa" &&
      s.arch != "glm5_next" && s.arch != "qwen4_exp")
    return absl::InvalidArgumentError(absl::StrCat(
        "--mtp: the MTP layer belongs to glm4_moe, deepseek_v3, glm_moe_dsa, glm5_next and qwen4_exp, not ",
        s.arch));
  const bool glm5 = s.arch == "glm5_next";
  if (s.qk_rope_head_dim < 0) s.qk_rope_head_dim = glm5 ? 0 : 16;
  if (s.arch == "glm_moe_dsa" &&
      (s.index_heads < 1 || s.index_topk < 1 || s.index_head_dim < s.qk_rope_head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--index-heads ", s.index_heads, " and --index-topk ", s.index_topk,
        " must be >= 1 and --index-head-dim ", s.index_head_dim, " >= --qk-rope-head-dim ",
        s.qk_rope_head_dim));
  }
  if (s.layers < 1 || s.layers > 4096) return absl::InvalidArgumentError("--layers must be in 1..4096");
  EXL3_RETURN_IF_ERROR(ResolveLayerTypes(s));
  const bool v4 = s.arch == "deepseek_v4", next = s.arch == "qwen3_next" || s.arch == "qwen4_exp";
  const bool sig = IsSigmoidFamily(s.arch);
  if (s.shared < 0) s.shared = sig || v4 || next ? 1 : 0;
  if (s.dense_layers < 0) s.dense_layers = sig ? 1 : 0;
  if (!sig && !v4 && !next && s.shared > 0) {
    return absl::InvalidArgumentError(absl::StrCat(s.arch, " has no shared experts (--shared 0)"));
  }
  // Qwen3-Next's dense layers are mlp_only_layers (here its first --dense-layers).
  if (!sig && !next && !v4 && s.dense_layers > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.arch, " has no dense first layers (--dense-layers 0)"));
  }
  if (s.dense_intermediate <= 0) s.dense_intermediate = 2 * s.intermediate;
  if (s.routed_scaling_factor < 0) s.routed_scaling_factor = s.arch == "deepseek_v3" || glm5 ? 2.5f : v4 ? 1.5f : 1.0f;
  if (s.n_group < 0) {
    s.n_group = 1;
    if (s.arch == "deepseek_v3") {
      for (int g : {4, 2}) {
        if (s.experts % g == 0 && s.experts / g >= 2 && (g / 2) * (s.experts / g) >= s.top_k) {
          s.n_group = g;
          break;
        }
      }
    }
  }
  if (s.topk_group < 0) s.topk_group = std::max(1, s.n_group / 2);
  if (s.kv_heads <= 0) s.kv_heads = IsLatentAttention(s.arch) ? s.heads : v4 ? 1 : 2;
  if (s.head_dim <= 0 && s.heads > 0) s.head_dim = s.hidden / s.heads;
  if (v4 && s.o_lora_rank <= 0 && s.o_groups > 0) s.o_lora_rank = s.heads * s.head_dim / s.o_groups;
  if (s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.head_dim < 2 ||
      s.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--heads ", s.heads, " must be a multiple of --kv-heads ", s.kv_heads,
        " and the head dimension (", s.head_dim, ") even"));
  }
  if (v4) EXL3_RETURN_IF_ERROR(CheckDsv4Shape(s));
  if (s.arch == "qwen3_next") EXL3_RETURN_IF_ERROR(CheckQwen3NextShape(s));
  if (s.arch == "qwen4_exp") EXL3_RETURN_IF_ERROR(CheckQwen4ExpShape(s));
  if (glm5) EXL3_RETURN_IF_ERROR(CheckGlm5NextShape(s));
  if (s.dense_layers >= s.layers) {
    return absl::InvalidArgumentError("--dense-layers leaves no MoE layer (must be < --layers)");
  }
  for (auto [v, name] : {std::pair<int, const char*>{s.hidden, "--hidden"},
                         {s.intermediate, "--intermediate"},
                         {s.dense_intermediate, "--dense-intermediate"}}) {
    if (v <= 0 || v % 128 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be a positive multiple of 128 (EXL3 layers), got ", v));
    }
  }
  if (s.experts < 1) return absl::InvalidArgumentError("--experts must be >= 1");
  if (s.top_k < 1 || s.top_k > s.experts) {
    return absl::InvalidArgumentError("--top-k must be in 1..--experts");
  }
  if (s.shared < 0 || s.shared > 16) return absl::InvalidArgumentError("--shared must be in 0..16");
  if (s.vocab < 16) return absl::InvalidArgumentError("vocab must be >= 16");
  if (s.max_position < 16) return absl::InvalidArgumentError("max_position must be >= 16");
  // Groups and the rest are checked by the config parser.
  absl::StatusOr<MoeConfig> c = ParsedConfig(s);
  if (!c.ok()) return c.status();
  return s;
}

}  // namespace exl3

#include "engine/config/dsv4_section.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/rope_parameters.h"

namespace exl3::engine {
namespace {

using nlohmann::json;

constexpr char kSliding[] = "sliding_attention";
constexpr char kCsa[] = "compressed_sparse_attention";
constexpr char kHca[] = "heavily_compressed_attention";

int IntField(const json& j, const char* field, int fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number_integer() ? it->get<int>() : fallback;
}

double NumberField(const json& j, const char* field, double fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

absl::Status Bad(const std::string& source, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

absl::StatusOr<std::vector<Dsv4LayerType>> LayerTypes(const json& j, int num_layers,
                                                      const std::string& source) {
  std::vector<Dsv4LayerType> types;
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const json& v : j["layer_types"]) {
      const std::string t = v.is_string() ? v.get<std::string>() : "";
      if (t == kSliding) {
        types.push_back(Dsv4LayerType::kSlidingWindow);
      } else if (t == kCsa) {
        types.push_back(Dsv4LayerType::kCompressedSparse);
      } else if (t == kHca) {
        types.push_back(Dsv4LayerType::kHeavilyCompressed);
      } else {
        return Bad(source, absl::StrCat("layer_types holds '", v.dump(), "' (", kSliding, ", ",
                                        kCsa, " or ", kHca, ")"));
      }
    }
  } else if (j.contains("compress_ratios") && j["compress_ratios"].is_array()) {
    // transformers' legacy map: 0 sliding, 4 CSA, 128 HCA.
    for (const json& v : j["compress_ratios"]) {
      const int r = v.is_number_integer() ? v.get<int>() : -1;
      if (r == 0) {
        types.push_back(Dsv4LayerType::kSlidingWindow);
      } else if (r == 4) {
        types.push_back(Dsv4LayerType::kCompressedSparse);
      } else if (r == 128) {
        types.push_back(Dsv4LayerType::kHeavilyCompressed);
      } else {
        return Bad(source, absl::StrCat("compress_ratios holds ", v.dump(), " (0, 4 or 128)"));
      }
    }
  } else {
    for (int i = 0; i < num_layers; ++i) {
      types.push_back(i < 2 || i % 2 == 0 ? Dsv4LayerType::kHeavilyCompressed
                                          : Dsv4LayerType::kCompressedSparse);
    }
  }
  if (static_cast<int>(types.size()) < num_layers)
    return Bad(source, absl::StrCat("layer_types names ", types.size(), " layers of ", num_layers));
  types.resize(num_layers);
  return types;
}

// The "main" and "compress" rope parameter sets: nested as transformers 5.24 writes them, or
// built from the older top-level fields as DeepseekV4Config does.
absl::Status Ropes(const json& j, const std::string& source, double partial, Dsv4Config* d,
                   int head_dim, int max_position) {
  json main, compress;
  const json* rp = j.contains("rope_parameters") && j["rope_parameters"].is_object()
                       ? &j["rope_parameters"]
                       : nullptr;
  if (rp != nullptr && rp->contains("main") && (*rp)["main"].is_object() &&
      rp->contains("compress") && (*rp)["compress"].is_object()) {
    main = (*rp)["main"];
    compress = (*rp)["compress"];
  } else {
    json scaling = json::object();
    if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) scaling.update(j["rope_scaling"]);
    if (rp != nullptr) scaling.update(*rp);
    if (!scaling.contains("rope_type") && scaling.contains("type")) scaling["rope_type"] = scaling["type"];
    main = {{"rope_type", "default"}, {"rope_theta", NumberField(j, "rope_theta", 10000.0)}};
    compress = scaling;
    compress["rope_theta"] = NumberField(j, "compress_rope_theta", 160000.0);
    if (!compress.contains("rope_type")) compress["rope_type"] = "default";
    // The V4 reference does not scale cos/sin by YaRN's mscale.
    if (compress["rope_type"] == "yarn" && !compress.contains("attention_factor"))
      compress["attention_factor"] = 1.0;
  }
  const double main_partial = NumberField(main, "partial_rotary_factor", partial);
  const double compress_partial = NumberField(compress, "partial_rotary_factor", partial);
  EXL3_RETURN_IF_ERROR(ParseRopeParameters(main, head_dim, main_partial, max_position,
                                           source + " rope_parameters.main", &d->main_rope));
  EXL3_RETURN_IF_ERROR(ParseRopeParameters(compress, head_dim, compress_partial, max_position,
                                           source + " rope_parameters.compress", &d->compress_rope));
  // Both rotate the same trailing slice: the rotation code reads one rope_dim.
  if (d->main_rope.rotary_dim != d->compress_rope.rotary_dim)
    return Bad(source, absl::StrCat("rope_parameters main and compress rotate ",
                                    d->main_rope.rotary_dim, " and ", d->compress_rope.rotary_dim,
                                    " dimensions; the engine needs one rope dimension"));
  d->main_rope.layout = d->compress_rope.layout = RopeLayout::kInterleaved;
  d->rope_dim = d->main_rope.rotary_dim;
  return absl::OkStatus();
}

// The DSPARK drafter's fields (docs/dspark.md "Config fields"). num_nextn_predict_layers is
// ignored: the block count is the compress_ratios tail.
absl::Status Dspark(const json& j, const std::string& source, int num_layers, int vocab_size,
                    Dsv4DsparkConfig* d) {
  if (j.contains("compress_ratios") && j["compress_ratios"].is_array()) {
    const json& ratios = j["compress_ratios"];
    for (size_t i = num_layers; i < ratios.size(); ++i) {
      if (!ratios[i].is_number_integer() || ratios[i].get<int>() != 0)
        return Bad(source, absl::StrCat("compress_ratios[", i, "] is ", ratios[i].dump(),
                                        ": an MTP block (past num_hidden_layers ", num_layers,
                                        ") must be sliding (0)"));
    }
    d->num_blocks = std::max(0, static_cast<int>(ratios.size()) - num_layers);
  }
  auto integer = [&](const char* field, int fallback, int* out) -> absl::Status {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) {
      *out = fallback;
      return absl::OkStatus();
    }
    if (!it->is_number_integer()) return Bad(source, absl::StrCat(field, " is ", it->dump(), ", not an integer"));
    *out = it->get<int>();
    return absl::OkStatus();
  };
  EXL3_RETURN_IF_ERROR(integer("dspark_block_size", 0, &d->block_size));
  EXL3_RETURN_IF_ERROR(integer("dspark_noise_token_id", 0, &d->noise_token_id));
  EXL3_RETURN_IF_ERROR(integer("dspark_markov_rank", 256, &d->markov_rank));
  if (d->block_size < 0) return Bad(source, absl::StrCat("dspark_block_size ", d->block_size, " is negative"));
  if (d->noise_token_id < 0 || (vocab_size > 0 && d->noise_token_id >= vocab_size))
    return Bad(source, absl::StrCat("dspark_noise_token_id ", d->noise_token_id,
                                    " is not a token id (vocab_size ", vocab_size, ")"));
  if (d->markov_rank <= 0)
    return Bad(source, absl::StrCat("dspark_markov_rank ", d->markov_rank, " must be positive"));
  d->target_layer_ids.clear();
  if (auto it = j.find("dspark_target_layer_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return Bad(source, absl::StrCat("dspark_target_layer_ids is ", it->dump(), ", not a list"));
    for (const json& v : *it) {
      if (!v.is_number_integer() || v.get<int>() < 0 || v.get<int>() >= num_layers)
        return Bad(source, absl::StrCat("dspark_target_layer_ids holds ", v.dump(), " (a layer index below ",
                                        num_layers, ")"));
      d->target_layer_ids.push_back(v.get<int>());
    }
    // exllamav3 keeps the ids as a set and taps in layer order.
    std::sort(d->target_layer_ids.begin(), d->target_layer_ids.end());
    if (std::adjacent_find(d->target_layer_ids.begin(), d->target_layer_ids.end()) !=
        d->target_layer_ids.end())
      return Bad(source, absl::StrCat("dspark_target_layer_ids ", it->dump(), " names a layer twice"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadDeepseekV4Section(const ConfigFile& file, ModelConfig* cfg) {
  const json& j = file.text();
  const std::string& source = file.source();
  cfg->attention = AttentionKind::kDsv4;
  auto d = std::make_shared<Dsv4Config>();
  EXL3_ASSIGN_OR_RETURN(d->layer_types, LayerTypes(j, cfg->num_layers, source));
  d->head_dim = cfg->head_dim;
  d->q_lora_rank = IntField(j, "q_lora_rank", 0);
  d->o_groups = IntField(j, "o_groups", 0);
  d->o_lora_rank = IntField(j, "o_lora_rank", 0);
  d->sliding_window = IntField(j, "sliding_window", 0);
  d->index_heads = IntField(j, "index_n_heads", 0);
  d->index_head_dim = IntField(j, "index_head_dim", 0);
  d->index_topk = IntField(j, "index_topk", 0);
  d->hc_mult = IntField(j, "hc_mult", 0);
  d->hc_sinkhorn_iters = IntField(j, "hc_sinkhorn_iters", 0);
  d->hc_eps = static_cast<float>(NumberField(j, "hc_eps", 1e-6));
  d->csa_compress_rate = IntField(j, "compress_rate_csa", 4);
  d->hca_compress_rate = IntField(j, "compress_rate_hca", 128);
  if (j.contains("compress_rates") && j["compress_rates"].is_object()) {
    d->csa_compress_rate = IntField(j["compress_rates"], kCsa, d->csa_compress_rate);
    d->hca_compress_rate = IntField(j["compress_rates"], kHca, d->hca_compress_rate);
  }
  if (cfg->num_kv_heads != 1)
    return Bad(source, absl::StrCat("num_key_value_heads ", cfg->num_kv_heads,
                                    ": DeepSeek-V4's attention has one shared key/value head"));
  if (d->head_dim <= 0 || d->q_lora_rank <= 0 || d->sliding_window <= 0 || d->o_groups <= 0 ||
      d->o_lora_rank <= 0 || (cfg->num_heads * d->head_dim) % d->o_groups != 0)
    return Bad(source, absl::StrCat("head_dim ", d->head_dim, ", q_lora_rank ", d->q_lora_rank,
                                    ", sliding_window ", d->sliding_window, ", o_groups ",
                                    d->o_groups, ", o_lora_rank ", d->o_lora_rank,
                                    " are not a valid DeepSeek-V4 attention shape"));
  if (d->hc_mult <= 0 || d->hc_sinkhorn_iters <= 0)
    return Bad(source, absl::StrCat("hc_mult ", d->hc_mult, " and hc_sinkhorn_iters ",
                                    d->hc_sinkhorn_iters, " must be positive"));
  bool compressed = false, sparse = false;
  for (Dsv4LayerType t : d->layer_types) {
    compressed |= t != Dsv4LayerType::kSlidingWindow;
    sparse |= t == Dsv4LayerType::kCompressedSparse;
  }
  if (compressed && (d->csa_compress_rate <= 0 || d->hca_compress_rate <= 0))
    return Bad(source, "compress_rates must be positive");
  if (sparse && (d->index_heads <= 0 || d->index_head_dim <= 0 || d->index_topk <= 0))
    return Bad(source, absl::StrCat("index_n_heads ", d->index_heads, ", index_head_dim ",
                                    d->index_head_dim, ", index_topk ", d->index_topk,
                                    " must be positive (a compressed_sparse_attention layer exists)"));
  double partial = 64.0 / 512.0;  // DeepseekV4Config's default
  if (j.contains("partial_rotary_factor") && j["partial_rotary_factor"].is_number()) {
    partial = j["partial_rotary_factor"].get<double>();
  } else if (j.contains("qk_rope_head_dim") && j["qk_rope_head_dim"].is_number_integer()) {
    partial = static_cast<double>(j["qk_rope_head_dim"].get<int>()) / d->head_dim;
  }
  EXL3_RETURN_IF_ERROR(Ropes(j, source, partial, d.get(), d->head_dim, cfg->max_position_embeddings));
  if (sparse && d->rope_dim > d->index_head_dim)
    return Bad(source, absl::StrCat("index_head_dim ", d->index_head_dim, " is smaller than the rope part ",
                                    d->rope_dim));
  EXL3_RETURN_IF_ERROR(Dspark(j, source, cfg->num_layers, cfg->vocab_size, &d->dspark));
  cfg->sliding_window = d->sliding_window;
  cfg->q_lora_rank = d->q_lora_rank;
  cfg->rope = d->main_rope;  // per layer type: Dsv4Config's main_rope / compress_rope
  cfg->attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg->head_dim)));
  cfg->dsv4 = std::move(d);
  return absl::OkStatus();
}

}  // namespace exl3::engine

#include "model/encoder/checkpoint_converter.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/checkpoint_naming.h"
#include "model/config/read_moe_config.h"
#include "model/encoder/layer_quantizer.h"
#include "model/encoder/progress.h"
#include "model/encoder/safetensors_stream_writer.h"
#include "model/moe_config.h"
#include "model/safetensors.h"
#include "model/write_weight_digests.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kVersion[] = "0.0.6";          // quantization_config.version we write
constexpr char kFingerprintKey[] = "exl3_convert";
// The output layout's revision, part of a shard's fingerprint: a shard written in an earlier layout
// is redone on restart. 2: exllamav3's layouts (KDA qkv_proj / conv1d, DeepSeek-V4 wo_a slices,
// MLA kv_b_proj and DSA indexer wk unquantized). 3: DeepSeek-V4's mtp.* linears EXL3.
constexpr int kLayout = 3;

struct Planned {
  int bits = 0;
  int out = 0, in = 0;  // HF orientation [out, in]
};

// An output made of input rows rather than of one input tensor as stored (PlanExllamav3Layouts):
// the rows of `inputs` one after another, of which it holds [first_row, first_row + rows); an
// EXL3 layer (quantized) or a tensor copied in the inputs' dtype.
struct Composite {
  std::string name;                 // as stored: the EXL3 layer's prefix, or the tensor's name
  std::vector<std::string> inputs;  // stored names
  int64_t first_row = 0, rows = 0;
  bool quantized = false;
  Planned p;                        // quantized: K and [out = rows, in]
  DType dtype = DType::kF32;        // copied: the inputs' dtype, the output's shape
  std::vector<int64_t> shape;
};

absl::StatusOr<std::string> ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteTextAtomic(const fs::path& p, const std::string& text) {
  const fs::path tmp = p.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot write ", p.string(), ": ", ec.message()));
  return absl::OkStatus();
}

std::string ShapeString(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// The input's shard files (names relative to the directory), sorted.
absl::StatusOr<std::vector<std::string>> ListShards(const fs::path& dir) {
  std::vector<std::string> shards;
  const fs::path index = dir / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    absl::StatusOr<std::string> text = ReadText(index);
    if (!text.ok()) return text.status();
    json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrCat(index.string(), ": not JSON with a weight_map"));
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return absl::DataLossError(absl::StrCat(index.string(), ": shard of '", it.key(), "' is not a string"));
      }
      const std::string s = it.value().get<std::string>();
      if (s.find('/') != std::string::npos || s.find("..") != std::string::npos) {
        return absl::DataLossError(absl::StrCat(index.string(), ": shard name '", s, "' leaves the directory"));
      }
      if (std::find(shards.begin(), shards.end(), s) == shards.end()) shards.push_back(s);
    }
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".safetensors") {
        shards.push_back(e.path().filename().string());
      }
    }
  }
  std::sort(shards.begin(), shards.end());
  if (shards.empty()) return absl::NotFoundError(absl::StrCat(dir.string(), " holds no .safetensors shard"));
  return shards;
}

// "<text model>layers.L.REST" -> L and REST ("model.layers.L.REST"; *ForConditionalGeneration
// "model.language_model.layers.L.REST").
bool SplitLayerKey(const MoeConfig& cfg, const std::string& name, int* layer, std::string* rest) {
  const std::string prefix = TextModelPrefix(cfg) + "layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos ||
      !absl::SimpleAtoi(name.substr(prefix.size(), dot - prefix.size()), layer)) {
    return false;
  }
  *rest = name.substr(dot + 1);
  return true;
}

// GLM-5.3-Flash's KDA gates (the forget gate's f_a_proj / f_b_proj, the output gate's g_a_proj /
// g_b_proj, β's b_proj): low-rank gate projections kept as stored, like routers.
bool IsKdaGateProjection(const MoeConfig& cfg, const std::string& rest) {
  if (cfg.arch != Architecture::kGlm5Next) return false;
  for (const char* g : {"f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj"})
    if (rest == absl::StrCat("self_attn.", g, ".weight")) return true;
  return false;
}

// Linears of a decoder layer (REST after "layers.L.") that exllamav3 keeps unquantized and reads
// only as `.weight`, so they are copied as stored without being asked for (not listed among the
// linears EXL3 cannot hold):
//  - DSA's and DeepSeek-V4's per-head indexer weights (`indexer.weights_proj`, router-like; transformers
//    runs them in fp32) and DSA's indexer key projection `indexer.wk`;
//  - MLA's `kv_b_proj`: exllamav3 never runs it as a layer (it folds its key half into the queries
//    and its value half into the output) and reads its `.weight` directly, so an EXL3 kv_b_proj is
//    a missing tensor to it. The engine absorbs it from a dense copy either way
//    (engine/cpu/attention/mla_attention.h);
//  - GLM-5.3-Flash's KDA gate projections.
bool KeptAsExllamav3Keeps(const MoeConfig& cfg, const std::string& rest) {
  for (const char* kept : {"self_attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight",
                           "self_attn.indexer.wk.weight", "self_attn.kv_b_proj.weight"}) {
    if (rest == kept) return true;
  }
  return IsKdaGateProjection(cfg, rest);
}

bool IsFloatWeight(DType d) { return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32; }

std::string BitsJson(double v) {
  return v == static_cast<int>(v) ? std::to_string(static_cast<int>(v)) : absl::StrCat(v);
}

}  // namespace

int BitsFor(const ConvertOptions& o, bool routed, bool down) {
  int k = o.bits;
  if (routed && o.expert_bits > 0) k = o.expert_bits;
  if (down && o.down_bits > 0) k = o.down_bits;
  return k;
}

namespace {

// One conversion's inputs and what it has decided so far; each step below fills its part.
struct Conversion {
  Conversion(fs::path in, fs::path out, const ConvertOptions& o) : in_dir(std::move(in)), out_dir(std::move(out)), options(o) {}
  fs::path in_dir, out_dir;
  const ConvertOptions& options;
  json cfg_json;  // config.json as read (written back with quantization_config)
  MoeConfig cfg;
  std::vector<std::string> shards;  // names relative to in_dir, sorted
  std::vector<std::unique_ptr<SafetensorsFile>> files;  // by shard
  // How the input names its tensors (model/checkpoint_naming.h). Planning works on the project's
  // names; the output keeps the input's, so a DeepSeek-V4 checkpoint in its release naming
  // becomes an EXL3 directory in that naming (the one exllamav3 reads).
  CheckpointNaming naming = CheckpointNaming::kTransformers;
  std::map<std::string, const TensorInfo*> info;        // every input tensor, by project name
  std::map<std::string, Planned> plan;                  // the tensors that become EXL3 layers
  std::map<std::string, size_t> file_of;                // stored name -> index into files
  std::vector<Composite> composites;
  // Stored name of a composite's first input -> the composites written where it is, in order.
  std::map<std::string, std::vector<size_t>> composites_at;
  std::set<std::string> consumed;                       // stored names of the composites' inputs
  std::set<std::string> modules;        // "attention", "dense_mlp", "head", "mtp": those with a quantized tensor
  std::vector<std::string> kept_names;  // asked for, but not EXL3-able
  json weight_map = json::object();
  double mse_sum = 0;
  ConvertStats stats;
};

absl::Status CheckOptions(const ConvertOptions& options) {
  for (int k : {options.bits, options.expert_bits, options.down_bits, options.head_bits, options.mtp_bits}) {
    if (k != 0 && (k < 1 || k > 8)) return absl::InvalidArgumentError(absl::StrCat("bit width ", k, " is not in 1..8"));
  }
  if (options.bits < 1) return absl::InvalidArgumentError("bits must be in 1..8");
  return absl::OkStatus();
}

// config.json (refused when already quantized) and every shard's tensors.
absl::Status ReadSource(Conversion& c) {
  const fs::path config = c.in_dir / "config.json";
  EXL3_ASSIGN_OR_RETURN(std::string text, ReadText(config));
  c.cfg_json = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (c.cfg_json.is_discarded() || !c.cfg_json.is_object())
    return absl::InvalidArgumentError(absl::StrCat(config.string(), ": not a JSON object"));
  if (c.cfg_json.contains("quantization_config")) {
    std::string method = "?";
    const json& q = c.cfg_json["quantization_config"];
    if (q.is_object() && q.contains("quant_method") && q["quant_method"].is_string())
      method = q["quant_method"].get<std::string>();
    return absl::InvalidArgumentError(absl::StrCat(c.in_dir.string(), " is already quantized (quantization_config.",
                                                   "quant_method '", method, "'); the converter needs a bf16/fp16/fp32 ",
                                                   "checkpoint"));
  }
  EXL3_ASSIGN_OR_RETURN(c.cfg, ParseMoeConfig(text, config.string()));
  EXL3_ASSIGN_OR_RETURN(c.shards, ListShards(c.in_dir));
  std::vector<std::string> stored;
  for (const std::string& s : c.shards) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open((c.in_dir / s).string()));
    for (const TensorInfo& t : f->tensors()) stored.push_back(t.name);
    c.files.push_back(std::move(f));
  }
  c.naming = DetectCheckpointNaming(stored);
  for (size_t fi = 0; fi < c.files.size(); ++fi) {
    for (const TensorInfo& t : c.files[fi]->tensors()) {
      c.info[ProjectTensorName(c.naming, t.name)] = &t;
      c.file_of[t.name] = fi;
    }
  }
  return absl::OkStatus();
}

// The plan entry of a stored tensor (looked up by its project name), or null.
const Planned* PlanFor(const Conversion& c, const std::string& stored_name) {
  auto it = c.plan.find(ProjectTensorName(c.naming, stored_name));
  return it == c.plan.end() ? nullptr : &it->second;
}

// A routed or shared expert's projection: it must be there, [out, in], EXL3-able.
absl::Status PlanExpertLinear(Conversion& c, const std::string& prefix, int out, int in, int bits) {
  const std::string name = prefix + ".weight";
  auto it = c.info.find(name);
  if (it == c.info.end())
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is missing: the checkpoint is incomplete or not laid ",
                                            "out as ", c.cfg.architecture, " (",
                                            std::string(MoeFamilyName(c.cfg.family)), ") expects"));
  const std::vector<int64_t>& s = it->second->shape;
  if (s.size() != 2 || s[0] != out || s[1] != in)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ", ShapeString(s),
                                                   "; config.json implies [", out, ", ", in, "]"));
  if (out % 128 != 0 || in % 128 != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ", ShapeString(s),
                                                   ": EXL3 needs both dimensions to be multiples of 128"));
  const DType d = it->second->dtype;
  if (!IsFloatWeight(d))
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has dtype ", std::string(DTypeName(d)),
                                                   "; the converter reads BF16, F16 or F32 weights (dequantize FP8 ",
                                                   "checkpoints first)"));
  c.plan[name] = {bits, out, in};
  return absl::OkStatus();
}

absl::Status PlanExperts(Conversion& c) {
  const MoeConfig& cfg = c.cfg;
  const int H = cfg.hidden_size;
  for (int L : cfg.MoeLayers()) {
    for (int e = 0; e < cfg.num_experts; ++e) {
      const int I = cfg.moe_intermediate_size;
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const bool down = p == Projection::kDown;
        EXL3_RETURN_IF_ERROR(PlanExpertLinear(c, RoutedExpertPrefix(cfg, L, e, p), down ? H : I, down ? I : H,
                                              BitsFor(c.options, true, down)));
      }
    }
    if (cfg.has_shared_expert() && c.options.quantize_shared) {
      const int I = cfg.shared_intermediate_size;
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const bool down = p == Projection::kDown;
        EXL3_RETURN_IF_ERROR(PlanExpertLinear(c, SharedExpertPrefix(cfg, L, p), down ? H : I, down ? I : H,
                                              BitsFor(c.options, false, down)));
      }
    }
  }
  return absl::OkStatus();
}

// A linear quantized where EXL3 can hold it; else kept as stored and said so.
void PlanOptionalLinear(Conversion& c, const std::string& name, int bits, const char* module) {
  const TensorInfo& t = *c.info.at(name);
  const bool shape_ok = t.shape[0] % 128 == 0 && t.shape[1] % 128 == 0;
  if (!shape_ok || !IsFloatWeight(t.dtype)) {
    c.stats.kept_linears.push_back(absl::StrCat(name, " ", ShapeString(t.shape), " ", std::string(DTypeName(t.dtype)),
                                                ": ", shape_ok ? "not BF16/F16/F32" : "dimensions not both multiples of 128",
                                                ", kept as stored"));
    c.kept_names.push_back(t.name);  // as stored: the output keeps the input's naming
    return;
  }
  c.plan[name] = {bits, static_cast<int>(t.shape[0]), static_cast<int>(t.shape[1])};
  c.modules.insert(module);
}

// The other linears, as exllamav3 quantizes them: attention projections and dense MLPs at `bits`
// (dense down projections at `down_bits` when set), the head at `head_bits`. A linear EXL3 cannot
// hold (a dimension not a multiple of 128, a non-float dtype) stays as stored.
void PlanOtherLinears(Conversion& c) {
  const MoeConfig& cfg = c.cfg;
  const ConvertOptions& options = c.options;
  const std::string head_key = HeadWeightKey(cfg);
  for (const auto& [name, t] : c.info) {
    if (t->shape.size() != 2) continue;
    if (name == head_key) {
      if (options.head_bits > 0) PlanOptionalLinear(c, name, options.head_bits, "head");
      continue;
    }
    int layer = 0;
    std::string rest;
    if (!SplitLayerKey(cfg, name, &layer, &rest) || layer >= cfg.num_hidden_layers || !absl::EndsWith(rest, ".weight"))
      continue;
    if (KeptAsExllamav3Keeps(cfg, rest)) continue;
    // DeepSeek-V4 names its attention `attn.` (wq_a, wq_b, wkv, wo_a, wo_b, the compressors'
    // wkv / wgate, the indexer's wq_b); its grouped wo_a [groups * o_lora_rank, in / groups] is
    // planned here as one linear and written as per-group slices (PlanExllamav3Layouts).
    const bool v4_attention = cfg.family == MoeFamily::kDeepseekV4 && absl::StartsWith(rest, "attn.");
    if (absl::StartsWith(rest, "self_attn.") || absl::StartsWith(rest, "linear_attn.") || v4_attention) {
      if (options.quantize_attention) PlanOptionalLinear(c, name, options.bits, "attention");
    } else if (!cfg.IsMoeLayer(layer) && (rest == "mlp.gate_proj.weight" || rest == "mlp.up_proj.weight" ||
                                          rest == "mlp.down_proj.weight")) {
      if (options.quantize_dense_mlp)
        PlanOptionalLinear(c, name, BitsFor(options, false, rest == "mlp.down_proj.weight"), "dense_mlp");
    }
  }
  const bool tied = c.cfg_json.contains("tie_word_embeddings") && c.cfg_json["tie_word_embeddings"].is_boolean() &&
                    c.cfg_json["tie_word_embeddings"].get<bool>();
  if (options.head_bits > 0 && c.info.count(head_key) == 0) {
    c.stats.kept_linears.push_back(tied ? "lm_head: none (tie_word_embeddings: the head is model.embed_tokens, kept "
                                          "as stored)"
                                        : absl::StrCat("lm_head: no ", head_key, " tensor, no head quantized"));
  }
}

// DeepSeek-V4's DSPARK drafter blocks mtp.{i}.* (docs/dspark.md) as exllamav3's converter writes
// them: the linears it builds with qbits_key "mtp_bits" and a qmap -- block 0's main_proj, each
// block's attention wq_a / wq_b / wkv / wo_a (per-group slices, PlanExllamav3Layouts) / wo_b, its
// routed and shared experts' w1 / w2 / w3 -- EXL3 at mtp_bits (default: bits); everything else
// under mtp.* as stored: the router and its correction bias, norms, hyper-connections, sinks, the
// Markov head (markov_w1 an embedding table, markov_w2) and the confidence head, which exllamav3
// reads unquantized. Other families' mtp.* and MTP layers are copied as they come.
void PlanDsv4MtpLinears(Conversion& c) {
  if (c.cfg.family != MoeFamily::kDeepseekV4 || !c.options.quantize_mtp) return;
  const int bits = c.options.mtp_bits > 0 ? c.options.mtp_bits : c.options.bits;
  for (const auto& [name, t] : c.info) {
    if (!absl::StartsWith(name, "mtp.") || t->shape.size() != 2 || !absl::EndsWith(name, ".weight")) continue;
    const size_t dot = name.find('.', 4);
    int block = 0;
    if (dot == std::string::npos || !absl::SimpleAtoi(name.substr(4, dot - 4), &block)) continue;
    const std::string rest = name.substr(dot + 1);
    bool quantized = (block == 0 && rest == "main_proj.weight");
    for (const char* p : {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                          "attn.wo_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                          "ffn.shared_experts.w3.weight"})
      quantized = quantized || rest == p;
    if (absl::StartsWith(rest, "ffn.experts.")) {
      for (const char* w : {".w1.weight", ".w2.weight", ".w3.weight"}) quantized = quantized || absl::EndsWith(rest, w);
    }
    if (quantized) PlanOptionalLinear(c, name, bits, "mtp");
  }
}

void AddComposite(Conversion& c, Composite comp) {
  for (const std::string& in : comp.inputs) c.consumed.insert(in);
  c.composites_at[comp.inputs[0]].push_back(c.composites.size());
  c.composites.push_back(std::move(comp));
}

// GLM-5.3-Flash's KDA layer L as exllamav3's converter writes it: q_proj, k_proj and v_proj
// quantized as one EXL3 layer `qkv_proj` (their rows in that order: exllamav3 reads separate
// q/k/v only unquantized, as a list it concatenates), and then the three convolutions as one
// `conv1d` [3 W, 1, K] in the same order. Where q/k/v are not all quantized they stay as stored,
// convolutions too.
absl::Status PlanKdaLayout(Conversion& c, int layer) {
  const std::string p = LayerPrefix(c.cfg, layer) + "self_attn.";
  const std::vector<std::string> proj = {p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"};
  for (const std::string& name : proj) {
    if (c.plan.count(name) == 0) return absl::OkStatus();
  }
  Composite qkv;
  qkv.quantized = true;
  qkv.p = c.plan.at(proj[0]);
  qkv.p.out = 0;
  for (const std::string& name : proj) {
    const Planned& pl = c.plan.at(name);
    if (pl.bits != qkv.p.bits || pl.in != qkv.p.in)
      return absl::InternalError(absl::StrCat(name, ": planned unlike ", proj[0], " (one fused layer)"));
    qkv.inputs.push_back(c.info.at(name)->name);
    qkv.p.out += pl.out;
    c.plan.erase(name);
  }
  qkv.rows = qkv.p.out;
  const std::string& q_stored = qkv.inputs[0];
  const std::string stored_prefix = q_stored.substr(0, q_stored.size() - std::string("q_proj.weight").size());
  qkv.name = stored_prefix + "qkv_proj";
  AddComposite(c, std::move(qkv));

  const std::vector<std::string> convs = {p + "q_conv1d.weight", p + "k_conv1d.weight", p + "v_conv1d.weight"};
  int present = 0;
  for (const std::string& name : convs) present += static_cast<int>(c.info.count(name));
  if (present == 0) return absl::OkStatus();
  Composite conv;
  conv.name = stored_prefix + "conv1d.weight";
  for (const std::string& name : convs) {
    auto it = c.info.find(name);
    if (it == c.info.end())
      return absl::NotFoundError(absl::StrCat("tensor '", name, "' is missing beside the other KDA convolutions"));
    const TensorInfo& t = *it->second;
    const TensorInfo& first = *c.info.at(convs[0]);
    if (t.shape.size() != 3 || t.dtype != first.dtype ||
        !std::equal(t.shape.begin() + 1, t.shape.end(), first.shape.begin() + 1, first.shape.end()))
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ", ShapeString(t.shape), " ",
                                                     std::string(DTypeName(t.dtype)), "; the KDA convolutions are ",
                                                     "fused into one conv1d and need [C, 1, K] in one dtype"));
    conv.inputs.push_back(t.name);
    conv.rows += t.shape[0];
  }
  const TensorInfo& first = *c.info.at(convs[0]);
  conv.dtype = first.dtype;
  conv.shape = {conv.rows, first.shape[1], first.shape[2]};
  AddComposite(c, std::move(conv));
  return absl::OkStatus();
}

// DeepSeek-V4's grouped wo_a [o_groups * o_lora_rank, in / o_groups] (`name`: a layer's or an MTP
// block's attn.wo_a.weight) as exllamav3 writes it: each group's rows an EXL3 layer of its own,
// `wo_a.slice.G` (exllamav3 reads a quantized wo_a only so; engine/cpu/attention/dsv4_grouped_wo_a.h
// reads both). Slices that EXL3 cannot hold (o_lora_rank not a multiple of 128) leave wo_a as stored.
absl::Status PlanGroupedWoA(Conversion& c, const std::string& name) {
  auto it = c.plan.find(name);
  if (it == c.plan.end()) return absl::OkStatus();
  const json& j = c.cfg_json;
  const json* g = j.contains("o_groups") ? &j["o_groups"] : nullptr;
  if (g == nullptr && j.contains("text_config") && j["text_config"].is_object() && j["text_config"].contains("o_groups"))
    g = &j["text_config"]["o_groups"];
  if (g == nullptr || !g->is_number_integer() || g->get<int>() <= 0)
    return absl::InvalidArgumentError("config.json: DeepSeek-V4's o_groups (a positive integer) is needed to write wo_a");
  const int groups = g->get<int>();
  const Planned whole = it->second;
  const TensorInfo& t = *c.info.at(name);
  if (whole.out % groups != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has shape ", ShapeString(t.shape),
                                                   ": its rows are not o_groups ", groups, " equal groups"));
  const int rows = whole.out / groups;
  c.plan.erase(it);
  if (rows % 128 != 0) {
    c.stats.kept_linears.push_back(absl::StrCat(t.name, " ", ShapeString(t.shape), " ", std::string(DTypeName(t.dtype)),
                                                ": its ", groups, " groups of ", rows, " rows are not multiples of 128, ",
                                                "kept as stored"));
    c.kept_names.push_back(t.name);
    return absl::OkStatus();
  }
  const std::string stored_prefix = t.name.substr(0, t.name.size() - std::string(".weight").size());
  for (int gi = 0; gi < groups; ++gi) {
    Composite slice;
    slice.quantized = true;
    slice.name = absl::StrCat(stored_prefix, ".slice.", gi);
    slice.inputs = {t.name};
    slice.first_row = static_cast<int64_t>(gi) * rows;
    slice.rows = rows;
    slice.p = {whole.bits, rows, whole.in};
    AddComposite(c, std::move(slice));
  }
  return absl::OkStatus();
}

// Where exllamav3 stores a quantized layer in another layout than the input's, the output takes
// its layout (tests/fixtures/exllamav3/README.md: what its converter writes; the engine reads both).
absl::Status PlanExllamav3Layouts(Conversion& c) {
  for (int L = 0; L < c.cfg.num_hidden_layers; ++L) {
    if (c.cfg.arch == Architecture::kGlm5Next && c.info.count(LayerPrefix(c.cfg, L) + "self_attn.f_a_proj.weight"))
      EXL3_RETURN_IF_ERROR(PlanKdaLayout(c, L));
    if (c.cfg.family == MoeFamily::kDeepseekV4) EXL3_RETURN_IF_ERROR(PlanGroupedWoA(c, LayerPrefix(c.cfg, L) + "attn.wo_a.weight"));
  }
  if (c.cfg.family == MoeFamily::kDeepseekV4) {
    std::vector<std::string> mtp_wo_a;  // the DSPARK blocks' (PlanDsv4MtpLinears)
    for (const auto& [name, p] : c.plan)
      if (absl::StartsWith(name, "mtp.") && absl::EndsWith(name, ".attn.wo_a.weight")) mtp_wo_a.push_back(name);
    for (const std::string& name : mtp_wo_a) EXL3_RETURN_IF_ERROR(PlanGroupedWoA(c, name));
  }
  return absl::OkStatus();
}

// What identifies this conversion: a shard written under other options is redone.
json Fingerprint(const ConvertOptions& options) {
  return {{"layout", kLayout},
          {"bits", options.bits},
          {"expert_bits", options.expert_bits},
          {"down_bits", options.down_bits},
          {"codebook", std::string(CodebookName(options.codebook))},
          {"seed", options.seed},
          {"quantize_shared", options.quantize_shared},
          {"quantize_attention", options.quantize_attention},
          {"quantize_dense_mlp", options.quantize_dense_mlp},
          {"head_bits", options.head_bits},
          {"quantize_mtp", options.quantize_mtp},
          {"mtp_bits", options.mtp_bits},
          {"scale_search", options.scale_search}};
}

uint64_t Tiles(const Planned& p) { return static_cast<uint64_t>(p.out / 16) * (p.in / 16); }

// The composites written where the input tensor `stored` is (none elsewhere).
const std::vector<size_t>* CompositesAt(const Conversion& c, const std::string& stored) {
  auto it = c.composites_at.find(stored);
  return it == c.composites_at.end() ? nullptr : &it->second;
}

void DeclareExl3Layer(const Conversion& c, const std::string& prefix, const Planned& p, SafetensorsStreamWriter& w) {
  w.Declare(prefix + ".trellis", DType::kI16, {p.in / 16, p.out / 16, 16 * p.bits});
  w.Declare(prefix + ".suh", DType::kF16, {p.in});
  w.Declare(prefix + ".svh", DType::kF16, {p.out});
  std::string suffix;
  int32_t flag;
  if (CodebookFlag(c.options.codebook, &suffix, &flag)) w.Declare(prefix + "." + suffix, DType::kI32, {});
}

// Every output tensor of shard `si` declared: planned ones as EXL3 (trellis, suh, svh, codebook
// flag), composites where their first input is, the other inputs of composites not at all.
void DeclareShard(const Conversion& c, const SafetensorsFile& in, SafetensorsStreamWriter& w) {
  for (const TensorInfo& t : in.tensors()) {
    if (c.consumed.count(t.name)) {
      if (const std::vector<size_t>* at = CompositesAt(c, t.name)) {
        for (size_t ci : *at) {
          const Composite& comp = c.composites[ci];
          if (comp.quantized) {
            DeclareExl3Layer(c, comp.name, comp.p, w);
          } else {
            w.Declare(comp.name, comp.dtype, comp.shape);
          }
        }
      }
      continue;
    }
    const Planned* planned = PlanFor(c, t.name);
    if (planned == nullptr) {
      w.Declare(t.name, t.dtype, t.shape);
      continue;
    }
    DeclareExl3Layer(c, t.name.substr(0, t.name.size() - 7), *planned, w);  // drop ".weight"
  }
}

// A weight [out, in] (fp32, row-major) quantized and written as the EXL3 layer `prefix`.
absl::Status QuantizeInto(Conversion& c, const std::string& where, const std::string& prefix, const float* weight,
                          const Planned& p, SafetensorsStreamWriter& w) {
  LayerQuantOptions lo;
  lo.bits = p.bits;
  lo.codebook = c.options.codebook;
  lo.seed = TensorSeed(c.options.seed, prefix);
  lo.threads = c.options.threads;
  lo.scale_search = c.options.scale_search;
  absl::StatusOr<QuantizedLayer> q = QuantizeLinear(weight, p.out, p.in, lo);
  if (!q.ok())
    return absl::Status(q.status().code(), absl::StrCat(where, ": layer '", prefix, "': ", q.status().message()));
  for (auto [suffix, vec] : {std::pair<const char*, const std::vector<uint16_t>*>{"trellis", &q->trellis},
                             {"suh", &q->suh}, {"svh", &q->svh}}) {
    EXL3_RETURN_IF_ERROR(w.Write(prefix + "." + suffix, vec->data(), vec->size() * 2));
  }
  std::string suffix;
  int32_t flag;
  if (CodebookFlag(c.options.codebook, &suffix, &flag)) EXL3_RETURN_IF_ERROR(w.Write(prefix + "." + suffix, &flag, 4));
  ++c.stats.tensors_quantized;
  c.mse_sum += q->relative_mse;
  return absl::OkStatus();
}

// One composite: its rows gathered from its inputs (in any shard), quantized or copied.
absl::Status WriteComposite(Conversion& c, const Composite& comp, SafetensorsStreamWriter& w) {
  std::vector<float> rows;  // quantized: fp32 [comp.rows, in]
  int64_t row = 0;          // of the inputs' concatenation
  for (const std::string& name : comp.inputs) {
    const SafetensorsFile& f = *c.files[c.file_of.at(name)];
    EXL3_ASSIGN_OR_RETURN(TensorView v, f.Get(name));
    const int64_t n = v.info->shape.at(0);
    int64_t row_elems = 1;
    for (size_t d = 1; d < v.info->shape.size(); ++d) row_elems *= v.info->shape[d];
    const int64_t lo = std::max(row, comp.first_row), hi = std::min(row + n, comp.first_row + comp.rows);
    if (lo < hi) {
      if (comp.quantized) {
        EXL3_ASSIGN_OR_RETURN(std::vector<float> values, ToFloat32(v));
        rows.insert(rows.end(), values.begin() + (lo - row) * row_elems, values.begin() + (hi - row) * row_elems);
      } else {
        const size_t row_bytes = static_cast<size_t>(row_elems) * DTypeSize(v.info->dtype);
        EXL3_RETURN_IF_ERROR(w.Write(comp.name, v.data + (lo - row) * row_bytes, (hi - lo) * row_bytes));
      }
    }
    row += n;
  }
  if (!comp.quantized) {
    ++c.stats.tensors_copied;
    return absl::OkStatus();
  }
  if (rows.size() != static_cast<size_t>(comp.p.out) * comp.p.in)
    return absl::InternalError(absl::StrCat(comp.name, ": gathered ", rows.size(), " values for [", comp.p.out, ", ",
                                            comp.p.in, "]"));
  return QuantizeInto(c, c.files[c.file_of.at(comp.inputs[0])]->path(), comp.name, rows.data(), comp.p, w);
}

// Shard `si` into the output directory, or kept where a complete one from the same conversion is there.
absl::Status ConvertShard(Conversion& c, size_t si, ProgressBar& bar) {
  const SafetensorsFile& in = *c.files[si];
  const std::string& shard_name = c.shards[si];
  const fs::path out_path = c.out_dir / shard_name;
  std::error_code ec;
  json shard_fp = Fingerprint(c.options);
  shard_fp["input_bytes"] = fs::file_size(c.in_dir / shard_name, ec);
  const std::string fingerprint = shard_fp.dump();
  uint64_t shard_tiles = 0;
  for (const TensorInfo& t : in.tensors()) {
    if (const Planned* p = PlanFor(c, t.name)) shard_tiles += Tiles(*p);
    if (const std::vector<size_t>* at = CompositesAt(c, t.name)) {
      for (size_t ci : *at)
        if (c.composites[ci].quantized) shard_tiles += Tiles(c.composites[ci].p);
    }
  }
  const std::string progress_prefix = absl::StrCat("shard ", si + 1, "/", c.files.size());
  if (fs::exists(out_path, ec)) {  // a restart
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> done = SafetensorsFile::Open(out_path.string());
    if (done.ok()) {
      auto m = (*done)->metadata().find(kFingerprintKey);
      if (m != (*done)->metadata().end() && m->second == fingerprint) {
        for (const TensorInfo& t : (*done)->tensors()) c.weight_map[t.name] = shard_name;
        ++c.stats.shards_skipped;
        bar.Add(shard_tiles, progress_prefix + " already complete");
        return absl::OkStatus();
      }
    }
  }
  SafetensorsStreamWriter w;
  w.AddMetadata("format", "pt");
  w.AddMetadata(kFingerprintKey, fingerprint);
  DeclareShard(c, in, w);
  EXL3_RETURN_IF_ERROR(w.Open(out_path.string()));
  for (const TensorInfo& t : in.tensors()) {
    if (c.consumed.count(t.name)) {
      if (const std::vector<size_t>* at = CompositesAt(c, t.name)) {
        for (size_t ci : *at) {
          const Composite& comp = c.composites[ci];
          if (comp.quantized) bar.SetDetail(absl::StrCat(progress_prefix, " ", comp.name));
          EXL3_RETURN_IF_ERROR(WriteComposite(c, comp, w));
          if (comp.quantized) bar.Add(Tiles(comp.p));
        }
      }
      continue;
    }
    EXL3_ASSIGN_OR_RETURN(TensorView v, in.Get(t.name));
    const Planned* planned = PlanFor(c, t.name);
    if (planned == nullptr) {
      EXL3_RETURN_IF_ERROR(w.Write(t.name, v.data, v.size_bytes()));
      ++c.stats.tensors_copied;
      continue;
    }
    const std::string prefix = t.name.substr(0, t.name.size() - 7);  // drop ".weight"
    bar.SetDetail(absl::StrCat(progress_prefix, " ", prefix));
    if (v.info->shape != std::vector<int64_t>{planned->out, planned->in})
      return absl::InternalError(absl::StrCat(in.path(), ": ", t.name, " is not [", planned->out, ", ", planned->in, "]"));
    EXL3_ASSIGN_OR_RETURN(std::vector<float> weight, ToFloat32(v));
    EXL3_RETURN_IF_ERROR(QuantizeInto(c, in.path(), prefix, weight.data(), *planned, w));
    bar.Add(Tiles(*planned));
  }
  EXL3_RETURN_IF_ERROR(w.Finish());
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> done, SafetensorsFile::Open(out_path.string()));
  for (const TensorInfo& t : done->tensors()) c.weight_map[t.name] = shard_name;
  return absl::OkStatus();
}

// The index over every output shard, the input's other files (tokenizer, generation config, ...)
// unchanged, and the content digest of every output tensor (model/weight_digest.h: the model
// fingerprint covers the weights, and a loader finds a file changed after conversion).
absl::Status WriteIndexAndCompanions(Conversion& c) {
  std::error_code ec;
  for (const std::string& s : c.shards) c.stats.output_bytes += fs::file_size(c.out_dir / s, ec);
  json index = {{"metadata", {{"total_size", c.stats.output_bytes}}}, {"weight_map", c.weight_map}};
  EXL3_RETURN_IF_ERROR(WriteTextAtomic(c.out_dir / "model.safetensors.index.json", index.dump(2) + "\n"));
  for (const auto& e : fs::directory_iterator(c.in_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || e.path().extension() == ".safetensors" || name == "model.safetensors.index.json" ||
        name == "config.json" || absl::EndsWith(name, ".tmp")) {
      continue;
    }
    fs::copy_file(e.path(), c.out_dir / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot copy ", name, ": ", ec.message()));
  }
  return WriteWeightDigests(c.out_dir.string());
}

// config.json with its quantization_config: written last, it marks a finished conversion.
absl::Status WriteQuantizedConfig(Conversion& c) {
  const ConvertOptions& options = c.options;
  const int eb = BitsFor(options, true, false), db = BitsFor(options, true, true);
  const bool shared = options.quantize_shared && c.cfg.has_shared_expert();
  std::vector<std::string> quantized = {"routed_experts"};
  if (shared) quantized.push_back("shared_experts");
  for (const char* m : {"attention", "dense_mlp", "head", "mtp"})
    if (c.modules.count(m)) quantized.push_back(m);
  json q = {{"quant_method", "exl3"},
            {"version", kVersion},
            {"bits", json::parse(BitsJson((2.0 * eb + db) / 3.0))},
            {"codebook", std::string(CodebookName(options.codebook))},
            {"expert_bits", eb},
            {"calibration", "none (data-free trellis quantization, no Hessian/LDLQ)"},
            {"quantized_modules", absl::StrJoin(quantized, ",")}};
  if (options.down_bits > 0) q["down_bits"] = options.down_bits;
  if (shared) q["shared_expert_bits"] = BitsFor(options, false, false);
  if (c.modules.count("attention")) q["attention_bits"] = options.bits;
  if (c.modules.count("dense_mlp")) q["dense_mlp_bits"] = BitsFor(options, false, false);
  if (c.modules.count("head")) q["head_bits"] = options.head_bits;
  if (c.modules.count("mtp")) q["mtp_bits"] = options.mtp_bits > 0 ? options.mtp_bits : options.bits;
  if (!c.kept_names.empty()) q["unquantized_linears"] = c.kept_names;
  c.cfg_json["quantization_config"] = q;
  return WriteTextAtomic(c.out_dir / "config.json", c.cfg_json.dump(2) + "\n");
}

}  // namespace

absl::StatusOr<ConvertStats> ConvertCheckpoint(const std::string& input_dir, const std::string& output_dir,
                                               const ConvertOptions& options) {
  EXL3_RETURN_IF_ERROR(CheckOptions(options));
  Conversion c(input_dir, output_dir, options);
  std::error_code ec;
  if (!fs::is_directory(c.in_dir, ec)) return absl::NotFoundError(absl::StrCat(input_dir, " is not a directory"));
  if (fs::exists(c.out_dir, ec) && fs::equivalent(c.in_dir, c.out_dir, ec))
    return absl::InvalidArgumentError("the output directory must differ from the input directory");
  EXL3_RETURN_IF_ERROR(ReadSource(c));
  EXL3_RETURN_IF_ERROR(PlanExperts(c));
  PlanOtherLinears(c);
  PlanDsv4MtpLinears(c);
  EXL3_RETURN_IF_ERROR(PlanExllamav3Layouts(c));
  fs::create_directories(c.out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", output_dir, ": ", ec.message()));
  uint64_t total_tiles = 0;
  for (const auto& [name, p] : c.plan) total_tiles += Tiles(p);
  for (const Composite& comp : c.composites)
    if (comp.quantized) total_tiles += Tiles(comp.p);
  ProgressBar bar("exl3-tool quantize", total_tiles, options.progress);
  c.stats.shards_total = static_cast<int>(c.files.size());
  for (size_t si = 0; si < c.files.size(); ++si) EXL3_RETURN_IF_ERROR(ConvertShard(c, si, bar));
  bar.Finish();
  EXL3_RETURN_IF_ERROR(WriteIndexAndCompanions(c));
  EXL3_RETURN_IF_ERROR(WriteQuantizedConfig(c));
  if (c.stats.tensors_quantized > 0) c.stats.mean_relative_mse = c.mse_sum / c.stats.tensors_quantized;
  return c.stats;
}

}  // namespace exl3

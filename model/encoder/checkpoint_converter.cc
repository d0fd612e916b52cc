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
#include "model/encoder/layer_quantizer.h"
#include "model/encoder/progress.h"
#include "model/encoder/safetensors_stream_writer.h"
#include "model/moe_config.h"
#include "model/safetensors.h"
#include "model/weight_digest.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kVersion[] = "0.0.6";          // quantization_config.version we write
constexpr char kFingerprintKey[] = "exl3_convert";

struct Planned {
  int bits = 0;
  int out = 0, in = 0;  // HF orientation [out, in]
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
  if (cfg.architecture != "Glm5NextForConditionalGeneration") return false;
  for (const char* g : {"f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj"})
    if (rest == absl::StrCat("self_attn.", g, ".weight")) return true;
  return false;
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

absl::StatusOr<ConvertStats> ConvertCheckpoint(const std::string& input_dir,
                                               const std::string& output_dir,
                                               const ConvertOptions& options) {
  for (int k : {options.bits, options.expert_bits, options.down_bits, options.head_bits}) {
    if (k != 0 && (k < 1 || k > 8)) {
      return absl::InvalidArgumentError(absl::StrCat("bit width ", k, " is not in 1..8"));
    }
  }
  if (options.bits < 1) return absl::InvalidArgumentError("bits must be in 1..8");
  const fs::path in_dir(input_dir), out_dir(output_dir);
  std::error_code ec;
  if (!fs::is_directory(in_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(input_dir, " is not a directory"));
  }
  if (fs::exists(out_dir, ec) && fs::equivalent(in_dir, out_dir, ec)) {
    return absl::InvalidArgumentError("the output directory must differ from the input directory");
  }

  // config.json: architecture and layout.
  absl::StatusOr<std::string> cfg_text = ReadText(in_dir / "config.json");
  if (!cfg_text.ok()) return cfg_text.status();
  json cfg_json = json::parse(*cfg_text, nullptr, /*allow_exceptions=*/false);
  if (cfg_json.is_discarded() || !cfg_json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat((in_dir / "config.json").string(), ": not a JSON object"));
  }
  if (cfg_json.contains("quantization_config")) {
    std::string method = "?";
    const json& q = cfg_json["quantization_config"];
    if (q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()) {
      method = q["quant_method"].get<std::string>();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        input_dir, " is already quantized (quantization_config.quant_method '", method,
        "'); the converter needs a bf16/fp16/fp32 checkpoint"));
  }
  absl::StatusOr<MoeConfig> cfg = ParseMoeConfig(*cfg_text, (in_dir / "config.json").string());
  if (!cfg.ok()) return cfg.status();

  // Shards and where every tensor lives.
  absl::StatusOr<std::vector<std::string>> shards = ListShards(in_dir);
  if (!shards.ok()) return shards.status();
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const TensorInfo*> info;
  for (const std::string& s : *shards) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open((in_dir / s).string());
    if (!f.ok()) return f.status();
    for (const TensorInfo& t : (*f)->tensors()) info[t.name] = &t;
    files.push_back(std::move(*f));
  }

  // The plan: which tensors become EXL3 layers, with which K.
  std::map<std::string, Planned> plan;
  auto want = [&](const std::string& prefix, int out, int in, int bits) -> absl::Status {
    const std::string name = prefix + ".weight";
    auto it = info.find(name);
    if (it == info.end()) {
      return absl::NotFoundError(absl::StrCat(
          "tensor '", name, "' is missing: the checkpoint is incomplete or not laid out as ",
          cfg->architecture, " (", std::string(MoeFamilyName(cfg->family)), ") expects"));
    }
    const std::vector<int64_t>& s = it->second->shape;
    if (s.size() != 2 || s[0] != out || s[1] != in) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ", ShapeString(s),
                                                     "; config.json implies [", out, ", ", in, "]"));
    }
    if (out % 128 != 0 || in % 128 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "' has shape ", ShapeString(s),
          ": EXL3 needs both dimensions to be multiples of 128"));
    }
    const DType d = it->second->dtype;
    if (!IsFloatWeight(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "' has dtype ", std::string(DTypeName(d)),
          "; the converter reads BF16, F16 or F32 weights (dequantize FP8 checkpoints first)"));
    }
    plan[name] = {bits, out, in};
    return absl::OkStatus();
  };
  const int H = cfg->hidden_size;
  for (int L : cfg->MoeLayers()) {
    for (int e = 0; e < cfg->num_experts; ++e) {
      const int I = cfg->moe_intermediate_size;
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const bool down = p == Projection::kDown;
        absl::Status s = want(RoutedExpertPrefix(*cfg, L, e, p), down ? H : I, down ? I : H,
                              BitsFor(options, true, down));
        if (!s.ok()) return s;
      }
    }
    if (cfg->has_shared_expert() && options.quantize_shared) {
      const int I = cfg->shared_intermediate_size;
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const bool down = p == Projection::kDown;
        absl::Status s = want(SharedExpertPrefix(*cfg, L, p), down ? H : I, down ? I : H,
                              BitsFor(options, false, down));
        if (!s.ok()) return s;
      }
    }
  }

  // The other linears, as exllamav3 quantizes them: attention projections and dense MLPs at
  // `bits` (dense down projections at `down_bits` when set), the head at `head_bits`. A linear
  // EXL3 cannot hold (a dimension not a multiple of 128, a non-float dtype) stays as stored.
  ConvertStats stats;
  std::set<std::string> modules;  // of these three kinds, those with a quantized tensor
  std::vector<std::string> kept_names;  // asked for, but not EXL3-able
  auto optional_linear = [&](const std::string& name, int bits, const char* module) {
    const TensorInfo& t = *info.at(name);
    const bool shape_ok = t.shape[0] % 128 == 0 && t.shape[1] % 128 == 0;
    if (!shape_ok || !IsFloatWeight(t.dtype)) {
      stats.kept_linears.push_back(absl::StrCat(
          name, " ", ShapeString(t.shape), " ", std::string(DTypeName(t.dtype)), ": ",
          shape_ok ? "not BF16/F16/F32" : "dimensions not both multiples of 128",
          ", kept as stored"));
      kept_names.push_back(name);
      return;
    }
    plan[name] = {bits, static_cast<int>(t.shape[0]), static_cast<int>(t.shape[1])};
    modules.insert(module);
  };
  const std::string head_key = HeadWeightKey(*cfg);
  for (const auto& [name, t] : info) {
    if (t->shape.size() != 2) continue;
    if (name == head_key) {
      if (options.head_bits > 0) optional_linear(name, options.head_bits, "head");
      continue;
    }
    int layer = 0;
    std::string rest;
    if (!SplitLayerKey(*cfg, name, &layer, &rest) || layer >= cfg->num_hidden_layers ||
        !absl::EndsWith(rest, ".weight")) {
      continue;
    }
    if (rest == "self_attn.indexer.weights_proj.weight" || rest == "attn.indexer.weights_proj.weight") {
      // DSA's and DeepSeek-V4's per-head indexer weights: a router-like [heads, hidden]
      // projection that exllamav3 keeps unquantized (and transformers in fp32), like the routers.
      continue;
    }
    if (IsKdaGateProjection(*cfg, rest)) continue;
    // DeepSeek-V4 names its attention `attn.` (wq_a, wq_b, wkv, wo_a, wo_b, the compressors'
    // wkv / wgate, the indexer's wq_b); its grouped wo_a [groups * o_lora_rank, in / groups] is
    // one EXL3 linear, applied group by group (engine/dsv4_attention.h).
    const bool v4_attention = cfg->family == MoeFamily::kDeepseekV4 && absl::StartsWith(rest, "attn.");
    if (absl::StartsWith(rest, "self_attn.") || absl::StartsWith(rest, "linear_attn.") || v4_attention) {
      if (options.quantize_attention) optional_linear(name, options.bits, "attention");
    } else if (!cfg->IsMoeLayer(layer) &&
               (rest == "mlp.gate_proj.weight" || rest == "mlp.up_proj.weight" ||
                rest == "mlp.down_proj.weight")) {
      if (options.quantize_dense_mlp) {
        optional_linear(name, BitsFor(options, false, rest == "mlp.down_proj.weight"), "dense_mlp");
      }
    }
  }
  const bool tied = cfg_json.contains("tie_word_embeddings") &&
                    cfg_json["tie_word_embeddings"].is_boolean() &&
                    cfg_json["tie_word_embeddings"].get<bool>();
  if (options.head_bits > 0 && info.count(head_key) == 0) {
    stats.kept_linears.push_back(
        tied ? "lm_head: none (tie_word_embeddings: the head is model.embed_tokens, kept as stored)"
             : absl::StrCat("lm_head: no ", head_key, " tensor, no head quantized"));
  }

  // What identifies this conversion: a shard written under other options is redone.
  json fp = {{"bits", options.bits},
             {"expert_bits", options.expert_bits},
             {"down_bits", options.down_bits},
             {"codebook", std::string(CodebookName(options.codebook))},
             {"seed", options.seed},
             {"quantize_shared", options.quantize_shared},
             {"quantize_attention", options.quantize_attention},
             {"quantize_dense_mlp", options.quantize_dense_mlp},
             {"head_bits", options.head_bits},
             {"scale_search", options.scale_search}};

  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", output_dir, ": ", ec.message()));

  uint64_t total_tiles = 0;
  for (const auto& [name, p] : plan) total_tiles += static_cast<uint64_t>(p.out / 16) * (p.in / 16);
  ProgressBar bar("exl3-tool quantize", total_tiles, options.progress);
  stats.shards_total = static_cast<int>(files.size());
  double mse_sum = 0;
  json weight_map = json::object();

  for (size_t si = 0; si < files.size(); ++si) {
    const SafetensorsFile& in = *files[si];
    const std::string shard_name = (*shards)[si];
    const fs::path out_path = out_dir / shard_name;
    json shard_fp = fp;
    shard_fp["input_bytes"] = fs::file_size(in_dir / shard_name, ec);
    const std::string fingerprint = shard_fp.dump();
    uint64_t shard_tiles = 0;
    for (const TensorInfo& t : in.tensors()) {
      auto it = plan.find(t.name);
      if (it != plan.end()) shard_tiles += static_cast<uint64_t>(it->second.out / 16) * (it->second.in / 16);
    }
    const std::string progress_prefix = absl::StrCat("shard ", si + 1, "/", files.size());

    // Restart: a complete shard from the same conversion is kept.
    if (fs::exists(out_path, ec)) {
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> done = SafetensorsFile::Open(out_path.string());
      if (done.ok()) {
        auto m = (*done)->metadata().find(kFingerprintKey);
        if (m != (*done)->metadata().end() && m->second == fingerprint) {
          for (const TensorInfo& t : (*done)->tensors()) weight_map[t.name] = shard_name;
          ++stats.shards_skipped;
          bar.Add(shard_tiles, progress_prefix + " already complete");
          continue;
        }
      }
    }

    SafetensorsStreamWriter w;
    w.AddMetadata("format", "pt");
    w.AddMetadata(kFingerprintKey, fingerprint);
    for (const TensorInfo& t : in.tensors()) {
      auto it = plan.find(t.name);
      if (it == plan.end()) {
        w.Declare(t.name, t.dtype, t.shape);
        continue;
      }
      const Planned& p = it->second;
      const std::string prefix = t.name.substr(0, t.name.size() - 7);  // drop ".weight"
      w.Declare(prefix + ".trellis", DType::kI16, {p.in / 16, p.out / 16, 16 * p.bits});
      w.Declare(prefix + ".suh", DType::kF16, {p.in});
      w.Declare(prefix + ".svh", DType::kF16, {p.out});
      std::string suffix;
      int32_t flag;
      if (CodebookFlag(options.codebook, &suffix, &flag)) w.Declare(prefix + "." + suffix, DType::kI32, {});
    }
    absl::Status s = w.Open(out_path.string());
    if (!s.ok()) return s;
    for (const TensorInfo& t : in.tensors()) {
      absl::StatusOr<TensorView> v = in.Get(t.name);
      if (!v.ok()) return v.status();
      auto it = plan.find(t.name);
      if (it == plan.end()) {
        s = w.Write(t.name, v->data, v->size_bytes());
        if (!s.ok()) return s;
        ++stats.tensors_copied;
        continue;
      }
      const Planned& p = it->second;
      const std::string prefix = t.name.substr(0, t.name.size() - 7);
      bar.SetDetail(absl::StrCat(progress_prefix, " ", prefix));
      LayerQuantOptions lo;
      lo.bits = p.bits;
      lo.codebook = options.codebook;
      lo.seed = TensorSeed(options.seed, prefix);
      lo.threads = options.threads;
      lo.scale_search = options.scale_search;
      absl::StatusOr<QuantizedLayer> q = QuantizeLinearTensor(*v, lo);
      if (!q.ok()) {
        return absl::Status(q.status().code(), absl::StrCat(in.path(), ": ", q.status().message()));
      }
      for (auto [suffix, vec] : {std::pair<const char*, const std::vector<uint16_t>*>{"trellis", &q->trellis},
                                 {"suh", &q->suh}, {"svh", &q->svh}}) {
        s = w.Write(prefix + "." + suffix, vec->data(), vec->size() * 2);
        if (!s.ok()) return s;
      }
      std::string suffix;
      int32_t flag;
      if (CodebookFlag(options.codebook, &suffix, &flag)) {
        s = w.Write(prefix + "." + suffix, &flag, 4);
        if (!s.ok()) return s;
      }
      ++stats.tensors_quantized;
      mse_sum += q->relative_mse;
      bar.Add(static_cast<uint64_t>(p.out / 16) * (p.in / 16));
    }
    s = w.Finish();
    if (!s.ok()) return s;
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> done = SafetensorsFile::Open(out_path.string());
    if (!done.ok()) return done.status();
    for (const TensorInfo& t : (*done)->tensors()) weight_map[t.name] = shard_name;
  }
  bar.Finish();

  // Index over all output shards.
  for (const std::string& s : *shards) stats.output_bytes += fs::file_size(out_dir / s, ec);
  json index = {{"metadata", {{"total_size", stats.output_bytes}}}, {"weight_map", weight_map}};
  absl::Status s = WriteTextAtomic(out_dir / "model.safetensors.index.json", index.dump(2) + "\n");
  if (!s.ok()) return s;

  // Other files (tokenizer, generation config, ...), unchanged.
  for (const auto& e : fs::directory_iterator(in_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || e.path().extension() == ".safetensors" ||
        name == "model.safetensors.index.json" || name == "config.json" ||
        (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0)) {
      continue;
    }
    fs::copy_file(e.path(), out_dir / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot copy ", name, ": ", ec.message()));
  }

  // The content digest of every output tensor (model/weight_digest.h): the model fingerprint
  // covers the weights, and a loader finds a file changed after conversion.
  s = WriteWeightDigests(out_dir.string());
  if (!s.ok()) return s;

  // config.json last: its quantization_config marks a finished conversion.
  const int eb = BitsFor(options, true, false), db = BitsFor(options, true, true);
  const bool shared = options.quantize_shared && cfg->has_shared_expert();
  std::vector<std::string> quantized = {"routed_experts"};
  if (shared) quantized.push_back("shared_experts");
  for (const char* m : {"attention", "dense_mlp", "head"}) {
    if (modules.count(m)) quantized.push_back(m);
  }
  json q = {{"quant_method", "exl3"},
            {"version", kVersion},
            {"bits", json::parse(BitsJson((2.0 * eb + db) / 3.0))},
            {"codebook", std::string(CodebookName(options.codebook))},
            {"expert_bits", eb},
            {"calibration", "none (data-free trellis quantization, no Hessian/LDLQ)"},
            {"quantized_modules", absl::StrJoin(quantized, ",")}};
  if (options.down_bits > 0) q["down_bits"] = options.down_bits;
  if (shared) q["shared_expert_bits"] = BitsFor(options, false, false);
  if (modules.count("attention")) q["attention_bits"] = options.bits;
  if (modules.count("dense_mlp")) q["dense_mlp_bits"] = BitsFor(options, false, false);
  if (modules.count("head")) q["head_bits"] = options.head_bits;
  if (!kept_names.empty()) q["unquantized_linears"] = kept_names;
  cfg_json["quantization_config"] = q;
  s = WriteTextAtomic(out_dir / "config.json", cfg_json.dump(2) + "\n");
  if (!s.ok()) return s;
  if (stats.tensors_quantized > 0) stats.mean_relative_mse = mse_sum / stats.tensors_quantized;
  return stats;
}

}  // namespace exl3

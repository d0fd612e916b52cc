#include "model/testmodel/test_model.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <thread>
#include <atomic>
#include <cstring>
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/fp16.h"
#include "model/config/read_moe_config.h"
#include "model/encoder/layer_quantizer.h"
#include "model/encoder/progress.h"
#include "model/encoder/safetensors_stream_writer.h"
#include "model/moe_config.h"
#include "model/safetensors.h"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

bool IsSigmoidFamily(const std::string& arch) {
  return arch == "glm4_moe" || arch == "deepseek_v3" || arch == "glm_moe_dsa" || arch == "glm5_next";
}

// MLA (GLM-5.3-Flash's on its indexed layers, NoPE).
bool IsLatentAttention(const std::string& arch) {
  return arch == "deepseek_v3" || arch == "glm_moe_dsa" || arch == "glm5_next";
}

constexpr char kSliding[] = "sliding_attention";
constexpr char kCsa[] = "compressed_sparse_attention";
constexpr char kHca[] = "heavily_compressed_attention";
constexpr char kLinear[] = "linear_attention";
constexpr char kFull[] = "full_attention";
constexpr char kIndexed[] = "indexed_attention";  // GLM-5.3-Flash's MLA with the k-pooled indexer

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  float Gaussian() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2 * M_PI * u2));
    have_spare_ = true;
    return static_cast<float>(r * std::cos(2 * M_PI * u2));
  }

 private:
  uint64_t s_;
  bool have_spare_ = false;
  float spare_ = 0;
};

std::string ShardName(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

absl::Status WriteText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", p.string()));
  return absl::OkStatus();
}

// A tensor to generate: name, dtype, shape and how to fill it.
struct GenTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  // kUniform: U(scale, high); kHashTable: int64 rows of `flag` distinct ids in [0, high).
  enum Kind { kGaussian, kNorm, kBias, kUniform, kLogUniform, kRandomBits, kSigns, kFlag, kHashTable } kind;
  float scale = 0.02f;  // Gaussian std; kSigns: magnitude; kBias: range; k(Log)Uniform: low
  int32_t flag = 0;
  float high = 0.0f;    // k(Log)Uniform: the upper bound (kLogUniform: log of U(scale, high))
};

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A tensor of more than kElementsPerPart elements is drawn in parts of that many elements, part p
// from its own random stream (seeded by the tensor's name and p), so that the parts of one large
// tensor (an embedding table) generate in parallel; smaller tensors are one stream.
int DefaultThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

constexpr int64_t kElementsPerPart = int64_t{1} << 24;

int64_t NumParts(const GenTensor& t) {
  if (t.kind == GenTensor::kFlag || t.kind == GenTensor::kHashTable) return 1;
  return std::max<int64_t>(1, (NumElements(t.shape) + kElementsPerPart - 1) / kElementsPerPart);
}

uint64_t PartSeed(uint64_t seed, const std::string& name, int64_t part) {
  const uint64_t s = TensorSeed(seed, name);
  return part == 0 ? s : Rng(s ^ (0xd1b54a32d192ed03ull * static_cast<uint64_t>(part))).Next();
}

// Writes part `part` of `t` (deterministic in (seed, name, part)) into `out`, the whole
// tensor's bytes.
void GeneratePart(const GenTensor& t, uint64_t seed, int64_t part, uint8_t* out) {
  Rng rng(PartSeed(seed, t.name, part));
  const int64_t n = NumElements(t.shape);
  const int64_t first = part * kElementsPerPart, count = std::min(n - first, kElementsPerPart);
  const size_t esize = DTypeSize(t.dtype);
  uint8_t* dst = out + static_cast<size_t>(first) * esize;
  switch (t.kind) {
    case GenTensor::kRandomBits: {
      const size_t bytes = static_cast<size_t>(count) * esize;
      for (size_t at = 0; at < bytes; at += 8) {
        const uint64_t v = rng.Next();
        std::memcpy(dst + at, &v, std::min<size_t>(8, bytes - at));
      }
      return;
    }
    case GenTensor::kFlag:
      std::memcpy(dst, &t.flag, 4);
      return;
    case GenTensor::kHashTable: {  // per row (token id): t.flag distinct experts, partial shuffle
      const int64_t rows = t.shape[0], cols = t.shape[1], n_ids = static_cast<int64_t>(t.high);
      std::vector<int64_t> ids(n_ids);
      int64_t* o = reinterpret_cast<int64_t*>(dst);
      for (int64_t r = 0; r < rows; ++r) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t j = c + static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(n_ids - c));
          std::swap(ids[c], ids[j]);
          o[r * cols + c] = ids[c];
        }
      }
      return;
    }
    case GenTensor::kSigns: {
      const uint16_t pos = FloatToHalfBits(t.scale), neg = pos | 0x8000u;
      uint16_t* o = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) o[i] = (rng.Next() & 1) ? neg : pos;
      return;
    }
    default:
      break;
  }
  for (int64_t i = 0; i < count; ++i) {
    float v = 0.0f;
    switch (t.kind) {
      case GenTensor::kGaussian: v = rng.Gaussian() * t.scale; break;
      case GenTensor::kNorm: v = 1.0f + 0.05f * rng.Gaussian(); break;
      case GenTensor::kBias: v = static_cast<float>((2 * rng.Uniform() - 1) * t.scale); break;
      case GenTensor::kUniform: v = static_cast<float>(t.scale + (t.high - t.scale) * rng.Uniform()); break;
      case GenTensor::kLogUniform:
        v = static_cast<float>(std::log(t.scale + (t.high - t.scale) * rng.Uniform()));
        break;
      default: break;
    }
    if (t.dtype == DType::kF32) {
      std::memcpy(dst + 4 * i, &v, 4);
    } else {
      const uint16_t h = t.dtype == DType::kBF16 ? FloatToBFloat16Bits(v) : FloatToHalfBits(v);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

// Generates `batch` (every part of every tensor) on `threads` threads.
std::vector<std::vector<uint8_t>> GenerateTensors(const std::vector<const GenTensor*>& batch, uint64_t seed,
                                                  int threads) {
  std::vector<std::vector<uint8_t>> out(batch.size());
  std::vector<std::pair<size_t, int64_t>> work;  // (tensor, part)
  for (size_t i = 0; i < batch.size(); ++i) {
    out[i].resize(static_cast<size_t>(NumElements(batch[i]->shape)) * DTypeSize(batch[i]->dtype));
    for (int64_t p = 0; p < NumParts(*batch[i]); ++p) work.emplace_back(i, p);
  }
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t w; (w = next.fetch_add(1)) < work.size();)
      GeneratePart(*batch[work[w].first], seed, work[w].second, out[work[w].first].data());
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(work.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  return out;
}

// Tensors are generated in batches of about this many bytes (bounding the memory held), each
// batch's tensors in parallel, and written in order.
constexpr uint64_t kBatchBytes = uint64_t{512} << 20;

absl::Status WriteShard(const fs::path& path, const std::vector<GenTensor>& tensors, uint64_t seed,
                        int threads, ProgressBar* bar, json* weight_map,
                        DataSectionStart data_start = DataSectionStart::k64ByteAligned) {
  SafetensorsStreamWriter w;
  w.AddMetadata("format", "pt");
  w.SetDataSectionStart(data_start);
  for (const GenTensor& t : tensors) w.Declare(t.name, t.dtype, t.shape);
  absl::Status s = w.Open(path.string());
  if (!s.ok()) return s;
  for (size_t i = 0; i < tensors.size();) {
    std::vector<const GenTensor*> batch;
    uint64_t bytes = 0;
    for (; i < tensors.size() && (batch.empty() || bytes < kBatchBytes); ++i) {
      batch.push_back(&tensors[i]);
      bytes += static_cast<uint64_t>(NumElements(tensors[i].shape)) * DTypeSize(tensors[i].dtype);
    }
    const std::vector<std::vector<uint8_t>> data = GenerateTensors(batch, seed, threads);
    for (size_t k = 0; k < batch.size(); ++k) {
      s = w.Write(batch[k]->name, data[k].data(), data[k].size());
      if (!s.ok()) return s;
      if (bar) bar->Add(data[k].size());
      (*weight_map)[batch[k]->name] = path.filename().string();
    }
  }
  return w.Finish();
}

absl::Status WriteIndex(const fs::path& dir, const json& weight_map) {
  uint64_t total = 0;
  std::error_code ec;
  std::vector<std::string> seen;
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    const std::string f = it.value().get<std::string>();
    if (std::find(seen.begin(), seen.end(), f) == seen.end()) {
      seen.push_back(f);
      total += fs::file_size(dir / f, ec);
    }
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteText(dir / "model.safetensors.index.json", index.dump(2) + "\n");
}

// One linear layer [out_f, in_f]: EXL3 with random trellis bits (exl3, both dimensions multiples
// of 128) or an HF bf16 weight.
// Which bit width of SyntheticOptions a linear takes.
enum class LinearRole { kExpert, kExpertDown, kAttentionOrDense, kHead };

int BitsOf(const SyntheticOptions& so, LinearRole role) {
  switch (role) {
    case LinearRole::kExpertDown: return so.down_bits > 0 ? so.down_bits : so.bits;
    case LinearRole::kAttentionOrDense: return so.attention_bits > 0 ? so.attention_bits : so.bits;
    case LinearRole::kHead: return so.head_bits > 0 ? so.head_bits : so.bits;
    case LinearRole::kExpert: break;
  }
  return so.bits;
}

// expert >= 0: a routed expert's linear, whose K and codebook SyntheticOptions' per-expert cycles
// may set.
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
  out->push_back({prefix + ".trellis", DType::kI16, {in_f / 16, out_f / 16, 16 * K},
                  GenTensor::kRandomBits});
  out->push_back({prefix + ".suh", DType::kF16, {in_f}, GenTensor::kSigns, 1.0f});
  // |svh| = 1 / (1.24 sqrt(in)): unit-variance inputs give roughly unit-variance outputs.
  out->push_back({prefix + ".svh", DType::kF16, {out_f}, GenTensor::kSigns,
                  static_cast<float>(1.0 / (1.24 * std::sqrt(static_cast<double>(in_f))))});
  std::string suffix;
  int32_t flag;
  if (CodebookFlag(codebook, &suffix, &flag)) {
    GenTensor t{prefix + "." + suffix, DType::kI32, {}, GenTensor::kFlag};
    t.flag = flag;
    out->push_back(t);
  }
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

GenTensor NormTensor(std::string name, int64_t n) {
  return GenTensor{std::move(name), DType::kBF16, {n}, GenTensor::kNorm};
}

// A decoder norm of the family's convention: Qwen3-Next stores zero-centred weights (x · (1 + w)).
GenTensor FamilyNormTensor(const TestModelSpec& s, std::string name, int64_t n) {
  if (s.arch == "qwen3_next") return GenTensor{std::move(name), DType::kBF16, {n}, GenTensor::kGaussian, 0.1f};
  return NormTensor(std::move(name), n);
}

// DeepSeek-V4's manifold-constrained hyper-connection of one sublayer (`prefix` hc_attn_ or
// hc_ffn_): fn [(2 + hc) hc, hc hidden], base [(2 + hc) hc], scale [3].
void AddHyperConnection(const TestModelSpec& s, const std::string& prefix, std::vector<GenTensor>* t) {
  const int64_t hc = s.hc_mult, mixes = (2 + hc) * hc;
  t->push_back({prefix + "fn", DType::kBF16, {mixes, hc * s.hidden}, GenTensor::kGaussian, 0.02f});
  t->push_back({prefix + "base", DType::kBF16, {mixes}, GenTensor::kGaussian, 0.1f});
  t->push_back({prefix + "scale", DType::kBF16, {3}, GenTensor::kUniform, 0.5f, 0, 1.5f});
}

// DeepSeek-V4's attention of layer L (`attn.*`, engine/dsv4_attention.h): the shared-KV
// projections, the grouped output projection, sinks, and per layer type its compressor and the
// CSA indexer.
void AddDsv4Attention(const TestModelSpec& s, int L, const std::string& p,
                      const std::function<void(const std::string&, int, int)>& linear,
                      std::vector<GenTensor>* t) {
  const int H = s.hidden, NH = s.heads, D = s.head_dim, G = s.o_groups, R = s.o_lora_rank;
  linear("attn.wq_a", s.q_lora_rank, H);
  t->push_back(NormTensor(p + "attn.q_norm.weight", s.q_lora_rank));
  linear("attn.wq_b", NH * D, s.q_lora_rank);
  linear("attn.wkv", D, H);
  t->push_back(NormTensor(p + "attn.norm.weight", D));
  linear("attn.wo_a", G * R, NH * D / G);
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

// Qwen3-Next's gated DeltaNet of one layer (`linear_attn.*`, engine/gated_deltanet.h).
void AddGatedDeltaNet(const TestModelSpec& s, const std::string& p,
                      const std::function<void(const std::string&, int, int)>& linear,
                      std::vector<GenTensor>* t) {
  const int H = s.hidden, kd = s.linear_key_heads * s.linear_key_head_dim,
            vd = s.linear_value_heads * s.linear_value_head_dim, nv = s.linear_value_heads;
  linear("linear_attn.in_proj_qkvz", 2 * kd + 2 * vd, H);
  linear("linear_attn.in_proj_ba", 2 * nv, H);
  t->push_back({p + "linear_attn.conv1d.weight", DType::kBF16, {2 * kd + vd, 1, s.linear_conv_kernel},
                GenTensor::kGaussian, 0.3f});
  // Decay rates exp(A_log) in [0.02, 0.5]: the state remembers a few to a few hundred tokens.
  t->push_back({p + "linear_attn.A_log", DType::kBF16, {nv}, GenTensor::kLogUniform, 0.02f, 0, 0.5f});
  t->push_back({p + "linear_attn.dt_bias", DType::kBF16, {nv}, GenTensor::kBias, 0.5f});
  t->push_back(NormTensor(p + "linear_attn.norm.weight", s.linear_value_head_dim));  // used as stored
  linear("linear_attn.out_proj", H, vd);
}

// GLM-5.3-Flash's Kimi delta attention of one layer (self_attn.*, engine/kimi_delta_attention.h):
// q/k/v/o projections (EXL3 where the converter quantizes them), the low-rank forget and output
// gates and beta's b_proj (kept as stored, model/encoder/checkpoint_converter.cc's
// IsKdaGateProjection), the short convolutions, A_log, dt_bias and the gated output norm.
void AddKimiDeltaAttention(const TestModelSpec& s, const std::string& p,
                           const std::function<void(const std::string&, int, int)>& linear,
                           std::vector<GenTensor>* t) {
  const int H = s.hidden, NH = s.linear_heads, D = s.linear_head_dim, W = NH * D;
  linear("self_attn.q_proj", W, H);
  linear("self_attn.k_proj", W, H);
  linear("self_attn.v_proj", W, H);
  linear("self_attn.o_proj", H, W);
  for (const char* gate : {"f_a_proj", "g_a_proj"})
    t->push_back({p + "self_attn." + gate + ".weight", DType::kBF16, {D, H}, GenTensor::kGaussian, 0.02f});
  for (const char* gate : {"f_b_proj", "g_b_proj"})
    t->push_back({p + "self_attn." + gate + ".weight", DType::kBF16, {W, D}, GenTensor::kGaussian, 0.02f});
  t->push_back({p + "self_attn.b_proj.weight", DType::kBF16, {NH, H}, GenTensor::kGaussian, 0.02f});
  for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"})
    t->push_back({p + "self_attn." + conv + ".weight", DType::kBF16, {W, 1, s.linear_conv_kernel},
                  GenTensor::kGaussian, 0.3f});
  // exp(A_log) in [1, 16]: the forget gate's slope (its decay is bounded by linear_lower_bound).
  t->push_back({p + "self_attn.A_log", DType::kBF16, {NH}, GenTensor::kLogUniform, 1.0f, 0, 16.0f});
  t->push_back({p + "self_attn.dt_bias", DType::kBF16, {W}, GenTensor::kBias, 0.5f});
  t->push_back(NormTensor(p + "self_attn.o_norm.weight", D));
}

// Every tensor of decoder layer L: norms, attention (the family's), dense MLP or MoE block.
void AddLayerTensors(const TestModelSpec& s, const MoeConfig& cfg, int L, bool exl3,
                     const SyntheticOptions* so, std::vector<GenTensor>* t) {
  const int H = s.hidden, heads = s.heads;
  const std::string p = LayerPrefix(cfg, L);
  auto linear = [&](const std::string& name, int out_f, int in_f) {
    AddLinear(p + name, out_f, in_f, LinearRole::kAttentionOrDense, exl3, so, t);
  };
  if (s.arch == "deepseek_v4") {  // its original names; every layer MoE
    t->push_back(NormTensor(p + "attn_norm.weight", H));
    t->push_back(NormTensor(p + "ffn_norm.weight", H));
    AddHyperConnection(s, p + "hc_attn_", t);
    AddHyperConnection(s, p + "hc_ffn_", t);
    AddDsv4Attention(s, L, p, linear, t);
    AddMoeTensors(s, cfg, L, exl3, so, t);
    return;
  }
  t->push_back(FamilyNormTensor(s, p + "input_layernorm.weight", H));
  if (s.arch == "glm5_next" && L < s.layers) {  // hyper-connections around both sublayers of every
                                                 // decoder layer (the MTP layer, L == layers, has none)
    AddHyperConnection(s, p + "hc_attn_", t);
    AddHyperConnection(s, p + "hc_ffn_", t);
  }
  if (s.arch == "qwen3_next" && s.layer_types[L] == kLinear) {
    AddGatedDeltaNet(s, p, linear, t);
  } else if (s.arch == "glm5_next" && s.layer_types[L] == kLinear) {
    AddKimiDeltaAttention(s, p, linear, t);
  } else if (s.arch == "qwen3_next") {  // gated full attention: q_proj holds query and gate
    const int hd = s.head_dim, kv = s.kv_heads;
    linear("self_attn.q_proj", 2 * heads * hd, H);
    linear("self_attn.k_proj", kv * hd, H);
    linear("self_attn.v_proj", kv * hd, H);
    linear("self_attn.o_proj", H, heads * hd);
    t->push_back(FamilyNormTensor(s, p + "self_attn.q_norm.weight", hd));
    t->push_back(FamilyNormTensor(s, p + "self_attn.k_norm.weight", hd));
  } else if (IsLatentAttention(s.arch)) {  // MLA
    const int qd = s.qk_nope_head_dim + s.qk_rope_head_dim;
    linear("self_attn.q_a_proj", s.q_lora_rank, H);
    t->push_back(NormTensor(p + "self_attn.q_a_layernorm.weight", s.q_lora_rank));
    linear("self_attn.q_b_proj", heads * qd, s.q_lora_rank);
    linear("self_attn.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, H);
    t->push_back(NormTensor(p + "self_attn.kv_a_layernorm.weight", s.kv_lora_rank));
    linear("self_attn.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank);
    linear("self_attn.o_proj", H, heads * s.v_head_dim);
    if (s.arch == "glm_moe_dsa" || s.arch == "glm5_next") {  // the lightning indexer
      linear("self_attn.indexer.wq_b", s.index_heads * s.index_head_dim, s.q_lora_rank);
      linear("self_attn.indexer.wk", s.index_head_dim, H);
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
  } else {
    const int hd = s.head_dim, kv = s.kv_heads;
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
  t->push_back(FamilyNormTensor(s, p + "post_attention_layernorm.weight", H));
  if (cfg.IsMoeLayer(L)) {
    AddMoeTensors(s, cfg, L, exl3, so, t);
  } else {
    linear("mlp.gate_proj", s.dense_intermediate, H);
    linear("mlp.up_proj", s.dense_intermediate, H);
    linear("mlp.down_proj", H, s.dense_intermediate);
  }
}

// The whole model's tensors, one shard per layer; embeddings with the first, the final norm and
// the head with the last.
std::vector<std::vector<GenTensor>> WholeModelShards(const TestModelSpec& s, const MoeConfig& cfg,
                                                     bool exl3, const SyntheticOptions* so) {
  std::vector<std::vector<GenTensor>> shards(s.layers);
  shards[0].push_back({TextModelPrefix(cfg) + "embed_tokens.weight", DType::kBF16, {s.vocab, s.hidden},
                       GenTensor::kGaussian, 0.02f});
  for (int L = 0; L < s.layers; ++L) AddLayerTensors(s, cfg, L, exl3, so, &shards[L]);
  std::vector<GenTensor>& last = shards.back();
  last.push_back(FamilyNormTensor(s, TextModelPrefix(cfg) + "norm.weight", s.hidden));
  if (s.arch == "deepseek_v4") {  // hc_head collapses the streams before the final norm
    const int64_t hc = s.hc_mult;
    last.push_back({"model.hc_head.hc_fn", DType::kBF16, {hc, hc * s.hidden}, GenTensor::kGaussian, 0.02f});
    last.push_back({"model.hc_head.hc_base", DType::kBF16, {hc}, GenTensor::kGaussian, 0.1f});
    last.push_back({"model.hc_head.hc_scale", DType::kBF16, {1}, GenTensor::kUniform, 0.5f, 0, 1.5f});
  }
  AddLinear(s.arch == "deepseek_v4" ? "head" : "lm_head", s.vocab, s.hidden, LinearRole::kHead, exl3,
            so, &last);
  if (s.mtp) {  // the MTP layer: a MoE decoder layer at index s.layers plus its own tensors
    MoeConfig with_mtp = cfg;
    with_mtp.num_hidden_layers = s.layers + 1;
    with_mtp.moe_layers.resize(s.layers + 1, false);
    with_mtp.moe_layers[s.layers] = true;
    with_mtp.hash_routed_layers.resize(s.layers + 1, false);
    std::vector<GenTensor>& mtp = shards.emplace_back();
    TestModelSpec mtp_spec = s;  // GLM-5.3-Flash's MTP layer: MLA with its own k-pooled indexer
    if (s.arch == "glm5_next") mtp_spec.layer_types.push_back(kIndexed);
    AddLayerTensors(mtp_spec, with_mtp, s.layers, exl3, so, &mtp);
    const std::string p = LayerPrefix(cfg, s.layers);
    for (const char* norm : {"enorm.weight", "hnorm.weight", "shared_head.norm.weight"})
      mtp.push_back(FamilyNormTensor(s, p + norm, s.hidden));
    AddLinear(p + "eh_proj", s.hidden, 2 * s.hidden, LinearRole::kAttentionOrDense, exl3, so, &mtp);
  }
  return shards;
}

// The synthetic model's shards: the whole model, or one shard per MoE layer.
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

uint64_t ShardsBytes(const std::vector<std::vector<GenTensor>>& shards) {
  uint64_t total = 0;
  for (const auto& sh : shards)
    for (const auto& t : sh) total += static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
  return total;
}

// GLM-5.3-Flash's config.json as transformers 5.25 writes it (Glm5NextConfig): the text model's
// fields (Glm5NextTextConfig's names) nested in text_config; no vision_config (the engine reads
// none; transformers fills its defaults).
json Glm5NextConfigJson(const TestModelSpec& s) {
  std::vector<std::string> mlp_types(s.layers, "sparse");
  for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_types[l] = "dense";
  const json text = {
      {"model_type", "glm5_next_text"}, {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
      {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
      {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
      {"n_shared_experts", s.shared}, {"n_routed_experts", s.experts},
      {"routed_scaling_factor", s.routed_scaling_factor}, {"kv_lora_rank", s.kv_lora_rank},
      {"q_lora_rank", s.q_lora_rank}, {"qk_rope_head_dim", 0}, {"v_head_dim", s.v_head_dim},
      {"qk_nope_head_dim", s.qk_nope_head_dim}, {"qk_head_dim", s.qk_nope_head_dim}, {"head_dim", 0},
      {"n_group", s.n_group}, {"topk_group", s.topk_group}, {"num_experts_per_tok", s.top_k},
      {"norm_topk_prob", true}, {"hidden_act", "silu"}, {"max_position_embeddings", s.max_position},
      {"initializer_range", 0.02}, {"rms_norm_eps", 1e-5}, {"use_cache", true}, {"pad_token_id", 0},
      {"bos_token_id", 0}, {"eos_token_id", 1}, {"tie_word_embeddings", false}, {"mlp_layer_types", mlp_types},
      {"attention_bias", false}, {"attention_dropout", 0.0}, {"index_topk", s.index_topk},
      {"index_head_dim", s.index_head_dim}, {"index_n_heads", s.index_heads}, {"index_kpool", s.index_kpool},
      {"index_kpool_always_select_tail", true}, {"layer_types", s.layer_types},
      {"indexer_types", std::vector<std::string>(s.layers, "full")},
      {"swiglu_limit", s.swiglu_limit > 0 ? s.swiglu_limit : 10.0f}, {"linear_head_dim", s.linear_head_dim},
      {"linear_num_heads", s.linear_heads}, {"linear_conv_kernel_dim", s.linear_conv_kernel},
      {"linear_lower_bound", -5.0}, {"hc_mult", s.hc_mult}, {"hc_eps", 1e-6},
      {"hc_sinkhorn_iters", s.hc_sinkhorn_iters}, {"router_aux_loss_coef", 0.001},
      {"output_router_logits", false}, {"num_nextn_predict_layers", s.mtp ? 1 : 0}, {"dtype", "bfloat16"}};
  return {{"architectures", {"Glm5NextForConditionalGeneration"}}, {"model_type", "glm5_next"},
          {"text_config", text}, {"tie_word_embeddings", false}, {"dtype", "bfloat16"},
          {"transformers_version", "5.25.0"}};
}

absl::StatusOr<MoeConfig> ParsedConfig(const TestModelSpec& s) {
  return ParseMoeConfig(TestModelConfig(s).dump(), "generated config.json");
}

// DeepSeek-V4's and Qwen3-Next's per-layer layer_types: the family default when none are
// given, else checked.
absl::Status ResolveLayerTypes(TestModelSpec& s) {
  if (s.arch != "deepseek_v4" && s.arch != "qwen3_next" && s.arch != "glm5_next") {
    if (!s.layer_types.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("--layer-types applies to deepseek_v4, qwen3_next and glm5_next, not ", s.arch));
    return absl::OkStatus();
  }
  const bool v4 = s.arch == "deepseek_v4";
  // Qwen3-Next's full attention, GLM-5.3-Flash's indexed attention.
  const char* attention = s.arch == "glm5_next" ? kIndexed : kFull;
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

// What Glm5NextTextConfig and the engine (engine/glm5next_config.h) require of the shape.
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

}  // namespace

absl::StatusOr<TestModelSpec> ResolveTestModelSpec(const TestModelSpec& in) {
  TestModelSpec s = in;
  if (s.arch != "glm4_moe" && s.arch != "deepseek_v3" && s.arch != "qwen3_moe" &&
      s.arch != "mixtral" && s.arch != "glm_moe_dsa" && s.arch != "deepseek_v4" &&
      s.arch != "qwen3_next" && s.arch != "glm5_next") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown --arch '", s.arch,
        "' (glm4_moe, deepseek_v3, qwen3_moe, mixtral, glm_moe_dsa, deepseek_v4, qwen3_next or glm5_next)"));
  }
  if (s.mtp && s.arch != "glm4_moe" && s.arch != "deepseek_v3" && s.arch != "glm_moe_dsa" && s.arch != "glm5_next")
    return absl::InvalidArgumentError(absl::StrCat(
        "--mtp: the DeepSeek-V3 MTP layer belongs to glm4_moe, deepseek_v3, glm_moe_dsa and glm5_next, not ",
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
  const bool v4 = s.arch == "deepseek_v4", next = s.arch == "qwen3_next";
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
  if (next) EXL3_RETURN_IF_ERROR(CheckQwen3NextShape(s));
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

json TestModelConfig(const TestModelSpec& s) {
  json j;
  const int heads = s.heads;
  if (s.arch == "glm4_moe") {
    j = {{"architectures", {"Glm4MoeForCausalLM"}}, {"model_type", "glm4_moe"},
         {"attention_bias", true}, {"attention_dropout", 0.0}, {"head_dim", s.head_dim},
         {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
         {"intermediate_size", s.dense_intermediate}, {"max_position_embeddings", s.max_position},
         {"moe_intermediate_size", s.intermediate}, {"norm_topk_prob", true},
         {"num_attention_heads", heads}, {"num_key_value_heads", s.kv_heads}, {"n_group", s.n_group},
         {"topk_group", s.topk_group}, {"n_routed_experts", s.experts},
         {"n_shared_experts", s.shared}, {"routed_scaling_factor", s.routed_scaling_factor},
         {"num_experts_per_tok", s.top_k}, {"first_k_dense_replace", s.dense_layers},
         {"num_hidden_layers", s.layers}, {"num_nextn_predict_layers", s.mtp ? 1 : 0},
         {"partial_rotary_factor", 0.5}, {"rms_norm_eps", 1e-5}, {"rope_theta", 1000000.0},
         {"rope_scaling", nullptr}, {"tie_word_embeddings", false}, {"use_qk_norm", false},
         {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
  } else if (s.arch == "deepseek_v3") {
    j = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
         {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
         {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
         {"n_routed_experts", s.experts}, {"n_shared_experts", s.shared},
         {"num_experts_per_tok", s.top_k}, {"n_group", s.n_group}, {"topk_group", s.topk_group},
         {"routed_scaling_factor", s.routed_scaling_factor}, {"scoring_func", "sigmoid"},
         {"topk_method", "noaux_tc"}, {"norm_topk_prob", true},
         {"first_k_dense_replace", s.dense_layers}, {"moe_layer_freq", 1},
         {"num_hidden_layers", s.layers}, {"num_attention_heads", heads},
         {"num_key_value_heads", s.kv_heads}, {"q_lora_rank", s.q_lora_rank},
         {"kv_lora_rank", s.kv_lora_rank}, {"qk_nope_head_dim", s.qk_nope_head_dim},
         {"qk_rope_head_dim", s.qk_rope_head_dim}, {"v_head_dim", s.v_head_dim},
         {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
         {"num_nextn_predict_layers", s.mtp ? 1 : 0}, {"ep_size", 1}, {"tie_word_embeddings", false},
         {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
  } else if (s.arch == "glm_moe_dsa") {
    std::vector<std::string> mlp_types(s.layers, "sparse");
    for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_types[l] = "dense";
    j = {{"architectures", {"GlmMoeDsaForCausalLM"}}, {"model_type", "glm_moe_dsa"},
         {"attention_bias", false}, {"hidden_act", "silu"}, {"hidden_size", s.hidden},
         {"initializer_range", 0.02}, {"intermediate_size", s.dense_intermediate},
         {"moe_intermediate_size", s.intermediate}, {"n_routed_experts", s.experts},
         {"n_shared_experts", s.shared}, {"num_experts_per_tok", s.top_k},
         {"n_group", s.n_group}, {"topk_group", s.topk_group},
         {"routed_scaling_factor", s.routed_scaling_factor}, {"norm_topk_prob", true},
         {"first_k_dense_replace", s.dense_layers}, {"mlp_layer_types", mlp_types},
         {"num_hidden_layers", s.layers}, {"num_attention_heads", heads},
         {"num_key_value_heads", s.kv_heads}, {"q_lora_rank", s.q_lora_rank},
         {"kv_lora_rank", s.kv_lora_rank}, {"qk_nope_head_dim", s.qk_nope_head_dim},
         {"qk_rope_head_dim", s.qk_rope_head_dim}, {"v_head_dim", s.v_head_dim},
         {"head_dim", s.qk_rope_head_dim}, {"index_n_heads", s.index_heads},
         {"index_head_dim", s.index_head_dim}, {"index_topk", s.index_topk},
         {"indexer_types", std::vector<std::string>(s.layers, "full")},
         {"num_nextn_predict_layers", s.mtp ? 1 : 0},
         {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-5},
         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
         {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
  } else if (s.arch == "deepseek_v4") {
    // DeepseekV4Config's names (transformers 5.24); the rope part is the last qk_rope_head_dim
    // dimensions of each head (partial_rotary_factor), "main" on sliding layers, "compress" on
    // the compressed ones.
    std::vector<std::string> mlp_types(s.layers, "moe");
    for (int l = 0; l < s.hash_layers && l < s.layers; ++l) mlp_types[l] = "hash_moe";
    const double partial = static_cast<double>(s.qk_rope_head_dim) / s.head_dim;
    j = {{"architectures", {"DeepseekV4ForCausalLM"}}, {"model_type", "deepseek_v4"},
         {"vocab_size", s.vocab}, {"hidden_size", s.hidden}, {"moe_intermediate_size", s.intermediate},
         {"num_hidden_layers", s.layers}, {"num_attention_heads", heads}, {"num_key_value_heads", 1},
         {"head_dim", s.head_dim}, {"q_lora_rank", s.q_lora_rank}, {"num_experts_per_tok", s.top_k},
         {"n_routed_experts", s.experts}, {"n_shared_experts", 1}, {"scoring_func", "sqrtsoftplus"},
         {"norm_topk_prob", true}, {"routed_scaling_factor", s.routed_scaling_factor},
         {"max_position_embeddings", s.max_position}, {"rope_theta", 10000.0},
         {"layer_types", s.layer_types},
         {"compress_rates", {{kCsa, s.csa_compress_rate}, {kHca, s.hca_compress_rate}}},
         {"compress_rope_theta", 160000.0}, {"hc_mult", s.hc_mult},
         {"hc_sinkhorn_iters", s.hc_sinkhorn_iters}, {"hc_eps", 1e-6}, {"mlp_layer_types", mlp_types},
         {"swiglu_limit", s.swiglu_limit > 0 ? s.swiglu_limit : 10.0f},
         {"sliding_window", s.sliding_window}, {"o_groups", s.o_groups}, {"o_lora_rank", s.o_lora_rank},
         {"index_n_heads", s.index_heads}, {"index_head_dim", s.index_head_dim},
         {"index_topk", s.index_topk}, {"num_nextn_predict_layers", 0}, {"hidden_act", "silu"},
         {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6}, {"bos_token_id", 0}, {"eos_token_id", 1},
         {"tie_word_embeddings", false},
         {"rope_parameters",
          {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", partial}}},
           {"compress",
            {{"rope_type", "default"}, {"rope_theta", 160000.0}, {"partial_rotary_factor", partial}}}}},
         {"partial_rotary_factor", partial}, {"qk_rope_head_dim", s.qk_rope_head_dim},
         {"attention_bias", false}, {"mlp_bias", false}, {"attention_dropout", 0.0},
         {"torch_dtype", "bfloat16"}};
  } else if (s.arch == "qwen3_next") {
    // Qwen3NextConfig's names (transformers 5.24); --dense-layers become mlp_only_layers.
    std::vector<int> mlp_only;
    for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_only.push_back(l);
    j = {{"architectures", {"Qwen3NextForCausalLM"}}, {"model_type", "qwen3_next"},
         {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
         {"intermediate_size", s.dense_intermediate}, {"num_hidden_layers", s.layers},
         {"num_attention_heads", heads}, {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
         {"hidden_act", "silu"}, {"max_position_embeddings", s.max_position},
         {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}}},
         {"attention_bias", false}, {"attention_dropout", 0.0},
         {"linear_conv_kernel_dim", s.linear_conv_kernel}, {"linear_key_head_dim", s.linear_key_head_dim},
         {"linear_value_head_dim", s.linear_value_head_dim}, {"linear_num_key_heads", s.linear_key_heads},
         {"linear_num_value_heads", s.linear_value_heads}, {"decoder_sparse_step", 1},
         {"moe_intermediate_size", s.intermediate},
         {"shared_expert_intermediate_size", s.shared > 0 ? s.intermediate : 0},
         {"num_experts_per_tok", s.top_k}, {"num_experts", s.experts}, {"norm_topk_prob", true},
         {"router_aux_loss_coef", 0.001}, {"output_router_logits", false}, {"mlp_only_layers", mlp_only},
         {"layer_types", s.layer_types}, {"bos_token_id", 0}, {"eos_token_id", 1},
         {"torch_dtype", "bfloat16"}};
  } else if (s.arch == "glm5_next") {
    return Glm5NextConfigJson(s);
  } else if (s.arch == "qwen3_moe") {
    j = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
         {"attention_bias", false}, {"head_dim", s.head_dim}, {"hidden_act", "silu"},
         {"hidden_size", s.hidden}, {"initializer_range", 0.02},
         {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
         {"num_experts", s.experts}, {"num_experts_per_tok", s.top_k}, {"norm_topk_prob", true},
         {"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()},
         {"num_hidden_layers", s.layers}, {"num_attention_heads", heads},
         {"num_key_value_heads", s.kv_heads}, {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-6},
         {"rope_theta", 1000000.0}, {"router_aux_loss_coef", 0.001},
         {"output_router_logits", false}, {"tie_word_embeddings", false},
         {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
  } else {  // mixtral
    j = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
         {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
         {"intermediate_size", s.intermediate}, {"num_local_experts", s.experts},
         {"num_experts_per_tok", s.top_k}, {"num_hidden_layers", s.layers},
         {"num_attention_heads", heads}, {"num_key_value_heads", s.kv_heads},
         {"head_dim", s.head_dim}, {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-5},
         {"rope_theta", 1000000.0}, {"router_aux_loss_coef", 0.02}, {"sliding_window", nullptr},
         {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
  }
  if (s.swiglu_limit > 0) j["swiglu_limit"] = s.swiglu_limit;
  return j;
}

absl::Status WriteHfTestModel(const TestModelSpec& spec, const std::string& dir_str,
                              bool progress) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return rs.status();
  const TestModelSpec& s = *rs;
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(s);
  if (!cfg.ok()) return cfg.status();
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_str, ": ", ec.message()));

  const std::vector<std::vector<GenTensor>> shards =
      WholeModelShards(s, *cfg, /*exl3=*/false, /*so=*/nullptr);
  const uint64_t total = ShardsBytes(shards);
  ProgressBar bar("exl3-tool make-test-model (hf)", total, progress);
  json weight_map = json::object();
  const int num_shards = static_cast<int>(shards.size());  // a layer each (and the MTP layer)
  for (int i = 0; i < num_shards; ++i) {
    absl::Status st = WriteShard(dir / ShardName(i, num_shards), shards[i], s.seed, DefaultThreads(), &bar,
                                 &weight_map);
    if (!st.ok()) return st;
  }
  bar.Finish();
  absl::Status st = WriteIndex(dir, weight_map);
  if (!st.ok()) return st;
  json gen = {{"_from_model_config", true}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  st = WriteText(dir / "generation_config.json", gen.dump(2) + "\n");
  if (!st.ok()) return st;
  return WriteText(dir / "config.json", TestModelConfig(s).dump(2) + "\n");
}

uint64_t SyntheticModelBytes(const TestModelSpec& spec, const SyntheticOptions& opts) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return 0;
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(*rs);
  if (!cfg.ok()) return 0;
  return ShardsBytes(SyntheticShards(*rs, *cfg, opts));
}

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir_str) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return rs.status();
  const TestModelSpec& s = *rs;
  for (int k : {opts.bits, opts.down_bits, opts.attention_bits, opts.head_bits}) {
    if (k != 0 && (k < 1 || k > 8)) return absl::InvalidArgumentError("bit widths must be in 1..8");
  }
  for (int k : opts.expert_bits_cycle) {
    if (k < 1 || k > 8) return absl::InvalidArgumentError("per-expert bit widths must be in 1..8");
  }
  if (opts.bits < 1) return absl::InvalidArgumentError("--bits must be in 1..8");
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(s);
  if (!cfg.ok()) return cfg.status();
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_str, ": ", ec.message()));

  const std::vector<std::vector<GenTensor>> shards = SyntheticShards(s, *cfg, opts);
  ProgressBar bar("exl3-tool make-test-model (synthetic)", ShardsBytes(shards), opts.progress);
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    bar.SetDetail(absl::StrCat("shard ", i + 1, " of ", shards.size()));
    absl::Status st = WriteShard(dir / ShardName(static_cast<int>(i), static_cast<int>(shards.size())),
                                 shards[i], s.seed, opts.threads > 0 ? opts.threads : DefaultThreads(), &bar,
                                 &weight_map, opts.data_start);
    if (!st.ok()) return st;
  }
  bar.Finish();
  absl::Status st = WriteIndex(dir, weight_map);
  if (!st.ok()) return st;
  json c = TestModelConfig(s);
  const int db = opts.down_bits > 0 ? opts.down_bits : opts.bits;
  const double avg = (2.0 * opts.bits + db) / 3.0;
  c["quantization_config"] = {{"quant_method", "exl3"},
                              {"version", "0.0.6"},
                              {"bits", avg},
                              {"codebook", std::string(CodebookName(opts.codebook))},
                              {"expert_bits", opts.bits},
                              {"synthetic", "random trellis bits, not a quantized model"}};
  if (opts.whole_model) {
    json gen = {{"_from_model_config", true}, {"bos_token_id", 0}, {"eos_token_id", 1}};
    absl::Status gs = WriteText(dir / "generation_config.json", gen.dump(2) + "\n");
    if (!gs.ok()) return gs;
  }
  if (opts.down_bits > 0) c["quantization_config"]["down_bits"] = opts.down_bits;
  if (opts.whole_model) {
    c["quantization_config"]["attention_bits"] = BitsOf(opts, LinearRole::kAttentionOrDense);
    c["quantization_config"]["head_bits"] = BitsOf(opts, LinearRole::kHead);
  }
  return WriteText(dir / "config.json", c.dump(2) + "\n");
}

}  // namespace exl3

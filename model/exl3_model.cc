#include "model/exl3_model.h"

#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/config/config_file.h"
#include "model/config/read_moe_config.h"
#include "model/weight_digest.h"

namespace exl3 {
namespace {

// 64-bit FNV-1a; two differently seeded streams give a 128-bit digest (identity, not security).
struct Fnv {
  uint64_t h;
  void Add(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 0x100000001b3ull;
    }
  }
  void Add(const std::string& s) {
    Add(s.data(), s.size());
    const uint8_t sep = 0;
    Add(&sep, 1);
  }
};

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// An fp32 copy of a float tensor of exactly `shape`.
absl::StatusOr<std::vector<float>> LoadFloat(const TensorSource& src, const std::string& name,
                                             const std::vector<int64_t>& shape) {
  if (!src.Has(name)) return absl::NotFoundError(absl::StrCat("tensor '", name, "' is missing"));
  absl::StatusOr<TensorView> t = src.Get(name);
  if (!t.ok()) return t.status();
  if (t->info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ",
                                                   ShapeStr(t->info->shape), ", expected ",
                                                   ShapeStr(shape)));
  }
  absl::StatusOr<std::vector<float>> f = ToFloat32(*t);
  if (!f.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", f.status().message()));
  }
  return f;
}

absl::Status CheckModelDirectory(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat("model directory ", dir, " does not exist"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Exl3Model>> Exl3Model::Open(const std::string& dir,
                                                           const Exl3ModelOptions& options) {
  EXL3_RETURN_IF_ERROR(CheckModelDirectory(dir));
  EXL3_ASSIGN_OR_RETURN(const ConfigFile config, ConfigFile::Read(dir));
  return Open(dir, config, options);
}

absl::StatusOr<std::unique_ptr<Exl3Model>> Exl3Model::Open(const std::string& dir, const ConfigFile& config,
                                                           const Exl3ModelOptions& options) {
  EXL3_RETURN_IF_ERROR(CheckModelDirectory(dir));
  std::unique_ptr<Exl3Model> m(new Exl3Model());
  m->dir_ = dir;
  EXL3_ASSIGN_OR_RETURN(m->config_, ReadMoeConfig(config));
  if (options.require_exl3) {
    absl::Status s = RequireExl3(m->config_);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(config.source(), ": ", s.message()));
  }
  absl::StatusOr<std::unique_ptr<TensorSource>> src = TensorSource::Open(dir, options.residency);
  if (!src.ok()) return src.status();
  m->src_ = std::move(*src);
  // exllamav3's record of every module's tensors (model/exl3_storage.h): the files must match it.
  EXL3_ASSIGN_OR_RETURN(m->storage_, ReadExl3Storage(dir));
  if (m->storage_) EXL3_RETURN_IF_ERROR(CheckExl3Storage(*m->storage_, *m->src_));

  // Fingerprint: config bytes, then every tensor's name, dtype and shape in name order, with the
  // content digest recorded for it when the directory has them (model/weight_digest.h).
  const std::vector<std::string> names = m->src_->Names();
  EXL3_ASSIGN_OR_RETURN(std::optional<WeightDigests> digests, ReadWeightDigests(dir, names));
  Fnv a{0xcbf29ce484222325ull}, b{0x84222325cbf29ce4ull};
  a.Add(config.bytes());
  b.Add(config.bytes());
  for (const std::string& name : names) {
    absl::StatusOr<const TensorInfo*> info = m->src_->Info(name);
    if (!info.ok()) return info.status();
    std::string line = absl::StrCat(name, " ", std::string(DTypeName((*info)->dtype)), " ",
                                    ShapeStr((*info)->shape));
    if (digests) absl::StrAppend(&line, " ", digests->find(name)->second);
    a.Add(line);
    b.Add(line);
  }
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(a.h),
                static_cast<unsigned long long>(b.h));
  m->fingerprint_ = hex;
  m->fingerprint_covers_weights_ = digests.has_value();
  // Every tensor this process reads from now on is checked against its recorded digest.
  if (digests) m->src_->VerifyWith(std::move(*digests));

  const MoeConfig& c = m->config_;
  std::map<int, std::vector<int>> want;
  if (options.experts.has_value()) {
    for (const auto& [layer, ids] : *options.experts) {
      if (!c.IsMoeLayer(layer)) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer of ",
                                                       dir, " (", c.num_hidden_layers,
                                                       " layers)"));
      }
      for (int e : ids) {
        if (e < 0 || e >= c.num_experts) {
          return absl::InvalidArgumentError(absl::StrCat("expert ", e, " of layer ", layer,
                                                         " is out of range: the model has ",
                                                         c.num_experts, " routed experts"));
        }
      }
      want[layer] = ids;
    }
  } else {
    for (int layer : c.MoeLayers()) {
      std::vector<int>& ids = want[layer];
      for (int e = 0; e < c.num_experts; ++e) ids.push_back(e);
    }
  }
  // Every MoE layer gets an entry (router, shared expert) even when it holds no routed expert.
  for (int layer : c.MoeLayers()) {
    auto it = want.find(layer);
    absl::Status s = m->LoadLayer(layer, it == want.end() ? std::vector<int>{} : it->second, options);
    if (!s.ok()) return s;
  }
  return m;
}

std::string Exl3Model::UncoveredWeightsWarning() const {
  return absl::StrCat("model ", dir_, " records no weight digests (", kWeightDigestFile,
                      "): its fingerprint does not tell other weights with the same config apart; "
                      "run `exl3-tool digest --model ", dir_, "`");
}

absl::StatusOr<std::unique_ptr<Exl3Model::HeldExpert>> Exl3Model::LoadMlp(const std::string& gate,
                                                                          const std::string& up,
                                                                          const std::string& down,
                                                                          int inter) {
  auto h = std::make_unique<HeldExpert>();
  const int H = config_.hidden_size;
  const std::string* names[3] = {&gate, &up, &down};
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::unique_ptr<Exl3Linear>> lin =
        LoadExl3Linear(*src_, *names[i], i < 2 ? H : inter, i < 2 ? inter : H);
    if (!lin.ok()) return lin.status();
    h->bytes += (*lin)->bytes;
    h->lin[i] = std::move(*lin);
  }
  h->mlp.gate = h->lin[0]->view;
  h->mlp.up = h->lin[1]->view;
  h->mlp.down = h->lin[2]->view;
  return h;
}

absl::Status Exl3Model::LoadLayer(int layer, const std::vector<int>& experts,
                                  const Exl3ModelOptions& opt) {
  const MoeConfig& c = config_;
  Layer& L = layers_[layer];
  for (int e : experts) {
    if (L.experts.count(e)) continue;
    absl::StatusOr<std::unique_ptr<HeldExpert>> h =
        LoadMlp(RoutedExpertPrefix(c, layer, e, Projection::kGate),
                RoutedExpertPrefix(c, layer, e, Projection::kUp),
                RoutedExpertPrefix(c, layer, e, Projection::kDown), c.moe_intermediate_size);
    if (!h.ok()) return h.status();
    L.experts[e] = std::move(*h);
  }
  if (opt.load_shared_experts && c.has_shared_expert()) {
    absl::StatusOr<std::unique_ptr<HeldExpert>> h =
        LoadMlp(SharedExpertPrefix(c, layer, Projection::kGate),
                SharedExpertPrefix(c, layer, Projection::kUp),
                SharedExpertPrefix(c, layer, Projection::kDown), c.shared_intermediate_size);
    if (!h.ok()) return h.status();
    L.shared = std::move(*h);
    // Qwen3-Next scales its shared expert by sigmoid(x · shared_expert_gate): part of the expert.
    const std::string gate_key = SharedExpertGateKey(c, layer);
    if (!gate_key.empty()) {
      absl::StatusOr<std::vector<float>> g = LoadFloat(*src_, gate_key, {1, c.hidden_size});
      if (!g.ok()) return g.status();
      L.shared_gate = std::move(*g);
    }
  }
  if (opt.load_routers) {
    absl::StatusOr<std::vector<float>> w =
        LoadFloat(*src_, RouterWeightKey(c, layer), {c.num_experts, c.hidden_size});
    if (!w.ok()) return w.status();
    L.router = std::move(*w);
    const std::string bias_key = CorrectionBiasKey(c, layer);
    if (!bias_key.empty()) {
      absl::StatusOr<std::vector<float>> b = LoadFloat(*src_, bias_key, {c.num_experts});
      if (!b.ok()) return b.status();
      L.bias = std::move(*b);
    }
    const std::string hash_key = HashTableKey(c, layer);
    if (!hash_key.empty() && src_->Has(hash_key)) {
      absl::StatusOr<TensorView> t = src_->Get(hash_key);
      if (!t.ok()) return t.status();
      const TensorInfo& info = *t->info;
      if (info.shape.size() != 2 || info.shape[1] != c.top_k ||
          (info.dtype != DType::kI32 && info.dtype != DType::kI64)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", hash_key, "' has shape ",
                                                       ShapeStr(info.shape), " and dtype ",
                                                       std::string(DTypeName(info.dtype)),
                                                       ", expected [vocab, ", c.top_k,
                                                       "] I32 or I64"));
      }
      L.hash_vocab = info.shape[0];
      L.hash_table.resize(static_cast<size_t>(info.num_elements()));
      for (size_t i = 0; i < L.hash_table.size(); ++i) {
        L.hash_table[i] = info.dtype == DType::kI32
                              ? t->as<int32_t>()[i]
                              : static_cast<int32_t>(t->as<int64_t>()[i]);
      }
    }
  }
  return absl::OkStatus();
}

const Exl3Model::Layer* Exl3Model::FindLayer(int layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? nullptr : &it->second;
}

const ExpertMlp* Exl3Model::Expert(int layer, int expert) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr) return nullptr;
  auto it = L->experts.find(expert);
  return it == L->experts.end() ? nullptr : &it->second->mlp;
}

std::vector<int> Exl3Model::HeldExperts(int layer) const {
  std::vector<int> out;
  if (const Layer* L = FindLayer(layer)) {
    for (const auto& [e, h] : L->experts) out.push_back(e);
  }
  return out;
}

const ExpertMlp* Exl3Model::SharedExpert(int layer) const {
  const Layer* L = FindLayer(layer);
  return L != nullptr && L->shared ? &L->shared->mlp : nullptr;
}

const Exl3Linear* Exl3Model::Linear(int layer, int expert, Projection p) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr) return nullptr;
  const HeldExpert* h = nullptr;
  if (expert < 0) {
    h = L->shared.get();
  } else {
    auto it = L->experts.find(expert);
    if (it != L->experts.end()) h = it->second.get();
  }
  return h == nullptr ? nullptr : h->lin[static_cast<int>(p)].get();
}

absl::StatusOr<MoeLayerView> Exl3Model::LayerView(int layer) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer of this ",
                                                   config_.architecture, " model"));
  }
  MoeLayerView v;
  v.hidden_size = config_.hidden_size;
  v.intermediate_size = config_.moe_intermediate_size;
  v.swiglu_limit = config_.swiglu_limit;
  v.shared_swiglu_limit = config_.shared_swiglu_limit;
  v.experts.assign(config_.num_experts, nullptr);
  for (const auto& [e, h] : L->experts) v.experts[e] = &h->mlp;
  if (L->shared) {
    v.shared = &L->shared->mlp;
    v.shared_intermediate_size = config_.shared_intermediate_size;
    if (!L->shared_gate.empty()) v.shared_gate = L->shared_gate.data();
  }
  return v;
}

const float* Exl3Model::RouterWeight(int layer) const {
  const Layer* L = FindLayer(layer);
  return L != nullptr && !L->router.empty() ? L->router.data() : nullptr;
}

const float* Exl3Model::CorrectionBias(int layer) const {
  const Layer* L = FindLayer(layer);
  return L != nullptr && !L->bias.empty() ? L->bias.data() : nullptr;
}

const float* Exl3Model::SharedExpertGate(int layer) const {
  const Layer* L = FindLayer(layer);
  return L != nullptr && !L->shared_gate.empty() ? L->shared_gate.data() : nullptr;
}

const int32_t* Exl3Model::HashTable(int layer, int64_t* vocab) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr || L->hash_table.empty()) return nullptr;
  if (vocab != nullptr) *vocab = L->hash_vocab;
  return L->hash_table.data();
}

uint64_t Exl3Model::ExpertBytes(int layer, int expert) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr) return 0;
  auto it = L->experts.find(expert);
  return it == L->experts.end() ? 0 : it->second->bytes;
}

uint64_t Exl3Model::SharedExpertBytes(int layer) const {
  const Layer* L = FindLayer(layer);
  return L != nullptr && L->shared ? L->shared->bytes : 0;
}

uint64_t Exl3Model::LayerBytes(int layer) const {
  const Layer* L = FindLayer(layer);
  if (L == nullptr) return 0;
  uint64_t total = L->shared ? L->shared->bytes : 0;
  for (const auto& [e, h] : L->experts) total += h->bytes;
  return total;
}

uint64_t Exl3Model::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& [layer, L] : layers_) total += LayerBytes(layer);
  return total;
}

}  // namespace exl3

// An EXL3 MoE model directory: config.json + safetensors shards, opened on mmap, with all or a
// share of the routed experts validated and ready for the kernels.
//
// Usage:
//   Exl3ModelOptions opt;
//   opt.experts = {{3, {0, 1, 2}}, {4, {0, 1, 2}}};   // or leave unset: every expert of every layer
//   absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open("/models/glm-exl3", opt);
//   // or, where the process has read config.json already (model/config/config_file.h):
//   m = Exl3Model::Open("/models/glm-exl3", config_file, opt);
//   absl::StatusOr<MoeLayerView> layer = (*m)->LayerView(3);
//   MoeForwardReference(*layer, x, assignments, /*include_shared=*/true, y);
//   (*m)->fingerprint();   // for Describe: config + tensor names/shapes/dtypes (+ content digests)
//
// Every held expert's gate/up/down and the shared expert are checked against the config
// (hidden_size x moe_intermediate_size, down transposed); a missing tensor or a wrong shape gives an
// error naming the tensor. Router weights and correction biases are kept as fp32 copies. A
// directory exllamav3 wrote is checked against its quantization_config.json
// (model/exl3_storage.h); DeepSeek-V4 in its release names is read under the project's names
// (model/checkpoint_naming.h).
// The views point into the mapped files (and small owned buffers), valid while the model lives.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/moe_cpu.h"
#include "model/exl3_linear_loader.h"
#include "model/exl3_storage.h"
#include "model/moe_config.h"
#include "model/safetensors.h"

namespace exl3 {

class ConfigFile;  // model/config/config_file.h

struct Exl3ModelOptions {
  // Routed experts to hold, by layer. Unset: every expert of every MoE layer. Set: exactly these
  // (layers absent from the map hold none); a non-MoE layer or an expert id out of range is an error.
  std::optional<std::map<int, std::vector<int>>> experts;
  bool load_shared_experts = true;
  bool load_routers = true;   // router weight, correction bias, hash table (fp32/int32)
  bool require_exl3 = true;   // quantization_config.quant_method must be "exl3"
  // kOwned: every tensor read is moved into owned memory (model/safetensors.h TensorResidency).
  TensorResidency residency = TensorResidency::kMapped;
};

class Exl3Model {
 public:
  // Reads DIR/config.json (ConfigFile::Read) and opens the model.
  static absl::StatusOr<std::unique_ptr<Exl3Model>> Open(const std::string& dir,
                                                         const Exl3ModelOptions& options = {});
  // `config`: DIR's config.json as the caller read it (ConfigFile::Read(dir)); the file is not read
  // again and the fingerprint covers config.bytes().
  static absl::StatusOr<std::unique_ptr<Exl3Model>> Open(const std::string& dir, const ConfigFile& config,
                                                         const Exl3ModelOptions& options = {});

  const std::string& dir() const { return dir_; }
  const MoeConfig& config() const { return config_; }
  const TensorSource& tensors() const { return *src_; }
  // exllamav3's quantization_config.json, checked against the files; nullopt when absent.
  const std::optional<Exl3Storage>& storage() const { return storage_; }
  // Hex digest over config.json's bytes and every tensor's name, dtype and shape, and its content
  // digest when the directory records them (weights.digest.json, model/weight_digest.h; each
  // tensor read is then checked against its digest).
  const std::string& fingerprint() const { return fingerprint_; }
  // The directory records content digests: the fingerprint tells other weights apart.
  bool fingerprint_covers_weights() const { return fingerprint_covers_weights_; }
  // What to log when it does not: the problem and the command that records the digests.
  std::string UncoveredWeightsWarning() const;

  bool HoldsExpert(int layer, int expert) const { return Expert(layer, expert) != nullptr; }
  const ExpertMlp* Expert(int layer, int expert) const;  // null when not held
  std::vector<int> HeldExperts(int layer) const;         // ascending
  const ExpertMlp* SharedExpert(int layer) const;        // null when none or not loaded
  // The three Exl3Linear of a held expert (gate, up, down) or of the shared expert (expert = -1);
  // null when not held.
  const Exl3Linear* Linear(int layer, int expert, Projection p) const;

  // The kernels' view of a MoE layer (held experts, shared expert, clamp). Error: not a MoE layer.
  absl::StatusOr<MoeLayerView> LayerView(int layer) const;

  // fp32 router weight [num_experts, hidden]; null when not loaded.
  const float* RouterWeight(int layer) const;
  // fp32 correction bias [num_experts]; null when the family/layer has none.
  const float* CorrectionBias(int layer) const;
  // Qwen3-Next shared expert gate [hidden] fp32; null otherwise.
  const float* SharedExpertGate(int layer) const;
  // DeepSeek-V4 hash-routed layer's tid2eid [vocab, top_k] int32; null otherwise. vocab in *vocab.
  const int32_t* HashTable(int layer, int64_t* vocab) const;

  // On-disk bytes of the EXL3 tensors held.
  uint64_t ExpertBytes(int layer, int expert) const;  // 0 when not held
  uint64_t SharedExpertBytes(int layer) const;
  uint64_t LayerBytes(int layer) const;  // held experts + shared
  uint64_t TotalBytes() const;           // all held experts + shared experts

 private:
  Exl3Model() = default;
  struct HeldExpert {
    std::unique_ptr<Exl3Linear> lin[3];
    ExpertMlp mlp;
    uint64_t bytes = 0;
  };
  struct Layer {
    std::map<int, std::unique_ptr<HeldExpert>> experts;
    std::unique_ptr<HeldExpert> shared;
    std::vector<float> router, bias, shared_gate;
    std::vector<int32_t> hash_table;
    int64_t hash_vocab = 0;
  };
  absl::Status LoadLayer(int layer, const std::vector<int>& experts, const Exl3ModelOptions& opt);
  absl::StatusOr<std::unique_ptr<HeldExpert>> LoadMlp(const std::string& gate,
                                                      const std::string& up,
                                                      const std::string& down, int inter);
  const Layer* FindLayer(int layer) const;

  std::string dir_;
  MoeConfig config_;
  std::unique_ptr<TensorSource> src_;
  std::optional<Exl3Storage> storage_;
  std::string fingerprint_;
  bool fingerprint_covers_weights_ = false;
  std::map<int, Layer> layers_;
};

}  // namespace exl3

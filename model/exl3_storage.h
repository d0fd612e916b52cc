// quantization_config.json, which exllamav3's converter writes beside config.json: its
// quantization settings (those of config.json's quantization_config) and, under
// "tensor_storage", every leaf module's stored tensors: for each module key (the stored name,
// e.g. "model.layers.0.mlp.experts.3.gate_proj", DeepSeek-V4 "layers.0.ffn.experts.3.w1")
//
//   "stored_tensors": {NAME: {"shape": [...], "n_bytes": N, "dtype": "torch.float16"}, ...},
//   and for EXL3 modules "quant_format": "exl3", "bits_per_weight": 4 (or 2.5, the half-integer
//   rates), "mul1_multiplier" / "mcg_multiplier" (the codebook; neither: 3INST).
//
//   EXL3_ASSIGN_OR_RETURN(std::optional<Exl3Storage> st, ReadExl3Storage(dir));
//   if (st) EXL3_RETURN_IF_ERROR(CheckExl3Storage(*st, *src));  // the files match the record
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/safetensors.h"

namespace exl3 {

inline constexpr char kExl3StorageFile[] = "quantization_config.json";

struct StoredTensorRecord {
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  DType dtype = DType::kF16;  // from torch's spelling ("torch.float16" -> F16)
};

// How a module is stored.
enum class ModuleStorage {
  kExl3,         // quant_format "exl3": trellis, suh/svh (or su/sv), codebook flag, bias
  kUnquantized,  // no quant_format: its tensors as they are (.weight, norms, routers, embeddings)
};

struct ModuleRecord {
  std::string key;  // stored name
  ModuleStorage storage = ModuleStorage::kUnquantized;
  double bits_per_weight = 0;  // kExl3 only
  uint32_t mcg_multiplier = 0;   // kExl3: 0 when absent
  uint32_t mul1_multiplier = 0;  // kExl3: 0 when absent
  std::map<std::string, StoredTensorRecord> tensors;  // stored name -> record

  bool half_integer_rate() const {
    return storage == ModuleStorage::kExl3 && bits_per_weight != static_cast<int>(bits_per_weight);
  }
  // An exllamav3 quantized embedding table ("trellis" + "signs", no linear layer).
  bool quantized_embedding() const;
};

struct Exl3Storage {
  std::string quant_method;  // "exl3"
  std::string version;       // exllamav3's version, e.g. "1.6.5"
  double bits = 0;           // the converter's final average rate
  double head_bits = 0;
  std::string codebook;      // "mul1", "mcg", "3inst"; empty when not recorded
  std::map<std::string, ModuleRecord> modules;  // by stored key
};

// Parses the file's text. `source` only names the file in errors.
absl::StatusOr<Exl3Storage> ParseExl3Storage(std::string_view json_text, std::string_view source);

// dir/quantization_config.json parsed, or nullopt when the directory has none.
absl::StatusOr<std::optional<Exl3Storage>> ReadExl3Storage(const std::string& dir);

// Every tensor the record lists is in `src` (under its stored name) with that dtype, shape and
// size, and every EXL3 module's trellis width and codebook flag agree with its bits_per_weight
// and multiplier. Errors name the module and the tensor.
absl::Status CheckExl3Storage(const Exl3Storage& storage, const TensorSource& src);

}  // namespace exl3

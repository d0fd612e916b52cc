// One EXL3 linear layer read from safetensors: finds and validates the tensors under a key prefix
// and builds the Exl3LinearView the kernels take.
//
// Usage:
//   auto src = TensorSource::Open("model_dir_or_file");
//   absl::StatusOr<std::unique_ptr<Exl3Linear>> lin =
//       LoadExl3Linear(**src, "model.layers.3.mlp.experts.0.gate_proj", /*in=*/4096, /*out=*/1408);
//   LinearForwardReference((*lin)->view, x, T, y);
//
// K = trellis.shape[2] / 16; codebook from the presence of `mcg` / `mul1` (their value is checked);
// sign/scale vectors fp16 `suh`/`svh`, or packed int16 `su`/`sv` (unpacked into owned memory);
// optional `bias` (fp16, or bf16/fp32 converted to owned fp16). Refused with messages naming
// them: exllamav3's half-integer rates (16*K + 8 words per tile) and layers it stored
// zero-padded to multiples of 128 (docs/format.md, "Directories exllamav3 writes";
// model/exl3_padded_linear.h reads those as the layer the config names).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/exl3_linear.h"
#include "model/safetensors.h"

namespace exl3 {

struct Exl3Linear {
  std::string prefix;
  Exl3LinearView view;  // points into the mapped files and into owned_* below
  std::vector<uint16_t> owned_suh, owned_svh, owned_bias;  // set when converted/unpacked
  std::vector<uint16_t> owned_trellis;  // set for a slice of another layer (model/exl3_linear_slice.h)
  std::vector<TensorView> tensors;  // every on-disk tensor of this layer
  uint64_t bytes = 0;               // sum of those tensors' bytes

  Exl3Linear() = default;
  Exl3Linear(const Exl3Linear&) = delete;
  Exl3Linear& operator=(const Exl3Linear&) = delete;
};

// The width exllamav3 stores a layer dimension of `width` at: the next multiple of 128.
int Exl3PaddedWidth(int width);

// True when `prefix`.trellis exists.
bool HasExl3Linear(const TensorSource& src, const std::string& prefix);

// Reads and validates the layer at `prefix`. expect_in / expect_out: the shape the caller needs
// (-1: any). Errors name the tensor and what is wrong with it.
absl::StatusOr<std::unique_ptr<Exl3Linear>> LoadExl3Linear(const TensorSource& src,
                                                           const std::string& prefix,
                                                           int expect_in = -1,
                                                           int expect_out = -1);

}  // namespace exl3

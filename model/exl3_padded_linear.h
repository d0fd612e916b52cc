// An EXL3 linear layer that exllamav3 stored zero-padded. exllamav3 rounds both widths of every
// layer it quantizes up to a multiple of 128 (pad_to of its Linear module), quantizes the
// zero-padded weight and, when it runs the layer, zero-extends the input and uses only the first
// `out` outputs. Layers whose config width is not such a multiple therefore come back wider than
// the config says: MLA's kv_a_proj_with_mqa (kv_lora_rank + qk_rope_head_dim outputs, 160 in the
// DeepSeek-V3 fixtures) is stored 256 wide.
//
// Read here as the layer the config names: the stored layer dequantized, and of it the block of
// the `in` real input rows and `out` real output columns. The padded input rows only ever meet
// zeros and the padded output columns are never read, so that block is all the layer computes;
// what quantization left in the padding (noise around zero) is dropped.
//
//   EXL3_ASSIGN_OR_RETURN(bool padded, IsPaddedExl3Linear(src, prefix, 256, 160));
//   if (padded) { EXL3_ASSIGN_OR_RETURN(PaddedExl3Weight w, LoadPaddedExl3Linear(src, prefix, 256, 160)); }
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/exl3_linear_loader.h"  // Exl3PaddedWidth
#include "model/safetensors.h"

namespace exl3 {

// True when `prefix`.trellis holds the in x out layer stored padded: its stored widths are
// Exl3PaddedWidth(in) x Exl3PaddedWidth(out) and at least one of them differs from the config's.
// False for any other trellis shape (LoadExl3Linear judges those); an error when there is no
// trellis or its shape cannot be read.
absl::StatusOr<bool> IsPaddedExl3Linear(const TensorSource& src, const std::string& prefix, int in,
                                        int out);

struct PaddedExl3Weight {
  std::vector<float> weight_out_in;  // [out, in], the real block of the dequantized layer
  std::vector<float> bias;           // [out], or empty when the layer has none
};

// The padded layer at `prefix` as its in x out weight (and bias). Refused unless
// IsPaddedExl3Linear holds; the layer's tensors are validated as LoadExl3Linear does.
absl::StatusOr<PaddedExl3Weight> LoadPaddedExl3Linear(const TensorSource& src,
                                                      const std::string& prefix, int in, int out);

}  // namespace exl3

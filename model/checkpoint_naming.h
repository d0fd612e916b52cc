// How a checkpoint names its tensors, and the names this project reads them under.
//
// Two namings reach the loaders:
//   kTransformers     "model.layers.L....", "model.embed_tokens.weight", "model.norm.weight":
//                     what transformers saves and what the project's readers ask for.
//   kDeepseekRelease  DeepSeek-V4 as released and as exllamav3 reads and writes it: no "model."
//                     prefix ("layers.L....", "embed.*", "norm.*"), the hyper-connection
//                     head as "hc_head_fn" / "hc_head_base" / "hc_head_scale", the attention's
//                     KV norm as "attn.kv_norm" (the project's "attn.norm"); "head.*" and the
//                     other per-layer names below "layers.L." are as the project reads them.
// TensorSource (model/safetensors.h) detects the naming of a checkpoint and serves a
// kDeepseekRelease one under the project's names, so every reader sees one naming.
//
//   CheckpointNaming n = DetectCheckpointNaming(stored_names);
//   ProjectTensorName(n, "layers.3.ffn.experts.0.w1.trellis") == "model.layers.3.ffn.experts.0.w1.trellis"
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace exl3 {

enum class CheckpointNaming { kTransformers, kDeepseekRelease };

std::string_view CheckpointNamingName(CheckpointNaming n);  // "transformers", "deepseek-release"

// kDeepseekRelease when the names hold "embed.*" and "layers.*" tensors and none under
// "model."; kTransformers otherwise.
CheckpointNaming DetectCheckpointNaming(const std::vector<std::string>& stored_names);

// The name the project reads a stored tensor under (unchanged for kTransformers).
std::string ProjectTensorName(CheckpointNaming n, std::string_view stored_name);

}  // namespace exl3

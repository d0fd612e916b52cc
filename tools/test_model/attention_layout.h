// The attention tensors of a generated family model's decoder layer, one function per attention
// kind (GQA, Qwen3-Next's gated attention, MLA with DSA's or GLM-5.3-Flash's indexer, DeepSeek-V4's
// shared-KV attention, gated DeltaNet, Kimi delta attention, Qwen4-Exp's DeltaNet and QSA), and the hyper-connections and norms
// around them, in the families' key layouts (test_model_spec.h lists them).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tools/test_model/generated_tensor.h"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// Adds the linear `name` (under the layer's prefix) of [out_f, in_f]: EXL3 or bf16 as the model
// being planned stores its attention (model_layout.h).
using LinearAdder = std::function<void(const std::string& name, int out_f, int in_f)>;

// A decoder norm of the family's convention: Qwen3-Next and Qwen4-Exp store zero-centred weights
// (x · (1 + w)).
GenTensor FamilyNormTensor(const TestModelSpec& s, std::string name, int64_t n);

// DeepSeek-V4's manifold-constrained hyper-connection of one sublayer (`prefix` hc_attn_ or
// hc_ffn_): fn [(2 + hc) hc, hc hidden], base [(2 + hc) hc], scale [3].
void AddHyperConnection(const TestModelSpec& s, const std::string& prefix, std::vector<GenTensor>* t);

// Qwen4-Exp's low-rank gated residual (`prefix` e.g. ...layers.3.attn_hyper_connection.;
// engine/cpu/residual/gated_residual.h): hc_norm [hc hidden] (zero-centred), input_mix_weight_down
// [hc_lowrank, hc hidden], input_mix_weight_up [hc hidden, hc_lowrank] and, with_inject (a block's,
// not the mixer before the head), block_inject_weight [hc, hc hidden]; all as stored.
void AddGatedResidual(const TestModelSpec& s, const std::string& prefix, bool with_inject,
                      std::vector<GenTensor>* t);

// The attention of decoder layer L (prefix p), of the kind the family and s.layer_types give it.
// exl3: the layout `exl3-tool quantize` writes (and exllamav3 reads) where it differs from the
// Hugging Face checkpoint's: GLM-5.3-Flash's KDA q/k/v as one qkv_proj and one conv1d,
// DeepSeek-V4's wo_a as per-group slices; else the checkpoint's.
void AddAttentionTensors(const TestModelSpec& s, int L, const std::string& p, const LinearAdder& linear,
                         bool exl3, std::vector<GenTensor>* t);

}  // namespace exl3

// The tensors of a generated family model (test_model_spec.h), shard by shard: as a Hugging Face
// checkpoint (bf16 weights) or a synthetic EXL3 model (random trellis bits where both dimensions
// of a linear are multiples of 128), its whole model or only its MoE layers.
#pragma once

#include <vector>

#include "engine/cpu/residual/ngram_hash.h"
#include "model/moe_config.h"
#include "tools/test_model/generated_tensor.h"
#include "tools/test_model/synthetic_options.h"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// Which bit width of SyntheticOptions a linear takes.
enum class LinearRole { kExpert, kExpertDown, kAttentionOrDense, kHead };

int BitsOf(const SyntheticOptions& so, LinearRole role);

// The n-gram hashing of a resolved qwen4_exp spec's ple_index-th PLE layer, as the engine derives
// it from the config.json family_config.cc writes (its table's rows, primes and multipliers).
engine::NgramHash Qwen4ExpNgramHash(const TestModelSpec& s, int ple_index);

// The whole model's tensors, one shard per layer (and one for the MTP layer); embeddings with
// the first, the final norm and the head with the last. exl3: EXL3 linears at `so`'s widths (so
// set), else HF bf16 weights (so null).
std::vector<std::vector<GenTensor>> WholeModelShards(const TestModelSpec& s, const MoeConfig& cfg,
                                                     bool exl3, const SyntheticOptions* so);

// The synthetic model's shards: the whole model, or one shard per MoE layer.
std::vector<std::vector<GenTensor>> SyntheticShards(const TestModelSpec& s, const MoeConfig& cfg,
                                                    const SyntheticOptions& so);

}  // namespace exl3

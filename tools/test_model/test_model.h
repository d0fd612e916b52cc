// Generated MoE test models of eight families (test_model_spec.h) in their real key layout and
// config.json (family_config.h), for tests, benchmarks and exl3-tool make-test-model.
//
// WriteHfTestModel writes a Hugging Face checkpoint (bf16 weights with random values, fp32
// correction biases, tiny attention/norm/embedding tensors so that the checkpoint is complete,
// one shard per layer with model.safetensors.index.json); convert it with
// model/encoder/checkpoint_converter.h.
// WriteSyntheticExl3Model writes an EXL3 model directly, with random trellis bits (valid EXL3,
// no encoding): for benchmarks at real shapes. By default only MoE layers' tensors are written
// (router, correction bias, routed and shared experts), one shard per MoE layer, streamed to
// disk; with SyntheticOptions::whole_model every layer and the embeddings and head too.
// The tensors are planned per family (model_layout.h, attention_layout.h), drawn from streams
// seeded per tensor (generated_tensor.h) and written shard by shard (shard_writer.h). The tests'
// smaller expert models come from the same pieces (expert_test_model.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/test_model/family_config.h"
#include "tools/test_model/synthetic_options.h"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// Writes the HF checkpoint into `dir` (created). progress: a bar on stderr.
absl::Status WriteHfTestModel(const TestModelSpec& spec, const std::string& dir,
                              bool progress = false);

// Bytes the synthetic model's shards will take.
uint64_t SyntheticModelBytes(const TestModelSpec& resolved, const SyntheticOptions& opts);

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir);

}  // namespace exl3

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
#include "kernels/codebook.h"
#include "model/safetensors.h"
#include "tools/test_model/family_config.h"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// Writes the HF checkpoint into `dir` (created). progress: a bar on stderr.
absl::Status WriteHfTestModel(const TestModelSpec& spec, const std::string& dir,
                              bool progress = false);

struct SyntheticOptions {
  // Also attention, norms, dense MLPs, embeddings and the head (linears EXL3 where both
  // dimensions are multiples of 128, else bf16), so the engine can run it; else MoE layers only.
  bool whole_model = false;
  int bits = 2;            // experts' K (and every other EXL3 linear's unless set below)
  int down_bits = 0;       // routed and shared experts' down projections' K (0: bits)
  int attention_bits = 0;  // attention and dense MLP linears' K (0: bits)
  int head_bits = 0;       // lm_head's K (0: bits)
  Codebook codebook = Codebook::kMcg;
  // Routed expert e's gate, up and down at K expert_bits_cycle[e % size] and codebook
  // expert_codebook_cycle[e % size] where these are not empty (overriding bits, down_bits and
  // codebook): layers whose routed experts differ in K and codebook.
  std::vector<int> expert_bits_cycle;
  std::vector<Codebook> expert_codebook_cycle;
  bool progress = true;
  int threads = 0;  // generating threads (0: every core); the output does not depend on it
  // Where each shard's data section starts. k8PastA16ByteBoundary with the 3INST codebook (no
  // 4-byte flag scalars) leaves every tensor 8- but not 16-byte aligned, as in files Python's
  // safetensors writes: the case --weights-residency host realigns.
  DataSectionStart data_start = DataSectionStart::k64ByteAligned;
};

// Bytes the synthetic model's shards will take.
uint64_t SyntheticModelBytes(const TestModelSpec& resolved, const SyntheticOptions& opts);

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir);

}  // namespace exl3

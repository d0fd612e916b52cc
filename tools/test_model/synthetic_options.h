// How WriteSyntheticExl3Model (test_model.h) writes a synthetic EXL3 model: which layers, at
// which bit widths and codebooks, and where each shard's data section starts. The planner of its
// tensors (model_layout.h) reads them too.
#pragma once

#include <vector>

#include "kernels/codebook.h"
#include "model/safetensors.h"

namespace exl3 {

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

}  // namespace exl3

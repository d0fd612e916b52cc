// What a CUDA model's forward reads of its weights, by part, and the EXL3 weights it decodes (the
// benchmarks' floors: below K of about 7 on an H200 the trellis decode, not the bytes, bounds an
// EXL3 layer).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/cuda/cuda_linear.h"

namespace exl3::engine::cuda {

// EXL3 weights decoded, by bit width and codebook.
struct DecodedWeights {
  int64_t count[9][3] = {};  // [K][codebook]
  void Add(const Exl3LinearView& v) {
    count[v.bits][static_cast<int>(v.codebook)] += static_cast<int64_t>(v.in_features) * v.out_features;
  }
  // The EXL3 ones of `linears`.
  void Add(const std::vector<const CudaLinear*>& linears) {
    for (const CudaLinear* lin : linears)
      if (const Exl3LinearView* v = lin->exl3_view()) Add(*v);
  }
};

struct CudaWeightBytes {
  int64_t attention = 0, dense_mlp = 0, router = 0, head = 0, embedding_row = 0;
  int64_t experts_resident = 0;  // routed and shared experts held on this GPU
  DecodedWeights attention_decoded, dense_mlp_decoded, head_decoded;
  DecodedWeights experts_decoded;  // every resident expert
};

}  // namespace exl3::engine::cuda

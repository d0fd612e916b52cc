// One EXL3 linear layer y = x · W, W = diag(suh) · H · W_inner · H · diag(svh) (+ bias), on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/codebook.h"

namespace exl3 {

// Non-owning view of one EXL3 linear layer's tensors.
struct Exl3LinearView {
  int in_features = 0;   // k, multiple of 128
  int out_features = 0;  // n, multiple of 128
  int bits = 0;          // K, 1..8
  Codebook codebook = Codebook::k3Inst;
  const uint16_t* trellis = nullptr;  // int16 [k/16, n/16, 16*K]
  const uint16_t* suh = nullptr;      // fp16 [k]
  const uint16_t* svh = nullptr;      // fp16 [n]
  const uint16_t* bias = nullptr;     // fp16 [n], or null

  size_t trellis_words() const {
    return static_cast<size_t>(in_features / 16) * (out_features / 16) * 16 * bits;
  }
  // Words of tile (i, j).
  const uint16_t* tile(int i, int j) const {
    return trellis + (static_cast<size_t>(i) * (out_features / 16) + j) * 16 * bits;
  }
};

// Checks shapes, bit width and that every pointer needed is set.
absl::Status ValidateLinear(const Exl3LinearView& w);

// Unpacks older models' packed signs (bit i of word j set: element 16j+i is -1) into fp16 ±1.
std::vector<uint16_t> UnpackSigns(const uint16_t* packed, size_t num_words);

// W_inner as fp16 bit patterns, row-major [k, n], exactly as the trellis encodes it.
void DequantizeInner(const Exl3LinearView& w, uint16_t* out);

// The dense W as fp32, row-major [k, n] (bias not included).
void DequantizeDense(const Exl3LinearView& w, float* out);

// Reference forward without materialising W: x [T, k] fp32 -> y [T, n] fp32 (bias added).
// Decodes tile by tile; single-threaded.
void LinearForwardReference(const Exl3LinearView& w, const float* x, int num_tokens, float* y);

// The input and output transforms of the forward pass, exposed for backends that do the middle
// product themselves: x'[t] = (x[t] ⊙ suh) · H and y[t] = (y'[t] · H) ⊙ svh (+ bias).
void ApplyInputTransform(const Exl3LinearView& w, const float* x, int num_tokens, float* x_out);
void ApplyOutputTransform(const Exl3LinearView& w, float* y, int num_tokens);

}  // namespace exl3

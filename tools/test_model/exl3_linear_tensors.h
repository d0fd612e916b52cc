// The tensors of one EXL3 linear layer [out_f, in_f] with random trellis bits: trellis int16
// [in_f / 16, out_f / 16, 16 K], the sign vectors, and the codebook's int32 flag (mcg / mul1;
// 3INST: none). Both generated-model layouts (model_layout.h, expert_test_model.h) plan their
// linears with it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/codebook.h"
#include "tools/test_model/generated_tensor.h"

namespace exl3 {

// How a linear stores its input and output sign vectors.
enum class SignVectors {
  kHalf,        // suh [in_f], svh [out_f]: fp16 +-magnitude
  kPackedBits,  // su [in_f / 16], sv [out_f / 16]: int16 words of sign bits
};

struct Exl3SignForm {
  SignVectors vectors = SignVectors::kHalf;
  float input_magnitude = 1.0f;   // |suh|
  float output_magnitude = 1.0f;  // |svh|
};

// May change the trellis shape of the tensor named (returns true when it did): the tests' models
// with a wrong shape. Empty: none changed.
using TrellisShapeOverride = std::function<bool(const std::string& name, std::vector<int64_t>& shape)>;

void AddExl3Linear(const std::string& prefix, int out_f, int in_f, int K, Codebook codebook,
                   const Exl3SignForm& signs, std::vector<GenTensor>* out,
                   const TrellisShapeOverride& shape_override = {});

}  // namespace exl3

// A tensor of a generated model: its name, dtype, shape and how its values are drawn, and the two
// sources of those values.
//   SeededTensorValues   every tensor (and every 16M-element part of a large one) from a stream
//                        of its own, seeded by (seed, name, part): the parts generate in
//                        parallel and a tensor's bytes do not depend on the others. The family
//                        models of exl3-tool make-test-model.
//   InOrderTensorValues  one std::mt19937 stream drawn through the tensors in the order given:
//                        the expert models of the tests (expert_test_model.h), whose bytes the
//                        tests have always had.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace exl3 {

struct GenTensor {
  enum Kind {
    kGaussian,    // N(0, scale)
    kNorm,        // 1 + N(0, 0.05): a norm weight
    kBias,        // U(-scale, scale)
    kUniform,     // U(scale, high)
    kLogUniform,  // log U(scale, high)
    kRandomBits,  // random bytes (trellis bits, packed sign bits)
    kSigns,       // +-scale in fp16
    kFlag,        // an int32 scalar: flag (a codebook's multiplier)
    kHashTable,   // int64 rows of `flag` distinct ids in [0, high)
    kInt64Values, // int64 `values` as given (Qwen4-Exp's n-gram hashing constants)
  };
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Kind kind;
  float scale = 0.02f;
  int32_t flag = 0;
  float high = 0.0f;
  std::vector<int64_t> values = {};  // kInt64Values
};

int64_t NumElements(const std::vector<int64_t>& shape);
uint64_t TensorBytes(const GenTensor& t);

// A bf16 norm weight of n elements (kNorm).
GenTensor NormTensor(std::string name, int64_t n);

// Where a planned tensor's bytes come from.
class TensorValues {
 public:
  virtual ~TensorValues() = default;
  // The bytes of each tensor of `batch`, in its order.
  virtual std::vector<std::vector<uint8_t>> Generate(const std::vector<const GenTensor*>& batch) = 0;
};

class SeededTensorValues : public TensorValues {
 public:
  // threads: generating threads; the bytes do not depend on them.
  SeededTensorValues(uint64_t seed, int threads) : seed_(seed), threads_(threads) {}
  std::vector<std::vector<uint8_t>> Generate(const std::vector<const GenTensor*>& batch) override;

 private:
  uint64_t seed_;
  int threads_;
};

// Draws every tensor of `order` at construction (the stream runs through all of them, so a
// tensor later left out of the files still takes its draws); Generate hands out their bytes.
// Kinds: kRandomBits (one draw per 16-bit word, its low half), kSigns (one draw per element, its
// low bit: set negative), kGaussian (std::normal_distribution per tensor) and kFlag.
class InOrderTensorValues : public TensorValues {
 public:
  InOrderTensorValues(uint32_t seed, const std::vector<GenTensor>& order);
  std::vector<std::vector<uint8_t>> Generate(const std::vector<const GenTensor*>& batch) override;

 private:
  std::map<std::string, std::vector<uint8_t>> bytes_;
};

// Every core (at least 1).
int DefaultThreads();

}  // namespace exl3

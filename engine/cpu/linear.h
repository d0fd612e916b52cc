// One linear layer of the model, y = x · Wᵀ + b, stored either as EXL3 (run by the CPU backend,
// weights read in place from the mapped files) or dense (fp16 / bf16 / fp32 on disk, held as an
// fp32 copy [out, in]).
//
//   EXL3_ASSIGN_OR_RETURN(Linear q, Linear::Load(src, "model.layers.0.self_attn.q_proj", 4096, 4096));
//   EXL3_RETURN_IF_ERROR(q.Forward(x /*[T, in]*/, T, y /*[T, out]*/, compute));
//
// The prefix names the layer without a suffix: EXL3 when PREFIX.trellis exists, else
// PREFIX.weight [out, in] (+ PREFIX.bias [out] when present). An EXL3 layer exllamav3 stored
// zero-padded to multiples of 128 is held dense, as its real block (model/exl3_padded_linear.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/config/model_config.h"
#include "model/exl3_linear_loader.h"
#include "model/safetensors.h"

namespace exl3::engine {

class Linear {
 public:
  enum class Storage { kExl3, kDense };

  static absl::StatusOr<Linear> Load(const TensorSource& src, const std::string& prefix,
                                     int in_features, int out_features);
  // Output rows [first, first + out_features) of the layer at `prefix`, whose whole width is
  // full_out: a fused projection read as one of its parts (EXL3: whole 128-column blocks,
  // model/exl3_linear_slice.h).
  static absl::StatusOr<Linear> LoadOutputSlice(const TensorSource& src, const std::string& prefix,
                                                int in_features, int full_out, int first, int out_features);
  // A dense layer from an fp32 weight [out, in] (tied embeddings as the head).
  static Linear FromDense(std::vector<float> weight_out_in, int in_features, int out_features);

  Storage storage() const { return storage_; }
  int in_features() const { return in_; }
  int out_features() const { return out_; }
  absl::Status Forward(const float* x, int num_tokens, float* y, CpuCompute& compute) const;
  // The weight as fp32 [out, in] (EXL3 dequantized), for layers whose product is rearranged
  // (MLA's absorbed kv_b_proj). Bias not included.
  std::vector<float> DenseWeight() const;
  bool has_bias() const;
  // What a device copy is made from (engine/cuda/cuda_linear.h): the EXL3 tensors (host memory;
  // null for a dense layer), or the dense weight [out, in] and bias [out] (empty: none).
  const Exl3LinearView* exl3_view() const { return exl3_ ? &exl3_->view : nullptr; }
  const std::vector<float>& stored_dense_weight() const { return weight_; }
  const std::vector<float>& stored_dense_bias() const { return bias_; }

 private:
  Storage storage_ = Storage::kDense;
  int in_ = 0, out_ = 0;
  std::shared_ptr<const Exl3Linear> exl3_;
  std::vector<float> weight_;  // dense: [out, in]
  std::vector<float> bias_;    // dense: [out] or empty
};

// y[t] = x[t] · Wᵀ for W fp32 [out, in], spread over the compute pool (+ bias when non-empty).
void DenseProduct(const float* w, const std::vector<float>& bias, int in, int out,
                  const float* x, int num_tokens, float* y, CpuCompute& compute);

// A vector tensor (norm weights, biases) as fp32, checking its length.
absl::StatusOr<std::vector<float>> LoadVector(const TensorSource& src, const std::string& name,
                                              int64_t length);

// An RMSNorm weight as the factor engine/cpu/rms_norm.h multiplies by: as stored (kScale), or 1 + w
// for zero-centred weights (kOffsetFromOne, Qwen3-Next).
absl::StatusOr<std::vector<float>> LoadNormWeight(const TensorSource& src, const std::string& name,
                                                  int64_t length, NormWeightConvention convention);

}  // namespace exl3::engine

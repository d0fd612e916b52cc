// Quantizes one linear layer to EXL3: plain, data-free trellis quantization (no Hessian / LDLQ
// calibration).
//
// From a weight in Hugging Face nn.Linear orientation [out, in]:
//   W = transpose, [k = in, n = out];
//   suh = random signs (seeded) x input-channel RMS of W,
//   svh = random signs (seeded) x output-channel RMS of diag(1/|suh|) W   (both rounded to fp16);
//   W_inner = H · diag(1/suh) · W · diag(1/svh) · H    (H: orthonormal 128-block Hadamard, so
//             that W = diag(suh) · H · W_inner · H · diag(svh) exactly, as the decoder reads it);
//   W_inner has unit RMS; it is multiplied by a global scale g chosen so that it matches the
//   codebook (a small search on a sample of tiles around a per-(K, codebook) default), g is
//   folded back into svh (svh / g), and every 16x16 tile is Viterbi-encoded.
// The relative error ||W - W_hat||^2 / ||W||^2 is then close to the tile MSE at unit scale
// (relative_mse below), since the transforms are orthonormal up to the channel scales.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codebook.h"
#include "kernels/exl3_linear.h"
#include "model/safetensors.h"

namespace exl3 {

struct LayerQuantOptions {
  int bits = 4;                     // K, 1..8
  Codebook codebook = Codebook::k3Inst;
  uint64_t seed = 0;                // for the sign vectors
  int threads = 0;                  // 0: all cores
  bool channel_scales = true;       // fold row/column RMS into suh/svh (else signs only)
  bool scale_search = true;         // search the global scale on a sample of tiles (only for
                                    // layers of >= 1024 tiles; else the default)
};

struct QuantizedLayer {
  int in_features = 0;   // k
  int out_features = 0;  // n
  int bits = 0;
  Codebook codebook = Codebook::k3Inst;
  std::vector<uint16_t> trellis;  // int16 [k/16, n/16, 16K]
  std::vector<uint16_t> suh;      // fp16 [k]
  std::vector<uint16_t> svh;      // fp16 [n]
  float global_scale = 1.0f;      // g (already folded into svh)
  double relative_mse = 0.0;      // tile-encoding error / energy, in the W_inner domain

  Exl3LinearView view() const;
};

// The global scale used without a search, per K and codebook (best on unit Gaussian tiles).
float DefaultGlobalScale(int bits, Codebook cb);

// `weight` is row-major [out_features, in_features] (nn.Linear orientation); both dimensions must
// be multiples of 128 and every value finite.
absl::StatusOr<QuantizedLayer> QuantizeLinear(const float* weight, int out_features,
                                              int in_features, const LayerQuantOptions& opts);

// Same from a 2-D fp16/bf16/fp32/fp64 safetensors tensor.
absl::StatusOr<QuantizedLayer> QuantizeLinearTensor(const TensorView& weight,
                                                    const LayerQuantOptions& opts);

// Adds `prefix`.trellis / .suh / .svh and the codebook flag (.mcg or .mul1, int32 scalar; none
// for 3INST) to a writer.
void AddQuantizedLayer(const QuantizedLayer& layer, const std::string& prefix,
                       SafetensorsWriter* writer);

// The codebook flag tensor's suffix ("mcg", "mul1") and int32 value; false for 3INST.
bool CodebookFlag(Codebook cb, std::string* suffix, int32_t* value);

// A per-tensor seed from a global seed and the tensor's name (FNV-1a mixed with the seed), so
// that a conversion is reproducible tensor by tensor whatever the order.
uint64_t TensorSeed(uint64_t seed, const std::string& name);

}  // namespace exl3

#include "tools/test_model/exl3_linear_tensors.h"

#include "model/encoder/layer_quantizer.h"

namespace exl3 {

void AddExl3Linear(const std::string& prefix, int out_f, int in_f, int K, Codebook codebook,
                   const Exl3SignForm& signs, std::vector<GenTensor>* out,
                   const TrellisShapeOverride& shape_override) {
  std::vector<int64_t> trellis = {in_f / 16, out_f / 16, 16 * K};
  if (shape_override) shape_override(prefix + ".trellis", trellis);
  out->push_back({prefix + ".trellis", DType::kI16, trellis, GenTensor::kRandomBits});
  switch (signs.vectors) {
    case SignVectors::kHalf:
      out->push_back({prefix + ".suh", DType::kF16, {in_f}, GenTensor::kSigns, signs.input_magnitude});
      out->push_back({prefix + ".svh", DType::kF16, {out_f}, GenTensor::kSigns, signs.output_magnitude});
      break;
    case SignVectors::kPackedBits:
      out->push_back({prefix + ".su", DType::kI16, {in_f / 16}, GenTensor::kRandomBits});
      out->push_back({prefix + ".sv", DType::kI16, {out_f / 16}, GenTensor::kRandomBits});
      break;
  }
  std::string suffix;
  int32_t flag;
  if (CodebookFlag(codebook, &suffix, &flag)) {
    GenTensor t{prefix + "." + suffix, DType::kI32, {}, GenTensor::kFlag};
    t.flag = flag;
    out->push_back(t);
  }
}

}  // namespace exl3

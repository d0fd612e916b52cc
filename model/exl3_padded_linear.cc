#include "model/exl3_padded_linear.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"

namespace exl3 {

absl::StatusOr<bool> IsPaddedExl3Linear(const TensorSource& src, const std::string& prefix, int in,
                                        int out) {
  const std::string tname = prefix + ".trellis";
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(tname));
  const std::vector<int64_t>& s = t.info->shape;
  if (s.size() != 3 || in <= 0 || out <= 0) return false;
  const int64_t stored_in = s[0] * 16, stored_out = s[1] * 16;
  return (stored_in != in || stored_out != out) && stored_in == Exl3PaddedWidth(in) &&
         stored_out == Exl3PaddedWidth(out);
}

absl::StatusOr<PaddedExl3Weight> LoadPaddedExl3Linear(const TensorSource& src,
                                                      const std::string& prefix, int in, int out) {
  EXL3_ASSIGN_OR_RETURN(bool padded, IsPaddedExl3Linear(src, prefix, in, out));
  if (!padded)
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, ": not the ", in, "x", out, " layer stored padded to ", Exl3PaddedWidth(in), "x",
        Exl3PaddedWidth(out)));
  const int pin = Exl3PaddedWidth(in), pout = Exl3PaddedWidth(out);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Linear> lin, LoadExl3Linear(src, prefix, pin, pout));
  std::vector<float> in_out(static_cast<size_t>(pin) * pout);
  DequantizeDense(lin->view, in_out.data());  // [pin, pout]
  PaddedExl3Weight w;
  w.weight_out_in.resize(static_cast<size_t>(out) * in);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i)
      w.weight_out_in[static_cast<size_t>(o) * in + i] = in_out[static_cast<size_t>(i) * pout + o];
  if (lin->view.bias != nullptr) {
    w.bias.resize(out);
    for (int o = 0; o < out; ++o) w.bias[o] = HalfBitsToFloat(lin->view.bias[o]);
  }
  return w;
}

}  // namespace exl3

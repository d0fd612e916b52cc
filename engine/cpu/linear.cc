#include "engine/cpu/linear.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/exl3_linear_slice.h"
#include "model/exl3_padded_linear.h"

namespace exl3::engine {

absl::StatusOr<std::vector<float>> LoadVector(const TensorSource& src, const std::string& name,
                                              int64_t length) {
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
  if (t.info->shape.size() != 1 || t.info->shape[0] != length)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected a vector of ", length, " values"));
  return ToFloat32(t);
}

absl::StatusOr<std::vector<float>> LoadNormWeight(const TensorSource& src, const std::string& name,
                                                  int64_t length, NormWeightConvention convention) {
  EXL3_ASSIGN_OR_RETURN(std::vector<float> w, LoadVector(src, name, length));
  if (convention == NormWeightConvention::kOffsetFromOne)
    for (float& v : w) v = 1.0f + v;
  return w;
}

absl::StatusOr<Linear> Linear::Load(const TensorSource& src, const std::string& prefix,
                                    int in_features, int out_features) {
  Linear l;
  l.in_ = in_features;
  l.out_ = out_features;
  if (HasExl3Linear(src, prefix)) {
    EXL3_ASSIGN_OR_RETURN(const bool padded, IsPaddedExl3Linear(src, prefix, in_features, out_features));
    if (padded) {
      // exllamav3 stored the layer zero-padded to multiples of 128 (model/exl3_padded_linear.h):
      // held dense, as the block of its real rows and columns, which the EXL3 kernels (whole
      // 128-wide Hadamard blocks) cannot run on their own.
      EXL3_ASSIGN_OR_RETURN(PaddedExl3Weight w,
                            LoadPaddedExl3Linear(src, prefix, in_features, out_features));
      l.weight_ = std::move(w.weight_out_in);
      l.bias_ = std::move(w.bias);
      return l;
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Linear> e,
                          LoadExl3Linear(src, prefix, in_features, out_features));
    l.storage_ = Storage::kExl3;
    l.exl3_ = std::move(e);
    return l;
  }
  const std::string wname = prefix + ".weight";
  if (!src.Has(wname))
    return absl::NotFoundError(
        absl::StrCat(prefix, ": neither ", prefix, ".trellis (EXL3) nor ", wname, " exists"));
  EXL3_ASSIGN_OR_RETURN(TensorView w, src.Get(wname));
  if (w.info->shape != std::vector<int64_t>{out_features, in_features})
    return absl::InvalidArgumentError(absl::StrCat(wname, ": expected shape [", out_features, ", ",
                                                   in_features, "]"));
  EXL3_ASSIGN_OR_RETURN(l.weight_, ToFloat32(w));
  if (src.Has(prefix + ".bias")) {
    EXL3_ASSIGN_OR_RETURN(l.bias_, LoadVector(src, prefix + ".bias", out_features));
  }
  return l;
}

absl::StatusOr<Linear> Linear::LoadOutputSlice(const TensorSource& src, const std::string& prefix,
                                               int in_features, int full_out, int first, int out_features) {
  if (first < 0 || out_features <= 0 || first + out_features > full_out)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": rows [", first, ", ", first + out_features,
                                                   ") are not inside its ", full_out));
  Linear l;
  l.in_ = in_features;
  l.out_ = out_features;
  if (HasExl3Linear(src, prefix)) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Linear> whole, LoadExl3Linear(src, prefix, in_features, full_out));
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Linear> part, SliceExl3LinearOutputs(*whole, first, out_features));
    l.storage_ = Storage::kExl3;
    l.exl3_ = std::move(part);
    return l;
  }
  EXL3_ASSIGN_OR_RETURN(Linear whole, Load(src, prefix, in_features, full_out));
  const size_t row = static_cast<size_t>(in_features);
  l.weight_.assign(whole.weight_.begin() + first * row, whole.weight_.begin() + (first + out_features) * row);
  if (!whole.bias_.empty())
    l.bias_.assign(whole.bias_.begin() + first, whole.bias_.begin() + first + out_features);
  return l;
}

Linear Linear::FromDense(std::vector<float> weight_out_in, int in_features, int out_features) {
  Linear l;
  l.in_ = in_features;
  l.out_ = out_features;
  l.weight_ = std::move(weight_out_in);
  return l;
}

bool Linear::has_bias() const {
  return storage_ == Storage::kExl3 ? exl3_->view.bias != nullptr : !bias_.empty();
}

absl::Status Linear::Forward(const float* x, int num_tokens, float* y, CpuCompute& compute) const {
  if (num_tokens <= 0) return absl::OkStatus();
  if (storage_ == Storage::kExl3) return compute.exl3().Linear(exl3_->view, x, num_tokens, y);
  DenseProduct(weight_.data(), bias_, in_, out_, x, num_tokens, y, compute);
  return absl::OkStatus();
}

std::vector<float> Linear::DenseWeight() const {
  if (storage_ == Storage::kDense) return weight_;
  std::vector<float> in_out(static_cast<size_t>(in_) * out_);
  DequantizeDense(exl3_->view, in_out.data());  // [in, out]
  std::vector<float> out_in(in_out.size());
  for (int i = 0; i < in_; ++i)
    for (int o = 0; o < out_; ++o) out_in[static_cast<size_t>(o) * in_ + i] = in_out[static_cast<size_t>(i) * out_ + o];
  return out_in;
}

namespace {

// Dot product with eight independent partial sums (vectorisable without reassociation flags).
float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void DenseProduct(const float* w, const std::vector<float>& bias, int in, int out, const float* x,
                  int num_tokens, float* y, CpuCompute& compute) {
  constexpr int kRowsPerItem = 16;
  const int items = (out + kRowsPerItem - 1) / kRowsPerItem;
  compute.ParallelFor(items, [&](int item) {
    const int o0 = item * kRowsPerItem, o1 = std::min(out, o0 + kRowsPerItem);
    for (int t = 0; t < num_tokens; ++t) {
      const float* xt = x + static_cast<size_t>(t) * in;
      float* yt = y + static_cast<size_t>(t) * out;
      for (int o = o0; o < o1; ++o)
        yt[o] = Dot(xt, w + static_cast<size_t>(o) * in, in) + (bias.empty() ? 0.0f : bias[o]);
    }
  });
}

}  // namespace exl3::engine

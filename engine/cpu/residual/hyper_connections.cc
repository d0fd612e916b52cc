#include "engine/cpu/residual/hyper_connections.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/linear.h"

namespace exl3::engine {
namespace {

absl::StatusOr<std::vector<float>> LoadMatrix(const TensorSource& src, const std::string& name,
                                              int64_t rows, int64_t cols) {
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
  if (t.info->shape != std::vector<int64_t>{rows, cols})
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected shape [", rows, ", ", cols, "]"));
  return ToFloat32(t);
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The streams of one token, RMS-normalised without a weight, times each row of fn: out[r].
void NormedMixes(const float* streams, int width, float norm_eps, const std::vector<float>& fn,
                 int rows, float* out) {
  double ss = 0.0;
  for (int i = 0; i < width; ++i) ss += static_cast<double>(streams[i]) * streams[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / width + norm_eps));
  std::vector<float> f(width);
  for (int i = 0; i < width; ++i) f[i] = streams[i] * inv;
  for (int r = 0; r < rows; ++r) {
    const float* w = &fn[static_cast<size_t>(r) * width];
    double acc = 0.0;
    for (int i = 0; i < width; ++i) acc += static_cast<double>(w[i]) * f[i];
    out[r] = static_cast<float>(acc);
  }
}

}  // namespace

absl::StatusOr<HyperConnection> HyperConnection::Load(const TensorSource& src,
                                                      const std::string& prefix,
                                                      const HyperConnectionShape& shape) {
  HyperConnection hc;
  hc.shape_ = shape;
  const int n = shape.streams, mixes = (2 + n) * n;
  EXL3_ASSIGN_OR_RETURN(hc.fn_, LoadMatrix(src, prefix + "fn", mixes, static_cast<int64_t>(n) * shape.hidden));
  EXL3_ASSIGN_OR_RETURN(hc.base_, LoadVector(src, prefix + "base", mixes));
  EXL3_ASSIGN_OR_RETURN(hc.scale_, LoadVector(src, prefix + "scale", 3));
  return hc;
}

void HyperConnection::Collapse(const float* streams, int T, float* block_input,
                               HyperConnectionMix* mix, CpuCompute& compute) const {
  const int n = shape_.streams, H = shape_.hidden, width = n * H, mixes = (2 + n) * n;
  const float eps = shape_.eps;
  mix->post.assign(static_cast<size_t>(T) * n, 0.0f);
  mix->comb.assign(static_cast<size_t>(T) * n * n, 0.0f);
  compute.ParallelFor(T, [&](int t) {
    const float* x = streams + static_cast<size_t>(t) * width;
    std::vector<float> m(mixes);
    NormedMixes(x, width, shape_.norm_eps, fn_, mixes, m.data());
    std::vector<float> pre(n);
    float* post = &mix->post[static_cast<size_t>(t) * n];
    float* comb = &mix->comb[static_cast<size_t>(t) * n * n];
    for (int i = 0; i < n; ++i) {
      pre[i] = Sigmoid(m[i] * scale_[0] + base_[i]) + eps;
      post[i] = 2.0f * Sigmoid(m[n + i] * scale_[1] + base_[n + i]);
    }
    // comb: a softmax per row, then Sinkhorn towards doubly stochastic.
    for (int j = 0; j < n; ++j) {
      float* row = comb + static_cast<size_t>(j) * n;
      float mx = -INFINITY;
      for (int k = 0; k < n; ++k) {
        row[k] = m[2 * n + j * n + k] * scale_[2] + base_[2 * n + j * n + k];
        mx = std::max(mx, row[k]);
      }
      float sum = 0.0f;
      for (int k = 0; k < n; ++k) sum += (row[k] = std::exp(row[k] - mx));
      for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
    }
    auto normalise_columns = [&] {
      for (int k = 0; k < n; ++k) {
        float sum = 0.0f;
        for (int j = 0; j < n; ++j) sum += comb[j * n + k];
        for (int j = 0; j < n; ++j) comb[j * n + k] /= sum + eps;
      }
    };
    normalise_columns();
    for (int it = 0; it + 1 < shape_.sinkhorn_iters; ++it) {
      for (int j = 0; j < n; ++j) {
        float sum = 0.0f;
        for (int k = 0; k < n; ++k) sum += comb[j * n + k];
        for (int k = 0; k < n; ++k) comb[j * n + k] /= sum + eps;
      }
      normalise_columns();
    }
    float* y = block_input + static_cast<size_t>(t) * H;
    for (int d = 0; d < H; ++d) {
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) acc += pre[i] * x[static_cast<size_t>(i) * H + d];
      y[d] = acc;
    }
  });
}

void HyperConnection::Expand(const HyperConnectionMix& mix, const float* block_output, int T,
                             float* streams, CpuCompute& compute) const {
  const int n = shape_.streams, H = shape_.hidden;
  compute.ParallelFor(T, [&](int t) {
    float* s = streams + static_cast<size_t>(t) * n * H;
    const float* o = block_output + static_cast<size_t>(t) * H;
    const float* post = &mix.post[static_cast<size_t>(t) * n];
    const float* comb = &mix.comb[static_cast<size_t>(t) * n * n];
    std::vector<float> out(static_cast<size_t>(n) * H);
    for (int k = 0; k < n; ++k) {
      float* ok = &out[static_cast<size_t>(k) * H];
      for (int d = 0; d < H; ++d) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc += comb[j * n + k] * s[static_cast<size_t>(j) * H + d];
        ok[d] = post[k] * o[d] + acc;
      }
    }
    std::copy(out.begin(), out.end(), s);
  });
}

absl::StatusOr<HyperHead> HyperHead::Load(const TensorSource& src, const std::string& prefix,
                                          const HyperConnectionShape& shape) {
  HyperHead h;
  h.shape_ = shape;
  const int n = shape.streams;
  EXL3_ASSIGN_OR_RETURN(h.fn_, LoadMatrix(src, prefix + "hc_fn", n, static_cast<int64_t>(n) * shape.hidden));
  EXL3_ASSIGN_OR_RETURN(h.base_, LoadVector(src, prefix + "hc_base", n));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> scale, LoadVector(src, prefix + "hc_scale", 1));
  h.scale_ = scale[0];
  return h;
}

HyperHead HyperHead::Mean(const HyperConnectionShape& shape) {
  HyperHead h;
  h.shape_ = shape;
  h.kind_ = HyperHeadKind::kMean;
  return h;
}

void HyperHead::Collapse(const float* streams, const std::vector<int>& rows, float* out) const {
  const int n = shape_.streams, H = shape_.hidden, width = n * H;
  if (kind_ == HyperHeadKind::kMean) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const float* x = streams + static_cast<size_t>(rows[r]) * width;
      float* y = out + r * H;
      for (int d = 0; d < H; ++d) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) acc += x[static_cast<size_t>(i) * H + d];
        y[d] = acc / static_cast<float>(n);
      }
    }
    return;
  }
  std::vector<float> m(n);
  for (size_t r = 0; r < rows.size(); ++r) {
    const float* x = streams + static_cast<size_t>(rows[r]) * width;
    NormedMixes(x, width, shape_.norm_eps, fn_, n, m.data());
    float* y = out + r * H;
    for (int d = 0; d < H; ++d) y[d] = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float pre = Sigmoid(m[i] * scale_ + base_[i]) + shape_.eps;
      for (int d = 0; d < H; ++d) y[d] += pre * x[static_cast<size_t>(i) * H + d];
    }
  }
}

}  // namespace exl3::engine

#include "model/encoder/layer_quantizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_tile.h"
#include "model/encoder/trellis_encoder.h"

namespace exl3 {
namespace {

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Largest and smallest channel scale we store: well inside fp16's normal range.
constexpr float kMaxChannelScale = 1.0e4f;
constexpr float kMinChannelScale = 1.0e-4f;

float ClampScale(double v) {
  if (!(v > 0) || !std::isfinite(v)) return 1.0f;
  return static_cast<float>(std::clamp<double>(v, kMinChannelScale, kMaxChannelScale));
}

// out = H · diag(1/su) · W · diag(1/sv) · H, W row-major [k, n].
void InnerTransform(const std::vector<float>& w, int k, int n, const std::vector<float>& su,
                    const std::vector<float>& sv, std::vector<float>* out) {
  out->resize(w.size());
  float* o = out->data();
  for (int i = 0; i < k; ++i) {
    const float a = 1.0f / su[i];
    for (int j = 0; j < n; ++j) o[static_cast<size_t>(i) * n + j] = w[static_cast<size_t>(i) * n + j] * a / sv[j];
  }
  for (int rb = 0; rb < k; rb += kHadamardBlock) {
    for (int c = 0; c < n; ++c) Hadamard128Strided(o + static_cast<size_t>(rb) * n + c, n);
  }
  for (int r = 0; r < k; ++r) HadamardBlocks(o + static_cast<size_t>(r) * n, n);
}

}  // namespace

Exl3LinearView QuantizedLayer::view() const {
  Exl3LinearView v;
  v.in_features = in_features;
  v.out_features = out_features;
  v.bits = bits;
  v.codebook = codebook;
  v.trellis = trellis.data();
  v.suh = suh.data();
  v.svh = svh.data();
  return v;
}

float DefaultGlobalScale(int bits, Codebook cb) {
  // Best scales of the grid 0.70..1.60 on unit Gaussian tiles (bench/results/encoder.md): the
  // lowest expected MSE (10240 tiles, extreme values weighted at their exact probability) at
  // K >= 6, where the few values beyond the codebook's range set the optimum and small samples
  // mislead; at K <= 5 neighbouring grid points differ by under 0.3 %. Real (heavier-tailed)
  // weights prefer the lower end.
  static constexpr float k3InstMcg[9] = {0, 1.45f, 1.25f, 1.20f, 1.15f, 1.10f, 1.00f, 0.95f, 0.90f};
  static constexpr float kMul1[9] = {0, 1.15f, 1.00f, 0.95f, 0.90f, 0.90f, 0.85f, 0.80f, 0.75f};
  bits = std::clamp(bits, 1, 8);
  return cb == Codebook::kMul1 ? kMul1[bits] : k3InstMcg[bits];
}

bool CodebookFlag(Codebook cb, std::string* suffix, int32_t* value) {
  if (cb == Codebook::kMcg) {
    *suffix = "mcg";
    *value = static_cast<int32_t>(kMcgMultiplier);
    return true;
  }
  if (cb == Codebook::kMul1) {
    *suffix = "mul1";
    *value = static_cast<int32_t>(kMul1Multiplier);
    return true;
  }
  return false;
}

uint64_t TensorSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  uint64_t s = seed ^ h;
  return SplitMix64(&s);
}

absl::StatusOr<QuantizedLayer> QuantizeLinear(const float* weight, int out_features,
                                              int in_features, const LayerQuantOptions& opts) {
  const int k = in_features, n = out_features;
  if (opts.bits < 1 || opts.bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat("bit width ", opts.bits, " is not in 1..8"));
  }
  if (k <= 0 || n <= 0 || k % 128 != 0 || n % 128 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight shape [", n, ", ", k,
                     "] ([out, in]) is not quantizable: EXL3 needs both dimensions to be "
                     "positive multiples of 128"));
  }
  const size_t total = static_cast<size_t>(k) * n;
  // W = transpose: [k, n].
  std::vector<float> w(total);
  for (int o = 0; o < n; ++o) {
    const float* src = weight + static_cast<size_t>(o) * k;
    for (int i = 0; i < k; ++i) {
      if (!std::isfinite(src[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("weight has a non-finite value at [", o, ", ", i, "]"));
      }
      w[static_cast<size_t>(i) * n + o] = src[i];
    }
  }

  // Signs and channel scales.
  uint64_t rng = opts.seed;
  std::vector<float> su(k), sv0(n);
  for (int i = 0; i < k; ++i) {
    double rms = 1.0;
    if (opts.channel_scales) {
      double ss = 0;
      for (int j = 0; j < n; ++j) ss += static_cast<double>(w[static_cast<size_t>(i) * n + j]) * w[static_cast<size_t>(i) * n + j];
      rms = std::sqrt(ss / n);
    }
    const float sign = (SplitMix64(&rng) & 1) ? -1.0f : 1.0f;
    su[i] = HalfBitsToFloat(FloatToHalfBits(sign * ClampScale(rms)));
  }
  {
    std::vector<double> ss(n, 0.0);
    if (opts.channel_scales) {
      for (int i = 0; i < k; ++i) {
        const float a = 1.0f / su[i];
        for (int j = 0; j < n; ++j) {
          const double v = w[static_cast<size_t>(i) * n + j] * a;
          ss[j] += v * v;
        }
      }
    }
    for (int j = 0; j < n; ++j) {
      const float sign = (SplitMix64(&rng) & 1) ? -1.0f : 1.0f;
      sv0[j] = sign * (opts.channel_scales ? ClampScale(std::sqrt(ss[j] / k)) : 1.0f);
    }
  }
  if (!opts.channel_scales) {
    // Signs only: still bring W_inner to unit RMS through one global factor in svh.
    double ss = 0;
    for (float v : w) ss += static_cast<double>(v) * v;
    const float rms = ClampScale(std::sqrt(ss / total));
    for (float& v : sv0) v *= rms;
  }

  const int tiles_r = k / 16, tiles_c = n / 16;
  const size_t num_tiles = static_cast<size_t>(tiles_r) * tiles_c;
  auto gather_all = [&](const std::vector<float>& m, std::vector<float>* stream) {
    stream->resize(total);
    for (int i = 0; i < tiles_r; ++i)
      for (int j = 0; j < tiles_c; ++j)
        GatherTileStream(m.data(), n, i, j, stream->data() + (static_cast<size_t>(i) * tiles_c + j) * kTileElems);
  };

  // Global scale: W_inner at unit RMS times g, with g searched on a sample of tiles.
  float g = DefaultGlobalScale(opts.bits, opts.codebook);
  std::vector<float> inner, stream;
  // Searched only on layers of at least kMinSearchTiles tiles: at high K the error is dominated by
  // the few values beyond the codebook's reach (about +-3.95 for 3INST/MCG, +-3.4 for MUL1), so a
  // small sample says little, and on small layers the search would cost more than it saves.
  constexpr size_t kMinSearchTiles = 1024;
  if (opts.scale_search && num_tiles >= kMinSearchTiles) {
    InnerTransform(w, k, n, su, sv0, &inner);
    gather_all(inner, &stream);
    const size_t sample = std::clamp<size_t>(num_tiles / 32, 32, 64);
    std::vector<float> xs(sample * kTileElems);
    std::vector<uint16_t> words(sample * 16 * opts.bits);
    const size_t stride = num_tiles / sample;
    double best = 1e300;
    float best_g = g;
    for (float f : {0.92f, 0.96f, 1.0f, 1.04f, 1.08f}) {
      const float cand = g * f;
      for (size_t t = 0; t < sample; ++t) {
        const float* src = stream.data() + t * stride * kTileElems;
        for (int e = 0; e < kTileElems; ++e) xs[t * kTileElems + e] = src[e] * cand;
      }
      const double err = EncodeTiles(xs.data(), sample, opts.bits, opts.codebook, words.data(),
                                     nullptr, opts.threads) /
                         (static_cast<double>(cand) * cand);
      if (err < best) best = err, best_g = cand;
    }
    g = best_g;
  }

  QuantizedLayer q;
  q.in_features = k;
  q.out_features = n;
  q.bits = opts.bits;
  q.codebook = opts.codebook;
  q.global_scale = g;
  q.suh.resize(k);
  q.svh.resize(n);
  std::vector<float> sv(n);
  for (int i = 0; i < k; ++i) q.suh[i] = FloatToHalfBits(su[i]);
  for (int j = 0; j < n; ++j) {
    q.svh[j] = FloatToHalfBits(sv0[j] / g);
    sv[j] = HalfBitsToFloat(q.svh[j]);
  }
  // The exact W_inner for the stored (fp16) suh and svh.
  InnerTransform(w, k, n, su, sv, &inner);
  gather_all(inner, &stream);
  q.trellis.resize(num_tiles * 16 * opts.bits);
  const double err = EncodeTiles(stream.data(), num_tiles, opts.bits, opts.codebook,
                                 q.trellis.data(), nullptr, opts.threads);
  double energy = 0;
  for (float v : stream) energy += static_cast<double>(v) * v;
  q.relative_mse = energy > 0 ? err / energy : 0.0;
  return q;
}

absl::StatusOr<QuantizedLayer> QuantizeLinearTensor(const TensorView& weight,
                                                    const LayerQuantOptions& opts) {
  if (weight.info->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", weight.info->name, "' has ",
                                                   weight.info->shape.size(),
                                                   " dimensions; a linear weight has 2"));
  }
  absl::StatusOr<std::vector<float>> f = ToFloat32(weight);
  if (!f.ok()) return f.status();
  absl::StatusOr<QuantizedLayer> q =
      QuantizeLinear(f->data(), static_cast<int>(weight.info->shape[0]),
                     static_cast<int>(weight.info->shape[1]), opts);
  if (!q.ok()) {
    return absl::Status(q.status().code(),
                        absl::StrCat("tensor '", weight.info->name, "': ", q.status().message()));
  }
  return q;
}

void AddQuantizedLayer(const QuantizedLayer& layer, const std::string& prefix,
                       SafetensorsWriter* writer) {
  writer->Add(prefix + ".trellis", DType::kI16,
              {layer.in_features / 16, layer.out_features / 16, 16 * layer.bits},
              layer.trellis.data(), layer.trellis.size() * 2);
  writer->Add(prefix + ".suh", DType::kF16, {layer.in_features}, layer.suh.data(),
              layer.suh.size() * 2);
  writer->Add(prefix + ".svh", DType::kF16, {layer.out_features}, layer.svh.data(),
              layer.svh.size() * 2);
  std::string suffix;
  int32_t value;
  if (CodebookFlag(layer.codebook, &suffix, &value)) {
    writer->Add(prefix + "." + suffix, DType::kI32, {}, &value, 4);
  }
}

}  // namespace exl3

#include "tools/test_model/generated_tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "kernels/fp16.h"
#include "model/encoder/layer_quantizer.h"

namespace exl3 {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  float Gaussian() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2 * M_PI * u2));
    have_spare_ = true;
    return static_cast<float>(r * std::cos(2 * M_PI * u2));
  }

 private:
  uint64_t s_;
  bool have_spare_ = false;
  float spare_ = 0;
};

// A tensor of more than kElementsPerPart elements is drawn in parts of that many elements, part p
// from its own random stream (seeded by the tensor's name and p), so that the parts of one large
// tensor (an embedding table) generate in parallel; smaller tensors are one stream.
constexpr int64_t kElementsPerPart = int64_t{1} << 24;

int64_t NumParts(const GenTensor& t) {
  if (t.kind == GenTensor::kFlag || t.kind == GenTensor::kHashTable || t.kind == GenTensor::kInt64Values) return 1;
  return std::max<int64_t>(1, (NumElements(t.shape) + kElementsPerPart - 1) / kElementsPerPart);
}

uint64_t PartSeed(uint64_t seed, const std::string& name, int64_t part) {
  const uint64_t s = TensorSeed(seed, name);
  return part == 0 ? s : Rng(s ^ (0xd1b54a32d192ed03ull * static_cast<uint64_t>(part))).Next();
}

// Writes part `part` of `t` (deterministic in (seed, name, part)) into `out`, the whole
// tensor's bytes.
void GeneratePart(const GenTensor& t, uint64_t seed, int64_t part, uint8_t* out) {
  Rng rng(PartSeed(seed, t.name, part));
  const int64_t n = NumElements(t.shape);
  const int64_t first = part * kElementsPerPart, count = std::min(n - first, kElementsPerPart);
  const size_t esize = DTypeSize(t.dtype);
  uint8_t* dst = out + static_cast<size_t>(first) * esize;
  switch (t.kind) {
    case GenTensor::kRandomBits: {
      const size_t bytes = static_cast<size_t>(count) * esize;
      for (size_t at = 0; at < bytes; at += 8) {
        const uint64_t v = rng.Next();
        std::memcpy(dst + at, &v, std::min<size_t>(8, bytes - at));
      }
      return;
    }
    case GenTensor::kFlag:
      std::memcpy(dst, &t.flag, 4);
      return;
    case GenTensor::kInt64Values:
      std::memcpy(dst, t.values.data(), std::min<size_t>(t.values.size(), static_cast<size_t>(n)) * sizeof(int64_t));
      return;
    case GenTensor::kHashTable: {  // per row (token id): t.flag distinct experts, partial shuffle
      const int64_t rows = t.shape[0], cols = t.shape[1], n_ids = static_cast<int64_t>(t.high);
      std::vector<int64_t> ids(n_ids);
      int64_t* o = reinterpret_cast<int64_t*>(dst);
      for (int64_t r = 0; r < rows; ++r) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t j = c + static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(n_ids - c));
          std::swap(ids[c], ids[j]);
          o[r * cols + c] = ids[c];
        }
      }
      return;
    }
    case GenTensor::kSigns: {
      const uint16_t pos = FloatToHalfBits(t.scale), neg = pos | 0x8000u;
      uint16_t* o = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) o[i] = (rng.Next() & 1) ? neg : pos;
      return;
    }
    default:
      break;
  }
  for (int64_t i = 0; i < count; ++i) {
    float v = 0.0f;
    switch (t.kind) {
      case GenTensor::kGaussian: v = rng.Gaussian() * t.scale; break;
      case GenTensor::kNorm: v = 1.0f + 0.05f * rng.Gaussian(); break;
      case GenTensor::kBias: v = static_cast<float>((2 * rng.Uniform() - 1) * t.scale); break;
      case GenTensor::kUniform: v = static_cast<float>(t.scale + (t.high - t.scale) * rng.Uniform()); break;
      case GenTensor::kLogUniform:
        v = static_cast<float>(std::log(t.scale + (t.high - t.scale) * rng.Uniform()));
        break;
      default: break;
    }
    if (t.dtype == DType::kF32) {
      std::memcpy(dst + 4 * i, &v, 4);
    } else {
      const uint16_t h = t.dtype == DType::kBF16 ? FloatToBFloat16Bits(v) : FloatToHalfBits(v);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

// Generates `batch` (every part of every tensor) on `threads` threads.
std::vector<std::vector<uint8_t>> GenerateTensors(const std::vector<const GenTensor*>& batch, uint64_t seed,
                                                  int threads) {
  std::vector<std::vector<uint8_t>> out(batch.size());
  std::vector<std::pair<size_t, int64_t>> work;  // (tensor, part)
  for (size_t i = 0; i < batch.size(); ++i) {
    out[i].resize(static_cast<size_t>(NumElements(batch[i]->shape)) * DTypeSize(batch[i]->dtype));
    for (int64_t p = 0; p < NumParts(*batch[i]); ++p) work.emplace_back(i, p);
  }
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t w; (w = next.fetch_add(1)) < work.size();)
      GeneratePart(*batch[work[w].first], seed, work[w].second, out[work[w].first].data());
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(work.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  return out;
}

}  // namespace

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorBytes(const GenTensor& t) {
  return static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
}

GenTensor NormTensor(std::string name, int64_t n) {
  return GenTensor{std::move(name), DType::kBF16, {n}, GenTensor::kNorm};
}

int DefaultThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

std::vector<std::vector<uint8_t>> SeededTensorValues::Generate(const std::vector<const GenTensor*>& batch) {
  return GenerateTensors(batch, seed_, threads_);
}

InOrderTensorValues::InOrderTensorValues(uint32_t seed, const std::vector<GenTensor>& order) {
  std::mt19937 rng(seed);
  for (const GenTensor& t : order) {
    std::vector<uint8_t>& out = bytes_[t.name];
    out.resize(TensorBytes(t));
    const size_t n = static_cast<size_t>(NumElements(t.shape));
    switch (t.kind) {
      case GenTensor::kRandomBits:
        for (size_t at = 0; at + 2 <= out.size(); at += 2) {
          const uint16_t v = static_cast<uint16_t>(rng());
          std::memcpy(out.data() + at, &v, 2);
        }
        break;
      case GenTensor::kSigns: {
        const uint16_t pos = FloatToHalfBits(t.scale), neg = FloatToHalfBits(-t.scale);
        for (size_t i = 0; i < n; ++i) {
          const uint16_t v = (rng() & 1) ? neg : pos;
          std::memcpy(out.data() + 2 * i, &v, 2);
        }
        break;
      }
      case GenTensor::kGaussian: {
        // A distribution per tensor: the same draws as one shared by consecutive tensors when
        // each holds an even number of elements (std::normal_distribution makes pairs).
        std::normal_distribution<float> nd(0.0f, t.scale);
        for (size_t i = 0; i < n; ++i) {
          const float v = nd(rng);
          if (t.dtype == DType::kF32) {
            std::memcpy(out.data() + 4 * i, &v, 4);
          } else {
            const uint16_t h = t.dtype == DType::kBF16 ? FloatToBFloat16Bits(v) : FloatToHalfBits(v);
            std::memcpy(out.data() + 2 * i, &h, 2);
          }
        }
        break;
      }
      case GenTensor::kFlag:
        std::memcpy(out.data(), &t.flag, 4);
        break;
      default:
        break;  // no other kind is drawn in order (expert_test_model.cc plans none)
    }
  }
}

std::vector<std::vector<uint8_t>> InOrderTensorValues::Generate(const std::vector<const GenTensor*>& batch) {
  std::vector<std::vector<uint8_t>> out;
  out.reserve(batch.size());
  for (const GenTensor* t : batch) out.push_back(std::move(bytes_[t->name]));
  return out;
}

}  // namespace exl3

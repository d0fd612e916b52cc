#include "model/encoder/trellis_encoder.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EXL3_ENCODER_X86 1
#endif

namespace exl3 {
namespace {

constexpr float kBig = 1e30f;  // cost of states excluded by the tail-biting constraint
constexpr int kPad = 16;  // m_ is read up to 16 floats at a time from any overlap index

// One Viterbi step, portable version. For every overlap value r (low 16-K bits of the new
// state s = (h << (16-K)) | r): m_next[r] = min over h of m[s >> K] + (x - cb[s])^2, and the
// argmin h goes to bp (when recording). While recording, the low 8 mantissa bits of each
// candidate cost are replaced by h, so that one integer min over the (positive) float bit
// patterns yields min and argmin together: it costs a relative 2^-15 of precision per step,
// which changes nothing measurable in the result, and keeps the SIMD loop free of blends.
void StepScalar(const float* m, float* m_next, uint8_t* bp, const float* cb, float x, int K,
                int R) {
  const int H = 1 << K, shift = 16 - K;
  for (int r = 0; r < R; ++r) {
    uint32_t best = 0x7f800000u;  // +inf
    for (int h = 0; h < H; ++h) {
      const int s = (h << shift) | r;
      const float d = x - cb[s];
      const float c = m[s >> K] + d * d;
      uint32_t ci;
      std::memcpy(&ci, &c, 4);
      if (bp) ci = (ci & ~0xffu) | static_cast<uint32_t>(h);
      best = std::min(best, ci);
    }
    std::memcpy(&m_next[r], &best, 4);
    if (bp) bp[r] = static_cast<uint8_t>(best & 0xffu);
  }
}

#ifdef EXL3_ENCODER_X86
// AVX2 version: kU groups of 8 consecutive overlap values at a time (independent dependency
// chains). The incoming costs of the 8 states s..s+7 are m[(s >> K) + (i >> K)], i = 0..7:
// one unaligned load and a lane permute for K < 3, a broadcast for K >= 3. The argmin rides in
// the low 8 mantissa bits of the cost (see kArgBits), so a plain integer min does min+argmin.
template <bool kRecord, bool kBroadcast>
__attribute__((target("avx2,fma"))) void StepAvx2(const float* m, float* m_next, uint8_t* bp,
                                              const float* cb, float x, int K, int R) {
  constexpr int kU = 4;
  const int H = 1 << K, shift = 16 - K;
  const __m256 vx = _mm256_set1_ps(x);
  const __m256i idx = _mm256_setr_epi32(0 >> K, 1 >> K, 2 >> K, 3 >> K, 4 >> K, 5 >> K,
                                        6 >> K, 7 >> K);
  const __m256i clear = _mm256_set1_epi32(~0xff);
  const __m256i one = _mm256_set1_epi32(1);
  for (int r = 0; r < R; r += 8 * kU) {  // R >= 256
    __m256i best[kU];
    for (int u = 0; u < kU; ++u) best[u] = _mm256_set1_epi32(0x7f800000);
    __m256i hv = _mm256_setzero_si256();
    for (int h = 0; h < H; ++h) {
      const int s0 = (h << shift) | r;
      for (int u = 0; u < kU; ++u) {
        const int s = s0 + 8 * u;
        __m256 mv;
        if constexpr (kBroadcast) mv = _mm256_broadcast_ss(m + (s >> K));
        else mv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(m + (s >> K)), idx);
        const __m256 d = _mm256_sub_ps(vx, _mm256_loadu_ps(cb + s));
        const __m256 c = _mm256_fmadd_ps(d, d, mv);
        if constexpr (kRecord) {
          const __m256i ci = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(c), clear), hv);
          best[u] = _mm256_min_epi32(best[u], ci);
        } else {
          best[u] = _mm256_min_epi32(best[u], _mm256_castps_si256(c));
        }
      }
      if constexpr (kRecord) hv = _mm256_add_epi32(hv, one);
    }
    for (int u = 0; u < kU; ++u) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_next + r + 8 * u), best[u]);
      if constexpr (kRecord) {
        const __m256i a = _mm256_and_si256(best[u], _mm256_set1_epi32(0xff));
        const __m128i p16 =
            _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(bp + r + 8 * u), _mm_packus_epi16(p16, p16));
      }
    }
  }
}

// AVX-512 version of StepAvx2: 16 overlap values per vector, the same operations in the same
// order (sub, fma, integer min), so the result is bit-identical to the AVX2 path; vpternlogd does
// the argmin's and+or in one instruction and vpmovdb narrows the argmins to bytes. The incoming
// costs of 16 consecutive states share one value for K >= 4 (broadcast); below, a permute.
// kU vectors in flight: 8 is fastest on Zen 4 except at K = 1 (2 steps per block), where 4 is.
template <bool kRecord, bool kBroadcast, int kU>
__attribute__((target("avx512f"))) void StepAvx512(const float* m, float* m_next, uint8_t* bp,
                                                 const float* cb, float x, int K, int R) {
  const int H = 1 << K, shift = 16 - K;
  const __m512 vx = _mm512_set1_ps(x);
  const __m512i idx = _mm512_setr_epi32(0 >> K, 1 >> K, 2 >> K, 3 >> K, 4 >> K, 5 >> K, 6 >> K,
                                        7 >> K, 8 >> K, 9 >> K, 10 >> K, 11 >> K, 12 >> K,
                                        13 >> K, 14 >> K, 15 >> K);
  const __m512i clear = _mm512_set1_epi32(~0xff);
  const __m512i one = _mm512_set1_epi32(1);
  // All-lanes masks: the maskz forms avoid GCC 12's false -Wmaybe-uninitialized on the plain
  // intrinsics (their undefined pass-through operand); the code generated is the same.
  constexpr __mmask16 kAll = 0xffff;
  for (int r = 0; r < R; r += 16 * kU) {  // R >= 256
    __m512i best[kU];
    for (int u = 0; u < kU; ++u) best[u] = _mm512_set1_epi32(0x7f800000);
    __m512i hv = _mm512_setzero_si512();
    for (int h = 0; h < H; ++h) {
      const int s0 = (h << shift) | r;
      for (int u = 0; u < kU; ++u) {
        const int s = s0 + 16 * u;
        __m512 mv;
        if constexpr (kBroadcast) mv = _mm512_set1_ps(m[s >> K]);
        else mv = _mm512_maskz_permutexvar_ps(kAll, idx, _mm512_loadu_ps(m + (s >> K)));
        const __m512 d = _mm512_sub_ps(vx, _mm512_loadu_ps(cb + s));
        const __m512 c = _mm512_fmadd_ps(d, d, mv);
        if constexpr (kRecord) {
          // (c & clear) | hv: truth table of (A & B) | C is 0xEA.
          const __m512i ci = _mm512_ternarylogic_epi32(_mm512_castps_si512(c), clear, hv, 0xEA);
          best[u] = _mm512_maskz_min_epi32(kAll, best[u], ci);
        } else {
          best[u] = _mm512_maskz_min_epi32(kAll, best[u], _mm512_castps_si512(c));
        }
      }
      if constexpr (kRecord) hv = _mm512_add_epi32(hv, one);
    }
    for (int u = 0; u < kU; ++u) {
      _mm512_storeu_si512(m_next + r + 16 * u, best[u]);
      if constexpr (kRecord) {
        _mm512_mask_cvtepi32_storeu_epi8(bp + r + 16 * u, kAll, best[u]);
      }
    }
  }
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
#endif

}  // namespace

TileEncoder::TileEncoder(int K, Codebook cb, Simd simd)
    : K_(K), cb_(cb), table_(CodebookTable(cb)), R_(1 << (16 - K)) {
  m_.assign(R_ + kPad, 0.0f);
  m_next_.assign(R_ + kPad, 0.0f);
  bp_.resize(static_cast<size_t>(kTileElems) * R_);
  simd_ = Simd::kPortable;
#ifdef EXL3_ENCODER_X86
  if (simd != Simd::kPortable && CpuHasAvx2()) simd_ = Simd::kAvx2;
  if ((simd == Simd::kBest || simd == Simd::kAvx512) && CpuHasAvx512()) simd_ = Simd::kAvx512;
#else
  (void)simd;
#endif
  if (const char* w = std::getenv("EXL3_ENCODER_WINDOW")) set_window(std::atoi(w));
}

void TileEncoder::set_window(int W) { window_ = std::clamp(W, 8, kTileElems); }

TileEncoder::~TileEncoder() = default;

bool TileEncoder::SimdAvailable(Simd simd) {
#ifdef EXL3_ENCODER_X86
  if (simd == Simd::kAvx2) return CpuHasAvx2();
  if (simd == Simd::kAvx512) return CpuHasAvx512();
#endif
  return simd == Simd::kPortable || simd == Simd::kBest;
}

void TileEncoder::Pass(const float* x, int num, bool record) {
  for (int i = 0; i < num; ++i) {
    uint8_t* bp = record ? bp_.data() + static_cast<size_t>(i) * R_ : nullptr;
    const float* m = m_.data();
    float* mn = m_next_.data();
    switch (simd_) {
#ifdef EXL3_ENCODER_X86
      case Simd::kAvx512: {
        const bool bc = K_ >= 4;  // 16 consecutive states share one incoming cost
        if (record && bc) StepAvx512<true, true, 8>(m, mn, bp, table_, x[i], K_, R_);
        else if (record && K_ == 1) StepAvx512<true, false, 4>(m, mn, bp, table_, x[i], K_, R_);
        else if (record) StepAvx512<true, false, 8>(m, mn, bp, table_, x[i], K_, R_);
        else if (bc) StepAvx512<false, true, 8>(m, mn, bp, table_, x[i], K_, R_);
        else if (K_ == 1) StepAvx512<false, false, 4>(m, mn, bp, table_, x[i], K_, R_);
        else StepAvx512<false, false, 8>(m, mn, bp, table_, x[i], K_, R_);
        break;
      }
      case Simd::kAvx2: {
        const bool bc = K_ >= 3;  // 8 consecutive states share one incoming cost
        if (record && bc) StepAvx2<true, true>(m, mn, bp, table_, x[i], K_, R_);
        else if (record) StepAvx2<true, false>(m, mn, bp, table_, x[i], K_, R_);
        else if (bc) StepAvx2<false, true>(m, mn, bp, table_, x[i], K_, R_);
        else StepAvx2<false, false>(m, mn, bp, table_, x[i], K_, R_);
        break;
      }
#endif
      default:
        StepScalar(m, mn, bp, table_, x[i], K_, R_);
    }
    std::swap(m_, m_next_);
  }
}

void TileEncoder::Backtrack(int num, uint32_t last_state, uint32_t* states) const {
  const int shift = 16 - K_;
  states[num - 1] = last_state;
  for (int i = num - 1; i > 0; --i) {
    const uint32_t r = states[i] >> K_;
    states[i - 1] = (static_cast<uint32_t>(bp_[static_cast<size_t>(i - 1) * R_ + r]) << shift) | r;
  }
}

double TileEncoder::Encode(const float* x_stream, uint16_t* words, float* decoded) {
  const int shift = 16 - K_;
  uint32_t states[kTileElems];

  // Pass 1: the tile read circularly from element 256-W for 2W elements, so that the wrap point
  // 255 -> 0 sits in the middle (W > 128 reads some elements twice, like a second lap around the
  // tail-biting trellis), free at both ends. Only the second half is recorded: backtracking from
  // the end to the middle gives the state at element 0, whose high bits are the overlap.
  const int W = window_;
  float rotated[2 * kTileElems];
  for (int i = 0; i < 2 * W; ++i) rotated[i] = x_stream[(2 * kTileElems - W + i) % kTileElems];
  std::fill(m_.begin(), m_.end(), 0.0f);
  Pass(rotated, W, /*record=*/false);
  Pass(rotated + W, W, /*record=*/true);
  const uint32_t end_r =
      static_cast<uint32_t>(std::min_element(m_.begin(), m_.begin() + R_) - m_.begin());
  Backtrack(W,
            (static_cast<uint32_t>(bp_[(W - 1) * static_cast<size_t>(R_) + end_r]) << shift) |
                end_r,
            states);
  const uint32_t overlap = states[0] >> K_;  // state of element 0: its high bits are the overlap

  return EncodeWithOverlap(x_stream, overlap, words, decoded);
}

double TileEncoder::EncodeWithOverlap(const float* x_stream, uint32_t overlap, uint16_t* words,
                                      float* decoded) {
  // Pass 2: elements 0..255 with the overlap bits fixed at the wrap point on both sides.
  const int shift = 16 - K_;
  overlap &= static_cast<uint32_t>(R_ - 1);
  uint32_t states[kTileElems];
  std::fill(m_.begin(), m_.end(), kBig);
  m_[overlap] = 0.0f;
  Pass(x_stream, kTileElems, /*record=*/true);
  const uint32_t last =
      (static_cast<uint32_t>(bp_[(kTileElems - 1) * static_cast<size_t>(R_) + overlap]) << shift) |
      overlap;
  Backtrack(kTileElems, last, states);

  PackTileStates(states, K_, words);
  double err = 0.0;
  for (int e = 0; e < kTileElems; ++e) {
    const float v = table_[states[e]];
    if (decoded) decoded[e] = v;
    const double d = static_cast<double>(x_stream[e]) - v;
    err += d * d;
  }
  return err;
}

double TileEncoder::EncodeOptimal(const float* x_stream, uint16_t* words, float* decoded,
                                  int* passes) {
  // Lower bound for overlap o: the best path over elements 0..255 whose last state ends in o,
  // with a free start (the constraint on state 0's high bits dropped).
  std::fill(m_.begin(), m_.end(), 0.0f);
  Pass(x_stream, kTileElems, /*record=*/false);
  const std::vector<float> bound(m_.begin(), m_.begin() + R_);
  std::vector<uint32_t> order(R_);
  for (int r = 0; r < R_; ++r) order[r] = static_cast<uint32_t>(r);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return bound[a] < bound[b]; });
  double best = std::numeric_limits<double>::infinity();
  uint32_t best_overlap = 0;
  int n = 0;
  std::vector<uint16_t> scratch(16 * K_);
  for (uint32_t o : order) {
    if (bound[o] >= best) break;
    const double err = EncodeWithOverlap(x_stream, o, scratch.data());
    ++n;
    if (err < best) best = err, best_overlap = o;
  }
  if (passes) *passes = n;
  return EncodeWithOverlap(x_stream, best_overlap, words, decoded);
}

void PackTileStates(const uint32_t* states, int K, uint16_t* words) {
  // Element e contributes its state's low K bits as stream bits eK .. eK+K-1 (first bit most
  // significant); stream bit b is bit 31 - (b % 32) of u32[b / 32].
  uint32_t u32[8 * 8] = {};
  const uint32_t kmask = (1u << K) - 1;
  for (int e = 0; e < kTileElems; ++e) {
    const uint32_t v = states[e] & kmask;
    const int b = e * K;
    const int m = b >> 5, off = b & 31;  // first bit lands at bit 31 - off
    const int top = 32 - off - K;        // shift placing the K bits in word m
    if (top >= 0) {
      u32[m] |= v << top;
    } else {  // straddles into the next word
      u32[m] |= v >> (-top);
      u32[m + 1] |= v << (32 + top);
    }
  }
  for (int m = 0; m < 8 * K; ++m) {
    words[2 * m] = static_cast<uint16_t>(u32[m] & 0xffffu);
    words[2 * m + 1] = static_cast<uint16_t>(u32[m] >> 16);
  }
}

void GatherTileStream(const float* matrix, size_t cols, int tile_row, int tile_col,
                      float out[kTileElems]) {
  const float* base = matrix + static_cast<size_t>(tile_row) * kTileSize * cols +
                      static_cast<size_t>(tile_col) * kTileSize;
  for (int e = 0; e < kTileElems; ++e) {
    const TilePos p = StreamElementPosition(e);
    out[e] = base[static_cast<size_t>(p.row) * cols + p.col];
  }
}

void ScatterTileStream(const float in[kTileElems], float* matrix, size_t cols, int tile_row,
                       int tile_col) {
  float* base = matrix + static_cast<size_t>(tile_row) * kTileSize * cols +
                static_cast<size_t>(tile_col) * kTileSize;
  for (int e = 0; e < kTileElems; ++e) {
    const TilePos p = StreamElementPosition(e);
    base[static_cast<size_t>(p.row) * cols + p.col] = in[e];
  }
}

double EncodeTiles(const float* x_stream, size_t num_tiles, int K, Codebook cb,
                   uint16_t* words_out, float* decoded_out, int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(num_tiles, 1)));
  std::atomic<size_t> next{0};
  std::vector<double> errs(threads, 0.0);
  auto worker = [&](int t) {
    TileEncoder enc(K, cb);
    for (size_t i = next.fetch_add(1); i < num_tiles; i = next.fetch_add(1)) {
      errs[t] += enc.Encode(x_stream + i * kTileElems, words_out + i * 16 * K,
                            decoded_out ? decoded_out + i * kTileElems : nullptr);
    }
  };
  if (threads == 1) {
    worker(0);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
    for (auto& th : pool) th.join();
  }
  double total = 0.0;
  for (double e : errs) total += e;
  return total;
}

}  // namespace exl3

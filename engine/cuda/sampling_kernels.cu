#include "engine/cuda/sampling_kernels.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <mutex>

#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;          // one radix digit of 8 bits
constexpr int kNoDigit = kBins;     // a lane with nothing to count
constexpr unsigned kFull = 0xffffffffu;
static_assert(kMaxDeviceTopLogprobs <= kThreads, "the top list is sorted one element per thread");

// The CPU sampler's exp for x <= 0 (engine/sampling/sampler.cc ExpNonPositive), operation for operation,
// each rounded to nearest and none fused, so the weights are the CPU's bit for bit.
__device__ __forceinline__ float ExpNonPositive(float x) {
  constexpr uint32_t kMinus87 = 0xc2ae0000u;  // -87.0f
  const uint32_t bits = __float_as_uint(x);
  x = __uint_as_float(bits < kMinus87 ? bits : kMinus87);
  const float t = __fmul_rn(x, 1.44269504f);
  const float n = __fsub_rn(__fadd_rn(t, 12582912.0f), 12582912.0f);
  const float f = __fsub_rn(t, n);
  float p = 1.52527338e-5f;
  p = __fadd_rn(__fmul_rn(p, f), 1.54035304e-4f);
  p = __fadd_rn(__fmul_rn(p, f), 1.33335581e-3f);
  p = __fadd_rn(__fmul_rn(p, f), 9.61812911e-3f);
  p = __fadd_rn(__fmul_rn(p, f), 5.55041087e-2f);
  p = __fadd_rn(__fmul_rn(p, f), 2.40226507e-1f);
  p = __fadd_rn(__fmul_rn(p, f), 6.93147181e-1f);
  p = __fadd_rn(__fmul_rn(p, f), 1.0f);
  const int32_t biased = static_cast<int32_t>(n) + 127;
  return __fmul_rn(p, __int_as_float(biased << 23));
}

// Unsigned bits that order as the floats do (a larger float, a larger key); -0 as +0, since the
// CPU sampler's comparisons see them equal.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// A head of the tokens in Higher order (key descending, then id ascending): those at or above
// (key, id). Inactive: every token.
struct Cut {
  bool active = false;
  uint32_t key = 0;
  int id = 0;
  __device__ bool Keeps(uint32_t k, int t) const { return !active || k > key || (k == key && t <= id); }
};

struct Shared {
  union {
    uint32_t count[kWarps][kBins];
    double mass[kWarps][kBins];
  } hist;
  union {
    uint32_t count[kBins];
    double mass[kBins];
  } total;
  uint32_t top_key[kMaxDeviceTopLogprobs];
  int32_t top_id[kMaxDeviceTopLogprobs];
  double reduce_d[kWarps];
  float reduce_f[kWarps];
  int reduce_i[kWarps];
  // Results of one thread's work, read by all after a barrier.
  uint32_t select_key;
  int select_digit;
  int select_remaining;
  int select_above;
  double select_mass_above;
  int select_found;
  int claim_id;  // atomicMin target
  int last_id;   // atomicMax target
  int top_count;
  float chosen_raw;
  int chosen_raw_found;
};

__device__ __forceinline__ int Lane() { return threadIdx.x & 31; }
__device__ __forceinline__ int Warp() { return threadIdx.x >> 5; }

// Block-wide reductions, every thread getting the result; deterministic (a fixed tree in each
// warp, then the warps in order).
__device__ double BlockSum(double v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if (Lane() == 0) sh.reduce_d[Warp()] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kWarps; ++w) total += sh.reduce_d[w];
  return total;
}

__device__ float BlockMax(float v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  __syncthreads();
  if (Lane() == 0) sh.reduce_f[Warp()] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sh.reduce_f[w]);
  return m;
}

__device__ int BlockSumInt(int v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if (Lane() == 0) sh.reduce_i[Warp()] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kWarps; ++w) total += sh.reduce_i[w];
  return total;
}

// The sum of v over the threads before this one (thread order is token order in the ordered
// passes: thread i holds the i-th contiguous chunk of the row).
template <typename T>
__device__ T BlockExclusiveSum(T v, T* partial) {
  T inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFull, inclusive, o);
    if (Lane() >= o) inclusive += y;
  }
  T exclusive = __shfl_up_sync(kFull, inclusive, 1);
  if (Lane() == 0) exclusive = 0;
  __syncthreads();
  if (Lane() == 31) partial[Warp()] = inclusive;
  __syncthreads();
  T base = 0;
  for (int w = 0; w < Warp(); ++w) base += partial[w];
  return base + exclusive;
}

// The contiguous chunk of the row thread i owns in the ordered passes.
struct Chunk {
  int begin, end;
};
__device__ Chunk MyChunk(int vocab) {
  const int per = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, static_cast<int>(threadIdx.x) * per);
  return {begin, min(vocab, begin + per)};
}

// What a radix select found: the key of the selected element, and what lies above it.
struct Selected {
  bool found = false;
  uint32_t key = 0;
  int remaining = 0;       // count mode: its rank among the tokens of that key (1-based)
  int above = 0;           // count mode: admitted tokens of larger keys
  double mass_above = 0;   // mass mode: their mass
};

// Radix select over the admitted tokens, in descending key order: count mode finds the key of
// the k-th (k in [1, admitted]); mass mode the key at which the running mass first reaches
// `target` (not found when rounding leaves the whole mass short of it).
// item(t, &key, &w) says whether token t is admitted, its key and (mass mode) its weight.
template <bool kMass, typename Item>
__device__ Selected RadixSelect(const Item& item, int vocab, int k, double target, Shared& sh) {
  uint32_t prefix = 0, mask = 0;
  int remaining = k, above = 0;
  double mass_above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kWarps * kBins; i += kThreads) {
      if (kMass) {
        (&sh.hist.mass[0][0])[i] = 0;
      } else {
        (&sh.hist.count[0][0])[i] = 0;
      }
    }
    __syncthreads();
    for (int base = 0; base < vocab; base += kThreads) {
      const int t = base + threadIdx.x;
      uint32_t key = 0;
      float w = 0;
      const bool in = t < vocab && item(t, &key, &w) && (key & mask) == prefix;
      const int digit = in ? static_cast<int>((key >> shift) & 0xffu) : kNoDigit;
      // Lanes of one digit add once, through their lowest lane: few atomics on peaked rows.
      const unsigned peers = __match_any_sync(kFull, digit);
      if (kMass) {
        const bool leader = digit != kNoDigit && Lane() == __ffs(peers) - 1;
        const unsigned leaders = __ballot_sync(kFull, leader);
        if (leaders != 0) {  // later passes: most warps hold nothing of the selected prefix
          double sum = 0;
          if (__popc(leaders) <= 4) {
            // Few digits (the first pass: sign and exponent): one butterfly sum per digit.
            for (unsigned pending = leaders; pending != 0; pending &= pending - 1) {
              const int l = __ffs(pending) - 1;
              const unsigned group = __shfl_sync(kFull, peers, l);
              double v = (group >> Lane()) & 1u ? static_cast<double>(w) : 0.0;
              for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
              if (Lane() == l) sum = v;
            }
          } else {
            for (int j = 0; j < 32; ++j) {
              const float wj = __shfl_sync(kFull, w, j);
              if ((peers >> j) & 1u) sum += wj;
            }
          }
          if (leader) atomicAdd(&sh.hist.mass[Warp()][digit], sum);
        }
      } else {
        if (digit != kNoDigit && Lane() == __ffs(peers) - 1)
          atomicAdd(&sh.hist.count[Warp()][digit], static_cast<uint32_t>(__popc(peers)));
      }
    }
    __syncthreads();
    if (threadIdx.x < kBins) {
      if (kMass) {
        double m = 0;
        for (int w = 0; w < kWarps; ++w) m += sh.hist.mass[w][threadIdx.x];
        sh.total.mass[threadIdx.x] = m;
      } else {
        uint32_t c = 0;
        for (int w = 0; w < kWarps; ++w) c += sh.hist.count[w][threadIdx.x];
        sh.total.count[threadIdx.x] = c;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int digit = -1;
      if (kMass) {
        double cum = mass_above, cum_before_lowest = mass_above;
        int lowest = -1;  // the lowest digit holding any token
        for (int d = kBins - 1; d >= 0; --d) {
          if (cum + sh.total.mass[d] >= target) {
            digit = d;
            break;
          }
          if (sh.total.mass[d] > 0) {
            lowest = d;
            cum_before_lowest = cum;
          }
          cum += sh.total.mass[d];
        }
        if (digit < 0 && shift < 24) {
          // Rounding: the digits' sums fell short of their parent's, which reached the target;
          // the head ends within the lowest of them.
          digit = lowest;
          cum = cum_before_lowest;
        }
        sh.select_mass_above = cum;
      } else {
        int cum = 0;
        for (int d = kBins - 1; d >= 0; --d) {
          if (cum + static_cast<int>(sh.total.count[d]) >= remaining) {
            digit = d;
            break;
          }
          cum += static_cast<int>(sh.total.count[d]);
        }
        sh.select_remaining = remaining - cum;
        sh.select_above = above + cum;
      }
      sh.select_digit = digit;
    }
    __syncthreads();
    const int digit = sh.select_digit;
    if (digit < 0) return Selected{};  // mass mode: the target is out of reach
    if (kMass) {
      mass_above = sh.select_mass_above;
    } else {
      remaining = sh.select_remaining;
      above = sh.select_above;
    }
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 0xffu << shift;
    __syncthreads();  // the select_ fields are rewritten by the next pass
  }
  Selected s;
  s.found = true;
  s.key = prefix;
  s.remaining = remaining;
  s.above = above;
  s.mass_above = mass_above;
  return s;
}

// The token of key s.key that ends the head (in Higher order) RadixSelect found: count mode the
// s.remaining-th of that key in id order; mass mode the first whose running mass (from
// s.mass_above, in id order) reaches `target`, or the last of that key when rounding leaves it
// short.
template <bool kMass, typename Item>
__device__ int TieCut(const Item& item, int vocab, const Selected& s, double target, Shared& sh) {
  const Chunk c = MyChunk(vocab);
  int own_count = 0, last = -1;
  double own_mass = 0;
  for (int t = c.begin; t < c.end; ++t) {
    uint32_t key;
    float w;
    if (item(t, &key, &w) && key == s.key) {
      ++own_count;
      own_mass += w;
      last = t;
    }
  }
  if (threadIdx.x == 0) {
    sh.claim_id = INT_MAX;
    sh.last_id = -1;
  }
  if (kMass) {
    const double before = s.mass_above + BlockExclusiveSum<double>(own_mass, sh.reduce_d);
    if (last >= 0) {
      atomicMax(&sh.last_id, last);
      double cum = before;
      for (int t = c.begin; t < c.end; ++t) {
        uint32_t key;
        float w;
        if (item(t, &key, &w) && key == s.key) {
          cum += w;
          if (cum >= target) {
            atomicMin(&sh.claim_id, t);
            break;
          }
        }
      }
    }
  } else {
    const int before = BlockExclusiveSum<int>(own_count, sh.reduce_i);
    if (before < s.remaining && s.remaining <= before + own_count) {
      int n = before;
      for (int t = c.begin; t < c.end; ++t) {
        uint32_t key;
        float w;
        if (item(t, &key, &w) && key == s.key && ++n == s.remaining) {
          sh.claim_id = t;
          break;
        }
      }
    }
  }
  __syncthreads();
  const int id = sh.claim_id != INT_MAX ? sh.claim_id : sh.last_id;
  __syncthreads();
  return id;
}

// The draw over the candidates `item` admits when they are at most kMaxDeviceTopLogprobs (what
// top-k left): gathered into shared memory, sorted into Higher order for top-p (the shortest
// head holding top_p of their mass, summed in that order) and min-p (a head too), then into id
// order for the draw, whose sums run serially in id order as the CPU sampler's do. Returns the
// token, on every thread.
template <typename Item>
__device__ int DrawListed(const Item& item, int vocab, const PackedSamplingRow& p, float max_x, float threshold,
                          bool min_p, Shared& sh);

// Sorts sh.top_key / sh.top_id [0, n) (n <= kMaxDeviceTopLogprobs) in place: by_id, ascending
// ids; else Higher order (key descending, lower id first). A bitonic sort over the next power of
// two, padded with entries that sort last; every thread calls it, and reads the result after it.
__device__ void SortListed(int n, bool by_id, Shared& sh) {
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += kThreads) {
    sh.top_key[i] = 0;
    sh.top_id[i] = INT_MAX;
  }
  for (int block = 2; block <= size; block <<= 1) {
    for (int stride = block / 2; stride > 0; stride >>= 1) {
      __syncthreads();
      const int i = threadIdx.x, j = i ^ stride;
      if (i < size && j > i) {
        const bool i_first = by_id ? sh.top_id[i] < sh.top_id[j]
                                   : sh.top_key[i] > sh.top_key[j] ||
                                         (sh.top_key[i] == sh.top_key[j] && sh.top_id[i] < sh.top_id[j]);
        if ((i & block) == 0 ? !i_first : i_first) {
          const uint32_t k = sh.top_key[i];
          sh.top_key[i] = sh.top_key[j];
          sh.top_key[j] = k;
          const int32_t id = sh.top_id[i];
          sh.top_id[i] = sh.top_id[j];
          sh.top_id[j] = id;
        }
      }
    }
  }
  __syncthreads();
}

template <typename Item>
__device__ int DrawListed(const Item& item, int vocab, const PackedSamplingRow& p, float max_x, float threshold,
                          bool min_p, Shared& sh) {
  if (threadIdx.x == 0) sh.top_count = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < vocab; t += kThreads) {
    uint32_t key;
    float w;
    if (item(t, &key, &w)) {
      const int i = atomicAdd(&sh.top_count, 1);
      if (i < kMaxDeviceTopLogprobs) {
        sh.top_key[i] = key;
        sh.top_id[i] = t;
      }
    }
  }
  __syncthreads();
  const int n = min(sh.top_count, kMaxDeviceTopLogprobs);
  SortListed(n, /*by_id=*/false, sh);
  auto weight = [&](int i) {
    uint32_t key;
    float w;
    item(sh.top_id[i], &key, &w);
    return static_cast<double>(w);
  };
  if (threadIdx.x == 0) {
    int keep = n;
    if ((p.flags & kPackedTopP) != 0) {
      double total = 0;
      for (int i = 0; i < n; ++i) total += weight(i);
      const double target = static_cast<double>(p.top_p) * total;
      double cum = 0;
      for (int i = 0; i < n; ++i) {
        cum += weight(i);
        if (cum >= target) {
          keep = i + 1;
          break;
        }
      }
    }
    if (min_p) {
      // x >= threshold, on the ordered keys (the list is in descending x: a head).
      const uint32_t threshold_key = OrderedKey(threshold);
      int m = 0;
      while (m < keep && sh.top_key[m] >= threshold_key) ++m;
      keep = m;
    }
    sh.top_count = keep;
  }
  __syncthreads();
  const int keep = sh.top_count;
  SortListed(keep, /*by_id=*/true, sh);
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < keep; ++i) total += weight(i);
    const double target = p.uniform * total;
    double cum = 0;
    int chosen = keep > 0 ? sh.top_id[keep - 1] : 0;  // rounding at the top end
    for (int i = 0; i < keep; ++i) {
      cum += weight(i);
      if (target < cum) {
        chosen = sh.top_id[i];
        break;
      }
    }
    sh.claim_id = chosen;
  }
  __syncthreads();
  const int chosen = sh.claim_id;
  __syncthreads();
  return chosen;
}

// The draw over the whole row: the first token, in ascending id order, whose running mass of the
// tokens kept(t, &w) admits exceeds uniform * their mass (the highest kept id when rounding
// leaves none); a block-wide prefix sum over contiguous chunks. Returns it on every thread.
template <typename Kept>
__device__ int DrawOverRow(const Kept& kept, int vocab, double uniform, Shared& sh) {
  const Chunk c = MyChunk(vocab);
  double own = 0;
  int last = -1;
  for (int t = c.begin; t < c.end; ++t) {
    float w;
    if (kept(t, &w)) {
      own += w;
      last = t;
    }
  }
  const double target = uniform * BlockSum(own, sh);
  const double before = BlockExclusiveSum<double>(own, sh.reduce_d);
  if (threadIdx.x == 0) {
    sh.claim_id = INT_MAX;
    sh.last_id = -1;
  }
  __syncthreads();
  if (last >= 0) {
    atomicMax(&sh.last_id, last);
    double cum = before;
    for (int t = c.begin; t < c.end; ++t) {
      float w;
      if (kept(t, &w)) {
        cum += w;
        if (target < cum) {
          atomicMin(&sh.claim_id, t);
          break;
        }
      }
    }
  }
  __syncthreads();
  const int chosen = sh.claim_id != INT_MAX ? sh.claim_id : max(sh.last_id, 0);
  __syncthreads();
  return chosen;
}

// grid num_rows, block kThreads, dynamic shared memory sizeof(Shared).
__global__ void __launch_bounds__(kThreads) SampleRowsKernel(float* logits, int vocab,
                                                             const PackedSamplingRow* rows,
                                                             PackedPenaltyEntry* entries, int out_stride,
                                                             uint32_t* out) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_bytes);
  const PackedSamplingRow p = rows[blockIdx.x];
  // Not __restrict__ nor read through the read-only cache: the penalties rewrite it below.
  float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  uint32_t* result = out + static_cast<size_t>(blockIdx.x) * out_stride;

  // 1. Logprobs of the raw row.
  float log_normalizer = 0;
  if (p.num_logprobs >= 0) {
    float m = -INFINITY;
    for (int t = threadIdx.x; t < vocab; t += kThreads) m = fmaxf(m, row[t]);
    const float max_raw = BlockMax(m, sh);
    double sum = 0;
    for (int t = threadIdx.x; t < vocab; t += kThreads) sum += ExpNonPositive(__fsub_rn(row[t], max_raw));
    sum = BlockSum(sum, sh);
    log_normalizer = __fadd_rn(max_raw, static_cast<float>(log(sum)));
    const int n = min(p.num_logprobs, vocab);
    if (n > 0) {
      auto raw = [&](int t, uint32_t* key, float* w) {
        *key = OrderedKey(row[t]);
        *w = 0;
        return true;
      };
      const Selected s = RadixSelect<false>(raw, vocab, n, 0.0, sh);
      Cut cut{true, s.key, TieCut<false>(raw, vocab, s, 0.0, sh)};
      if (threadIdx.x == 0) sh.top_count = 0;
      __syncthreads();
      for (int t = threadIdx.x; t < vocab; t += kThreads) {
        const uint32_t key = OrderedKey(row[t]);
        if (cut.Keeps(key, t)) {
          const int i = atomicAdd(&sh.top_count, 1);
          if (i < kMaxDeviceTopLogprobs) {
            sh.top_key[i] = key;
            sh.top_id[i] = t;
          }
        }
      }
      __syncthreads();
      SortListed(n, /*by_id=*/false, sh);
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const int t = sh.top_id[i];
        result[kSampledTopBegin + 2 * i] = static_cast<uint32_t>(t);
        result[kSampledTopBegin + 2 * i + 1] = __float_as_uint(__fsub_rn(row[t], log_normalizer));
      }
    }
    if (threadIdx.x == 0) result[kSampledNumTop] = static_cast<uint32_t>(n);
  }
  __syncthreads();  // every read of the raw row is done

  // 2. Bans and penalties (engine/sampling/sampler.cc ApplyPenalties), in place.
  const bool repetition = (p.flags & kPackedRepetition) != 0;
  const bool additive = (p.flags & kPackedAdditive) != 0;
  for (int i = p.entries_begin + threadIdx.x; i < p.entries_end; i += kThreads) {
    PackedPenaltyEntry& e = entries[i];
    float l = row[e.token];
    e.raw_logit = l;
    if (e.banned != 0) {
      l = -INFINITY;
    } else {
      if (repetition && l != -INFINITY)
        l = l > 0 ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
      if (additive && e.output_count > 0)
        l = __fsub_rn(l, __fadd_rn(p.presence_penalty,
                                   __fmul_rn(p.frequency_penalty, static_cast<float>(e.output_count))));
    }
    row[e.token] = l;
  }
  __syncthreads();

  // 3. The token.
  int chosen = 0;
  if ((p.flags & kPackedGreedy) != 0) {
    // The lowest id of the largest value; NaNs never win.
    float best = -INFINITY;
    int best_id = INT_MAX;
    for (int t = threadIdx.x; t < vocab; t += kThreads) {
      const float v = row[t];
      if (v > best || (v == best && t < best_id)) {
        best = v;
        best_id = t;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(kFull, best, o);
      const int oi = __shfl_xor_sync(kFull, best_id, o);
      if (ob > best || (ob == best && oi < best_id)) {
        best = ob;
        best_id = oi;
      }
    }
    if (Lane() == 0) {
      sh.reduce_f[Warp()] = best;
      sh.reduce_i[Warp()] = best_id;
    }
    __syncthreads();
    best = -INFINITY;
    best_id = INT_MAX;
    for (int w = 0; w < kWarps; ++w) {
      if (sh.reduce_f[w] > best || (sh.reduce_f[w] == best && sh.reduce_i[w] < best_id)) {
        best = sh.reduce_f[w];
        best_id = sh.reduce_i[w];
      }
    }
    chosen = best_id == INT_MAX ? 0 : best_id;
    __syncthreads();
  } else {
    const float inv_t = p.inv_temperature;
    float m = -INFINITY;
    int finite = 0;
    for (int t = threadIdx.x; t < vocab; t += kThreads) {
      const float x = __fmul_rn(row[t], inv_t);
      m = fmaxf(m, x);
      finite += x != -INFINITY;
    }
    const float max_x = BlockMax(m, sh);
    const int num_finite = BlockSumInt(finite, sh);
    if (num_finite > 0) {
      Cut cut;
      // Candidates: finite after the temperature, within the head so far.
      auto candidate = [&](int t, uint32_t* key, float* w) {
        const float x = __fmul_rn(row[t], inv_t);
        *key = OrderedKey(x);
        *w = ExpNonPositive(__fsub_rn(x, max_x));
        return x != -INFINITY && cut.Keeps(*key, t);
      };
      const bool min_p = (p.flags & kPackedMinP) != 0;
      const float threshold = __fadd_rn(max_x, p.log_min_p);
      if (p.top_k > 0 && p.top_k < num_finite) {
        const Selected s = RadixSelect<false>(candidate, vocab, p.top_k, 0.0, sh);
        const int id = TieCut<false>(candidate, vocab, s, 0.0, sh);
        cut = Cut{true, s.key, id};
      }
      if (cut.active && p.top_k <= kMaxDeviceTopLogprobs) {
        // Few candidates left: the rest in shared memory, serially as the CPU sampler does it.
        chosen = DrawListed(candidate, vocab, p, max_x, threshold, min_p, sh);
      } else {
        if ((p.flags & kPackedTopP) != 0) {
          double own = 0;
          for (int t = threadIdx.x; t < vocab; t += kThreads) {
            uint32_t key;
            float w;
            if (candidate(t, &key, &w)) own += w;
          }
          const double target = static_cast<double>(p.top_p) * BlockSum(own, sh);
          const Selected s = RadixSelect<true>(candidate, vocab, 0, target, sh);
          if (s.found) {
            const int id = TieCut<true>(candidate, vocab, s, target, sh);
            cut = Cut{true, s.key, id};
          }
        }
        auto kept = [&](int t, float* w) {
          uint32_t key;
          const bool in = candidate(t, &key, w);
          return in && (!min_p || __fmul_rn(row[t], inv_t) >= threshold);
        };
        chosen = DrawOverRow(kept, vocab, p.uniform, sh);
      }
    }
  }

  // 4. The chosen token's raw logprob: its logit before the penalties.
  if (p.num_logprobs >= 0) {
    if (threadIdx.x == 0) sh.chosen_raw_found = 0;
    __syncthreads();
    for (int i = p.entries_begin + threadIdx.x; i < p.entries_end; i += kThreads) {
      if (entries[i].token == chosen) {
        sh.chosen_raw = entries[i].raw_logit;
        sh.chosen_raw_found = 1;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const float raw = sh.chosen_raw_found != 0 ? sh.chosen_raw : row[chosen];
      result[kSampledLogprob] = __float_as_uint(__fsub_rn(raw, log_normalizer));
    }
  }
  if (threadIdx.x == 0) result[kSampledToken] = static_cast<uint32_t>(chosen);
}

__global__ void __launch_bounds__(256) MaskRowsKernel(float* logits, int vocab, const int32_t* row_ids,
                                                      const uint32_t* masks, int words, float* saved) {
  const int m = blockIdx.y;
  float* row = logits + static_cast<size_t>(row_ids[m]) * vocab;
  const uint32_t* mask = masks + static_cast<size_t>(m) * words;
  float* keep = saved + static_cast<size_t>(m) * vocab;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
    const float v = (mask[t >> 5] >> (t & 31)) & 1u ? row[t] : -INFINITY;
    row[t] = v;
    keep[t] = v;
  }
}

}  // namespace

absl::Status MaskRows(float* logits, int vocab, int num_masked, const int32_t* row_ids, const uint32_t* masks,
                      int words, float* saved, StreamHandle stream) {
  if (num_masked == 0) return absl::OkStatus();
  if (vocab < 1 || words < (vocab + 31) / 32 || num_masked > 65535)
    return absl::InvalidArgumentError("MaskRows: need vocab >= 1, ceil(vocab / 32) words a mask, at most 65535 rows");
  constexpr int kThreadsPerBlock = 256, kElementsPerThread = 4;
  const dim3 grid((vocab + kThreadsPerBlock * kElementsPerThread - 1) / (kThreadsPerBlock * kElementsPerThread),
                  num_masked);
  MaskRowsKernel<<<grid, kThreadsPerBlock, 0, S(stream)>>>(logits, vocab, row_ids, masks, words, saved);
  return LaunchStatus("MaskRows");
}

absl::Status SampleRows(float* logits, int vocab, int num_rows, const PackedSamplingRow* rows,
                        PackedPenaltyEntry* entries, int max_top, uint32_t* out, StreamHandle stream) {
  if (num_rows == 0) return absl::OkStatus();
  if (vocab < 1 || max_top < 0 || max_top > kMaxDeviceTopLogprobs)
    return absl::InvalidArgumentError("SampleRows: vocab must be >= 1 and max_top in [0, kMaxDeviceTopLogprobs]");
  static std::once_flag attribute_once;
  static cudaError_t attribute_error = cudaSuccess;
  std::call_once(attribute_once, [] {
    attribute_error = cudaFuncSetAttribute(SampleRowsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sizeof(Shared)));
  });
  EXL3_RETURN_IF_ERROR(exl3::cuda::CudaStatus(attribute_error, "SampleRows: shared memory attribute", __FILE__,
                                              __LINE__));
  SampleRowsKernel<<<num_rows, kThreads, sizeof(Shared), S(stream)>>>(logits, vocab, rows, entries,
                                                                      OutputWordsPerRow(max_top), out);
  return LaunchStatus("SampleRows");
}

}  // namespace exl3::engine::cuda

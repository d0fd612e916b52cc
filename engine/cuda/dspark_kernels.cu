#include "engine/cuda/dspark_kernels.h"

#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

// grid (S, key_rows), block 128: one key row of one draft.
__global__ void GatherKeysKernel(Dsv4CacheView c, DsparkDraftFacts f, const float* block_rows, int B, int key_rows,
                                 float* keys) {
  const int s = blockIdx.x, r = blockIdx.y, hist = f.hist[s], D = c.token_floats;
  if (r >= hist + B) return;
  const float* src;
  if (r < hist) {
    const int position = f.p0[s] - hist + r;
    const int32_t* table = f.tables + f.table_offset[s];
    src = c.layer + static_cast<size_t>(table[position / c.block_size]) * c.block_stride +
          static_cast<size_t>(position % c.block_size) * D;
  } else {
    src = block_rows + (static_cast<size_t>(s) * B + (r - hist)) * D;
  }
  float* dst = keys + (static_cast<size_t>(s) * key_rows + r) * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
}

// The better of two (value, index) candidates: the larger value, the lower index on ties.
__device__ inline void Better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// (value, index) of the block's best candidate, to every thread. blockDim.x a multiple of 32.
__device__ void BlockArgMax(float& v, int& i) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) Better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) Better(v, i, sv[w], si[w]);
  __syncthreads();
}

// grid (DsparkMarkovPartials(V), S), block kThreads, shared r floats: e = markov_w1[t_j]; thread v
// adds the Markov bias to logits[s * B + j, v]; the block's best (value, id) into the partials.
__global__ void MarkovBiasKernel(DsparkHeads h, int B, int j, float* logits, const int32_t* tokens,
                                 float* partial_max, int32_t* partial_arg) {
  extern __shared__ float e[];
  const int s = blockIdx.y, r = h.rank;
  const int token = tokens[static_cast<size_t>(s) * (B + 1) + j];
  for (int k = threadIdx.x; k < r; k += blockDim.x) e[k] = h.markov_w1[static_cast<size_t>(token) * r + k];
  __syncthreads();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  float best = -INFINITY;
  int arg = h.vocab;
  if (v < h.vocab) {
    const float* w2 = h.markov_w2 + static_cast<size_t>(v) * r;
    double dot = 0.0;
    for (int k = 0; k < r; ++k) dot += static_cast<double>(w2[k]) * e[k];
    float* l = logits + (static_cast<size_t>(s) * B + j) * h.vocab + v;
    *l += static_cast<float>(dot) + (h.markov_b2 != nullptr ? h.markov_b2[v] : 0.0f);
    best = *l;
    arg = v;
  }
  BlockArgMax(best, arg);
  if (threadIdx.x == 0) {
    partial_max[static_cast<size_t>(s) * gridDim.x + blockIdx.x] = best;
    partial_arg[static_cast<size_t>(s) * gridDim.x + blockIdx.x] = arg;
  }
}

// grid S, block kThreads: the row's arg max from the partials (n of them), then the confidence
// logit of block position j.
__global__ void MarkovPickKernel(DsparkHeads h, int B, int j, int n, const float* partial_max,
                                 const int32_t* partial_arg, const float* pre, int32_t* tokens, int32_t* drafts,
                                 float* confidence) {
  __shared__ double partial[32];
  const int s = blockIdx.x;
  float best = -INFINITY;
  int arg = h.vocab;
  for (int b = threadIdx.x; b < n; b += blockDim.x)
    Better(best, arg, partial_max[static_cast<size_t>(s) * n + b], partial_arg[static_cast<size_t>(s) * n + b]);
  BlockArgMax(best, arg);
  const int token = tokens[static_cast<size_t>(s) * (B + 1) + j];
  const size_t row = static_cast<size_t>(s) * B + j;
  const float* p = pre + row * h.hidden;
  const float* e = h.markov_w1 + static_cast<size_t>(token) * h.rank;
  double c = 0.0;
  for (int i = threadIdx.x; i < h.hidden; i += blockDim.x) c += static_cast<double>(h.conf_w[i]) * p[i];
  for (int k = threadIdx.x; k < h.rank; k += blockDim.x) c += static_cast<double>(h.conf_w[h.hidden + k]) * e[k];
  c = BlockSumDouble(c, partial);
  if (threadIdx.x == 0) {
    // No id out of range, even where a row held only NaN: the lowest id, as the CPU's loop leaves it.
    const int32_t chosen = arg < h.vocab ? arg : 0;
    tokens[static_cast<size_t>(s) * (B + 1) + j + 1] = chosen;
    drafts[row] = chosen;
    confidence[row] = static_cast<float>(c + h.conf_b);
  }
}

}  // namespace

absl::Status DsparkGatherKeys(const Dsv4CacheView& rows, const DsparkDraftFacts& facts, const float* block_rows,
                              int num_drafts, int B, int key_rows, float* keys, StreamHandle stream) {
  if (num_drafts == 0) return absl::OkStatus();
  if (key_rows < B || rows.token_floats <= 0)
    return absl::InvalidArgumentError(absl::StrCat("DSPARK keys: ", key_rows, " rows a draft for blocks of ", B));
  GatherKeysKernel<<<dim3(num_drafts, key_rows), 128, 0, S(stream)>>>(rows, facts, block_rows, B, key_rows, keys);
  return LaunchStatus("dspark key gather");
}

int DsparkMarkovPartials(int vocab) { return (vocab + kThreads - 1) / kThreads; }

absl::Status DsparkMarkovStep(const DsparkHeads& h, int num_drafts, int B, int j, const float* pre, float* logits,
                              int32_t* tokens, int32_t* drafts, float* confidence, float* partial_max,
                              int32_t* partial_arg, StreamHandle stream) {
  if (num_drafts == 0) return absl::OkStatus();
  if (j < 0 || j >= B || h.vocab <= 0 || h.rank <= 0 || h.rank > 12288)
    return absl::InvalidArgumentError(absl::StrCat("DSPARK Markov step ", j, " of ", B, " (vocab ", h.vocab,
                                                   ", rank ", h.rank, ")"));
  const int n = DsparkMarkovPartials(h.vocab);
  MarkovBiasKernel<<<dim3(n, num_drafts), kThreads, static_cast<size_t>(h.rank) * sizeof(float), S(stream)>>>(
      h, B, j, logits, tokens, partial_max, partial_arg);
  if (absl::Status st = LaunchStatus("dspark markov bias"); !st.ok()) return st;
  MarkovPickKernel<<<num_drafts, kThreads, 0, S(stream)>>>(h, B, j, n, partial_max, partial_arg, pre, tokens, drafts,
                                                  confidence);
  return LaunchStatus("dspark markov pick");
}

}  // namespace exl3::engine::cuda

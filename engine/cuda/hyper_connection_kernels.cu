#include "engine/cuda/hyper_connection_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/block_reduce.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxStreams = 16;

__device__ inline float SigmoidF(float x) { return 1.0f / (1.0f + expf(-x)); }

// mix[r] = fn[r] · (x / rms(x)) for r < rows, x [width] (NormedMixes of engine/cpu/residual/hyper_connections.cc).
__device__ void NormedMixes(const float* x, int width, float norm_eps, const float* fn, int rows,
                            float* mix /*shared*/, double* partial) {
  double ss = 0.0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) ss += static_cast<double>(x[i]) * x[i];
  ss = BlockSumDouble(ss, partial);
  const float inv = static_cast<float>(1.0 / sqrt(ss / width + norm_eps));
  for (int r = 0; r < rows; ++r) {
    const float* w = fn + static_cast<size_t>(r) * width;
    double acc = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) acc += static_cast<double>(w[i]) * (x[i] * inv);
    acc = BlockSumDouble(acc, partial);
    if (threadIdx.x == 0) mix[r] = static_cast<float>(acc);
  }
  __syncthreads();
}

// The collapse's sums over a token's N * H inputs, in kMixSplits ranges of the inputs each.
constexpr int kMixSplits = 16;

// grid (T, rows + 1, kMixSplits), block kThreads. partial [T, rows + 1, kMixSplits] double: for
// r < rows the split's Σ fn[r][i] · x[i], for r = rows its Σ x[i]²; x = streams [T, N * H] row t.
__global__ void MixPartialsKernel(const float* fn, int rows, int width, const float* streams, double* partial) {
  __shared__ double red[32];
  const int t = blockIdx.x, r = blockIdx.y, s = blockIdx.z;
  const int per = (width + kMixSplits - 1) / kMixSplits;
  const int begin = s * per, end = min(width, begin + per);
  const float* x = streams + static_cast<size_t>(t) * width;
  const float* w = r < rows ? fn + static_cast<size_t>(r) * width : x;
  double acc = 0.0;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) acc += static_cast<double>(w[i]) * x[i];
  acc = BlockSumDouble(acc, red);
  if (threadIdx.x == 0) partial[(static_cast<size_t>(t) * (rows + 1) + r) * kMixSplits + s] = acc;
}

// Blocks a token's hidden vector is split over (a block per 256 elements: one per token is far
// too few for one decode token).
int HiddenBlocks(int H) { return std::min((H + kThreads - 1) / kThreads, 64); }

// A thread's elements of a hidden vector split over gridDim.y blocks: from HiddenFirst() on, every
// HiddenStride()-th.
__device__ __forceinline__ int HiddenFirst() { return blockIdx.y * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int HiddenStride() { return gridDim.y * blockDim.x; }

// grid (T, HiddenBlocks(H)), block kThreads; dynamic shared: (2 + N) * N + N + N * N floats.
// streams [T, N, H]; partial as MixPartialsKernel wrote it; out [T, H]; post [T, N]; comb
// [T, N, N]. mix[r] = fn[r] · x / rms(x). Every block forms the token's pre weights for its part
// of out; the first also post and comb (Sinkhorn: lane j of warp 0 normalises row j, then column
// j, each in the CPU's order).
__global__ void CollapseKernel(HyperConnectionArgs a, const float* streams, const double* partial, float* out,
                               float* post, float* comb) {
  extern __shared__ float hc_smem[];
  const int n = a.streams, H = a.hidden, width = n * H, rows = (2 + n) * n;
  const bool first_block = blockIdx.y == 0;
  float* mix = hc_smem;
  float* pre = mix + rows;
  float* cm = pre + n;
  const float* x = streams + static_cast<size_t>(blockIdx.x) * width;
  const double* p = partial + static_cast<size_t>(blockIdx.x) * (rows + 1) * kMixSplits;
  __shared__ double inv_rms;
  if (threadIdx.x == 0) {
    double ss = 0.0;
    for (int s = 0; s < kMixSplits; ++s) ss += p[static_cast<size_t>(rows) * kMixSplits + s];
    inv_rms = 1.0 / sqrt(ss / width + a.norm_eps);
  }
  __syncthreads();
  for (int r = threadIdx.x; r < (first_block ? rows : n); r += blockDim.x) {
    double sum = 0.0;
    for (int s = 0; s < kMixSplits; ++s) sum += p[static_cast<size_t>(r) * kMixSplits + s];
    mix[r] = static_cast<float>(sum * inv_rms);
  }
  __syncthreads();
  const float eps = a.eps;
  if (threadIdx.x < n) pre[threadIdx.x] = SigmoidF(mix[threadIdx.x] * a.scale[0] + a.base[threadIdx.x]) + eps;
  if (first_block && threadIdx.x < 32) {
    const int j = threadIdx.x;
    float* row = cm + j * n;
    if (j < n) {
      post[static_cast<size_t>(blockIdx.x) * n + j] = 2.0f * SigmoidF(mix[n + j] * a.scale[1] + a.base[n + j]);
      float mx = -INFINITY;
      for (int k = 0; k < n; ++k) {
        row[k] = mix[2 * n + j * n + k] * a.scale[2] + a.base[2 * n + j * n + k];
        mx = fmaxf(mx, row[k]);
      }
      float sum = 0.0f;
      for (int k = 0; k < n; ++k) sum += (row[k] = expf(row[k] - mx));
      for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
    }
    __syncwarp();
    for (int it = 0; it < a.sinkhorn_iters; ++it) {
      if (it > 0) {  // rows, from the second round on (the first normalises the columns only)
        if (j < n) {
          float sum = 0.0f;
          for (int k = 0; k < n; ++k) sum += row[k];
          for (int k = 0; k < n; ++k) row[k] /= sum + eps;
        }
        __syncwarp();
      }
      if (j < n) {  // column j
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) sum += cm[i * n + j];
        for (int i = 0; i < n; ++i) cm[i * n + j] /= sum + eps;
      }
      __syncwarp();
    }
    if (j < n) {
      float* c = comb + static_cast<size_t>(blockIdx.x) * n * n + j * n;
      for (int k = 0; k < n; ++k) c[k] = row[k];
    }
  }
  __syncthreads();
  float* y = out + static_cast<size_t>(blockIdx.x) * H;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += pre[i] * x[static_cast<size_t>(i) * H + d];
    y[d] = acc;
  }
}

// grid (T, HiddenBlocks(H)), block kThreads. In place on streams [T, N, H]; post [T, N], comb
// [T, N, N], o [T, H].
__global__ void ExpandKernel(const float* post, const float* comb, const float* o, int n, int H,
                             float* streams) {
  __shared__ float p[kMaxStreams], c[kMaxStreams * kMaxStreams];
  const size_t t = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = post[t * n + i];
  for (int i = threadIdx.x; i < n * n; i += blockDim.x) c[i] = comb[t * n * n + i];
  __syncthreads();
  float* s = streams + t * n * H;
  const float* ot = o + t * H;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    float in[kMaxStreams];
    for (int j = 0; j < n; ++j) in[j] = s[static_cast<size_t>(j) * H + d];
    const float od = ot[d];
    for (int k = 0; k < n; ++k) {
      float acc = 0.0f;
      for (int j = 0; j < n; ++j) acc += c[j * n + k] * in[j];
      s[static_cast<size_t>(k) * H + d] = p[k] * od + acc;
    }
  }
}

// grid R, block kThreads; dynamic shared: N floats. streams [T, N, H]; rows [R]; out [R, H].
__global__ void HeadCollapseKernel(const float* fn, const float* base, float scale, int n, int H, float eps,
                                   float norm_eps, const float* streams, const int32_t* rows, float* out) {
  extern __shared__ float head_smem[];
  __shared__ double partial[32];
  const int width = n * H;
  const float* x = streams + static_cast<size_t>(rows[blockIdx.x]) * width;
  NormedMixes(x, width, norm_eps, fn, n, head_smem, partial);
  float* y = out + static_cast<size_t>(blockIdx.x) * H;
  for (int d = threadIdx.x; d < H; d += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float pre = SigmoidF(head_smem[i] * scale + base[i]) + eps;
      acc += pre * x[static_cast<size_t>(i) * H + d];
    }
    y[d] = acc;
  }
}

// grid (R, HiddenBlocks(H)), block kThreads. streams [T, N, H]; rows [R]; out [R, H] = the mean
// of row rows[r]'s streams, summed in stream order and divided by N as HyperHead::Collapse's kMean
// does.
__global__ void MeanCollapseKernel(int n, int H, const float* streams, const int32_t* rows, float* out) {
  const float* x = streams + static_cast<size_t>(rows[blockIdx.x]) * n * H;
  float* y = out + static_cast<size_t>(blockIdx.x) * H;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += x[static_cast<size_t>(i) * H + d];
    y[d] = acc / static_cast<float>(n);
  }
}

// grid (T, HiddenBlocks(H)), block kThreads.
__global__ void BroadcastKernel(const float* x, int n, int H, float* streams) {
  const size_t t = blockIdx.x;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    const float v = x[t * H + d];
    for (int k = 0; k < n; ++k) streams[(t * n + k) * H + d] = v;
  }
}

absl::Status CheckStreams(int n) {
  if (n < 1 || n > kMaxStreams)
    return absl::InvalidArgumentError(absl::StrCat("hyper-connections: ", n, " streams (1 to ", kMaxStreams,
                                                   " on the GPU)"));
  return absl::OkStatus();
}

}  // namespace

absl::Status HyperCollapse(const HyperConnectionArgs& a, const float* streams, int T, float* block_input,
                           float* post, float* comb, double* scratch, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(a.streams); !st.ok()) return st;
  const int rows = (2 + a.streams) * a.streams;
  MixPartialsKernel<<<dim3(T, rows + 1, kMixSplits), kThreads, 0, S(stream)>>>(a.fn, rows, a.streams * a.hidden,
                                                                                streams, scratch);
  if (absl::Status st = LaunchStatus("hyper-connection mix sums"); !st.ok()) return st;
  const size_t smem = static_cast<size_t>(rows + a.streams + a.streams * a.streams) * sizeof(float);
  CollapseKernel<<<dim3(T, HiddenBlocks(a.hidden)), kThreads, smem, S(stream)>>>(a, streams, scratch, block_input,
                                                                                  post, comb);
  return LaunchStatus("hyper-connection collapse");
}

size_t HyperCollapseScratchDoubles(const HyperConnectionArgs& a, int T) {
  return static_cast<size_t>(T) * ((2 + a.streams) * a.streams + 1) * kMixSplits;
}

absl::Status HyperExpand(const float* post, const float* comb, const float* block_output, int T, int n,
                         int hidden, float* streams, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  ExpandKernel<<<dim3(T, HiddenBlocks(hidden)), kThreads, 0, S(stream)>>>(post, comb, block_output, n, hidden,
                                                                           streams);
  return LaunchStatus("hyper-connection expand");
}

absl::Status HyperHeadCollapse(const float* fn, const float* base, float scale, int n, int hidden, float eps,
                               float norm_eps, const float* streams, const int32_t* rows, int R, float* out,
                               StreamHandle stream) {
  if (R == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  HeadCollapseKernel<<<R, kThreads, n * sizeof(float), S(stream)>>>(fn, base, scale, n, hidden, eps, norm_eps,
                                                                    streams, rows, out);
  return LaunchStatus("hyper-connection head");
}

absl::Status HyperMeanCollapse(int n, int hidden, const float* streams, const int32_t* rows, int R, float* out,
                               StreamHandle stream) {
  if (R == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  MeanCollapseKernel<<<dim3(R, HiddenBlocks(hidden)), kThreads, 0, S(stream)>>>(n, hidden, streams, rows, out);
  return LaunchStatus("hyper-connection mean head");
}

absl::Status BroadcastStreams(const float* x, int T, int n, int hidden, float* streams, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  BroadcastKernel<<<dim3(T, HiddenBlocks(hidden)), kThreads, 0, S(stream)>>>(x, n, hidden, streams);
  return LaunchStatus("hyper-connection streams");
}

}  // namespace exl3::engine::cuda

#include "engine/cuda/gated_residual_kernels.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float SigmoidF(float x) { return 1.0f / (1.0f + expf(-x)); }

cudaStream_t CudaStream(StreamHandle stream) { return S(stream); }

int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

absl::Status CheckShape(const char* what, int num_tokens, int streams, int hidden) {
  if (num_tokens < 0 || streams < 1 || hidden < 1)
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", num_tokens, " tokens of ", streams, " streams of ", hidden, " values"));
  return absl::OkStatus();
}

// grid T * S, block kThreads: one stream of one token.
__global__ void StreamNormKernel(const float* h, const int32_t* rows, int S, int H, const float* weight, float eps,
                                 float* normed) {
  __shared__ double partial[32];
  const int t = blockIdx.x / S, k = blockIdx.x % S;
  const int src = rows != nullptr ? rows[t] : t;
  const float* x = h + (static_cast<size_t>(src) * S + k) * H;
  const float* w = weight + static_cast<size_t>(k) * H;
  float* y = normed + (static_cast<size_t>(t) * S + k) * H;
  double ss = 0.0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss += static_cast<double>(x[i]) * x[i];
  ss = BlockSumDouble(ss, partial);
  const float inv = static_cast<float>(1.0 / sqrt(ss / H + eps));
  for (int i = threadIdx.x; i < H; i += blockDim.x) y[i] = w[i] * (x[i] * inv);
}

__global__ void LowRankSiluKernel(float* low, int64_t n, float inv_streams) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = low[i] * inv_streams;
  low[i] = v * SigmoidF(v);
}

// One thread per (token, hidden index).
__global__ void StreamMixKernel(const float* w, const float* normed, int64_t T, int S, int H, float inv_streams,
                                float* x) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= T * H) return;
  const int64_t t = j / H;
  const int i = static_cast<int>(j % H);
  const float* wt = w + t * S * H;
  const float* nt = normed + t * S * H;
  float acc = 0.0f;
  for (int k = 0; k < S; ++k) acc += SigmoidF(wt[static_cast<int64_t>(k) * H + i]) * nt[static_cast<int64_t>(k) * H + i];
  x[j] = acc * inv_streams;
}

__global__ void InjectWeightsKernel(float* inject, int64_t n, float inv_streams) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  inject[i] = 2.0f * SigmoidF(inject[i] * inv_streams);
}

// One thread per (token, stream, hidden index).
__global__ void ExpandKernel(const float* inject, const float* out, int64_t T, int S, int H, float* h) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= T * S * H) return;
  const int64_t tk = j / H;  // t * S + k
  const int i = static_cast<int>(j % H);
  const int64_t t = tk / S;
  h[j] += inject[tk] * out[t * H + i];
}

}  // namespace

absl::Status GatedStreamNorm(const float* h, const int32_t* rows, int T, int S, int H, const float* weight, float eps,
                             float* normed, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedStreamNorm", T, S, H); !s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  StreamNormKernel<<<T * S, kThreads, 0, CudaStream(stream)>>>(h, rows, S, H, weight, eps, normed);
  return LaunchStatus("GatedStreamNorm");
}

absl::Status GatedLowRankSilu(float* low, int64_t n, int S, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedLowRankSilu", 0, S, 1); !s.ok()) return s;
  if (n <= 0) return absl::OkStatus();
  LowRankSiluKernel<<<Blocks(n), kThreads, 0, CudaStream(stream)>>>(low, n, 1.0f / static_cast<float>(S));
  return LaunchStatus("GatedLowRankSilu");
}

absl::Status GatedStreamMix(const float* w, const float* normed, int T, int S, int H, float* x, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedStreamMix", T, S, H); !s.ok()) return s;
  const int64_t n = static_cast<int64_t>(T) * H;
  if (n == 0) return absl::OkStatus();
  StreamMixKernel<<<Blocks(n), kThreads, 0, CudaStream(stream)>>>(w, normed, T, S, H, 1.0f / static_cast<float>(S), x);
  return LaunchStatus("GatedStreamMix");
}

absl::Status GatedInjectWeights(float* inject, int64_t n, int S, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedInjectWeights", 0, S, 1); !s.ok()) return s;
  if (n <= 0) return absl::OkStatus();
  InjectWeightsKernel<<<Blocks(n), kThreads, 0, CudaStream(stream)>>>(inject, n, 1.0f / static_cast<float>(S));
  return LaunchStatus("GatedInjectWeights");
}

absl::Status GatedExpand(const float* inject, const float* out, int T, int S, int H, float* h, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedExpand", T, S, H); !s.ok()) return s;
  const int64_t n = static_cast<int64_t>(T) * S * H;
  if (n == 0) return absl::OkStatus();
  ExpandKernel<<<Blocks(n), kThreads, 0, CudaStream(stream)>>>(inject, out, T, S, H, h);
  return LaunchStatus("GatedExpand");
}

}  // namespace exl3::engine::cuda

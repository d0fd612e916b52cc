#include "engine/cuda/gated_residual_kernels.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

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

// Every kernel here is launched with PDL (kernels/cuda/launch.cuh) and waits for its predecessor first.

// grid T * S, block kThreads: one stream of one token.
__global__ void StreamNormKernel(const float* h, const int32_t* rows, int S, int H, const float* weight, float eps,
                                 float* normed) {
  exl3::cuda::PdlEnter();
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

// One thread per element of low [n_low] then of inject [n_inject] (which may be empty).
__global__ void ActivationsKernel(float* low, int64_t n_low, float* inject, int64_t n_inject, float inv_streams) {
  exl3::cuda::PdlEnter();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n_low) {
    const float v = low[i] * inv_streams;
    low[i] = v * SigmoidF(v);
  } else if (i - n_low < n_inject) {
    inject[i - n_low] = 2.0f * SigmoidF(inject[i - n_low] * inv_streams);
  }
}

// One thread per (token, hidden index).
__global__ void StreamMixKernel(const float* w, const float* normed, int64_t T, int S, int H, float inv_streams,
                                float* x) {
  exl3::cuda::PdlEnter();
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

// One thread per (token, stream, hidden index).
__global__ void ExpandKernel(const float* inject, const float* out, int64_t T, int S, int H, float* h) {
  exl3::cuda::PdlEnter();
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
  exl3::cuda::LaunchPdl(StreamNormKernel, dim3(T * S), dim3(kThreads), CudaStream(stream), h, rows, S, H, weight, eps,
                        normed);
  return LaunchStatus("GatedStreamNorm");
}

absl::Status GatedActivations(float* low, int64_t n_low, float* inject, int64_t n_inject, int S,
                              StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedActivations", 0, S, 1); !s.ok()) return s;
  if (n_low < 0 || n_inject < 0)
    return absl::InvalidArgumentError(absl::StrCat("GatedActivations: ", n_low, " and ", n_inject, " values"));
  if (n_low + n_inject == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ActivationsKernel, dim3(Blocks(n_low + n_inject)), dim3(kThreads), CudaStream(stream), low,
                        n_low, inject, n_inject, 1.0f / static_cast<float>(S));
  return LaunchStatus("GatedActivations");
}

absl::Status GatedStreamMix(const float* w, const float* normed, int T, int S, int H, float* x, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedStreamMix", T, S, H); !s.ok()) return s;
  const int64_t n = static_cast<int64_t>(T) * H;
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(StreamMixKernel, dim3(Blocks(n)), dim3(kThreads), CudaStream(stream), w, normed,
                        static_cast<int64_t>(T), S, H, 1.0f / static_cast<float>(S), x);
  return LaunchStatus("GatedStreamMix");
}

absl::Status GatedExpand(const float* inject, const float* out, int T, int S, int H, float* h, StreamHandle stream) {
  if (absl::Status s = CheckShape("GatedExpand", T, S, H); !s.ok()) return s;
  const int64_t n = static_cast<int64_t>(T) * S * H;
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ExpandKernel, dim3(Blocks(n)), dim3(kThreads), CudaStream(stream), inject, out,
                        static_cast<int64_t>(T), S, H, h);
  return LaunchStatus("GatedExpand");
}

}  // namespace exl3::engine::cuda

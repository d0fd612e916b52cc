#include "engine/cuda/ple_kernels.h"

#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/recurrent_chunks.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float SigmoidF(float x) { return 1.0f / (1.0f + expf(-x)); }

// Input p of chunk c's conv window for channel col: carried for p < past, else its row p − past.
__device__ inline float WindowInput(const float* normed, const RecurrentChunks& ch, const RecurrentChunk& c, int past,
                                    int wide, int p, int col) {
  if (p >= past) return normed[static_cast<int64_t>(c.first + p - past) * wide + col];
  return ch.states[static_cast<int64_t>(c.read_row) * ch.row_floats + static_cast<int64_t>(p) * wide + col];
}

// grid n · S, block kThreads: one (row, stream).
__global__ void GateKernel(const float* key, const float* query, const float* value, int S, int H, int first,
                           float* v) {
  exl3::cuda::PdlEnter();
  __shared__ double partial[32];
  const int t = first + blockIdx.x / S, k = blockIdx.x % S;
  const int64_t at = (static_cast<int64_t>(t) * S + k) * H;
  double dot = 0.0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) dot += static_cast<double>(key[at + i]) * query[at + i];
  dot = BlockSumDouble(dot, partial);
  float g = static_cast<float>(dot) * (1.0f / sqrtf(static_cast<float>(H)));
  g = copysignf(sqrtf(fmaxf(fabsf(g), 1e-6f)), g) * (g == 0.0f ? 0.0f : 1.0f);
  const float gate = SigmoidF(g);
  const float* vt = value + static_cast<int64_t>(t) * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) v[at + i] = gate * vt[i];
}

// One thread per (row, channel).
__global__ void ConvKernel(const float* v, const float* normed, const float* w, PleShape s, RecurrentChunks ch,
                           int first, int n, float* h) {
  exl3::cuda::PdlEnter();
  const int wide = s.wide();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(n) * wide) return;
  const int t = first + static_cast<int>(item / wide), col = static_cast<int>(item % wide);
  const RecurrentChunk c = LoadChunk(ch, ch.chunk_of[t]);
  const int j = t - c.first, past = s.past();
  const float* wc = w + static_cast<int64_t>(col) * s.conv_kernel;
  float acc = 0.0f;
  for (int i = 0; i < s.conv_kernel; ++i) acc += wc[i] * WindowInput(normed, ch, c, past, wide, j + i * s.ngram_size, col);
  const int64_t at = static_cast<int64_t>(t) * wide + col;
  h[at] += v[at] + acc * SigmoidF(acc);
}

// One thread per (chunk, carried input, channel). A verify chunk's kept state k (after its first
// f = first_kept_token + k + 1 tokens) carries the `past` inputs before window input f + past.
__global__ void ConvStateKernel(const float* normed, PleShape s, RecurrentChunks ch, int first_chunk, int num_chunks) {
  exl3::cuda::PdlEnter();
  const int wide = s.wide(), past = s.past();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(num_chunks) * past * wide) return;
  const int chunk = first_chunk + static_cast<int>(item / (static_cast<int64_t>(past) * wide));
  const int p = static_cast<int>(item / wide % past), col = static_cast<int>(item % wide);
  const RecurrentChunk c = LoadChunk(ch, chunk);
  for (int k = 0; k < c.kept_states; ++k) {
    const int folded = c.first_kept_token() + k + 1;
    StateRow(ch, c.KeptRow(k))[static_cast<int64_t>(p) * wide + col] =
        WindowInput(normed, ch, c, past, wide, folded + p, col);
  }
}

unsigned Blocks(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

absl::Status CheckShape(const char* what, const PleShape& s) {
  if (s.streams < 1 || s.hidden < 1 || s.conv_kernel < 1 || s.ngram_size < 1)
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.streams, " streams of ", s.hidden, ", conv of ",
                                                   s.conv_kernel, " taps dilated by ", s.ngram_size));
  return absl::OkStatus();
}

}  // namespace

absl::Status PleGate(const float* key, const float* query, const float* value, const PleShape& s, int first, int n,
                     float* v, StreamHandle stream) {
  if (absl::Status st = CheckShape("PLE gate", s); !st.ok()) return st;
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(GateKernel, dim3(static_cast<unsigned>(n) * s.streams), dim3(kThreads), S(stream), key, query,
                        value, s.streams, s.hidden, first, v);
  return LaunchStatus("PLE gate");
}

absl::Status PleConv(const float* v, const float* normed, const float* conv_weight, const PleShape& s,
                     const RecurrentChunks& chunks, int first, int n, float* h, StreamHandle stream) {
  if (absl::Status st = CheckShape("PLE conv", s); !st.ok()) return st;
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ConvKernel, dim3(Blocks(static_cast<int64_t>(n) * s.wide())), dim3(kThreads), S(stream), v,
                        normed, conv_weight, s, chunks, first, n, h);
  return LaunchStatus("PLE conv");
}

absl::Status PleConvState(const float* normed, const PleShape& s, const RecurrentChunks& chunks, int first_chunk,
                          int num_chunks, StreamHandle stream) {
  if (absl::Status st = CheckShape("PLE conv state", s); !st.ok()) return st;
  const int64_t items = static_cast<int64_t>(num_chunks) * s.past() * s.wide();
  if (items <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ConvStateKernel, dim3(Blocks(items)), dim3(kThreads), S(stream), normed, s, chunks, first_chunk,
                        num_chunks);
  return LaunchStatus("PLE conv state");
}

}  // namespace exl3::engine::cuda

// The device kernels of Qwen4-Exp's PLE layer (engine/cuda/cuda_ple_layer.h runs them between its
// projections and the per-stream norms of engine/cuda/gated_residual_kernels.h; the CPU engine's
// engine/cpu/residual/ple_layer.h states the arithmetic), fp32 in the CPU's order. Host launchers only: this
// header includes no CUDA header; every pointer is device memory, every launch goes on `stream`,
// none synchronises or allocates, and 0 rows launch nothing. Rows are the step's: a launch runs rows
// [first, first + n) (and the chunks of those rows) of buffers laid out for the whole step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/recurrent_chunks.h"

// The shape's helpers compile for the kernels too (nvcc) without a CUDA header here.
#if defined(__CUDACC__)
#define EXL3_PLE_HD __host__ __device__
#else
#define EXL3_PLE_HD
#endif

namespace exl3::engine::cuda {

struct PleShape {
  int streams = 0, hidden = 0;  // S, H: a token's residual is S · H floats (`wide`)
  int conv_kernel = 0;          // K taps, dilated by ngram_size
  int ngram_size = 0;
  EXL3_PLE_HD int wide() const { return streams * hidden; }
  EXL3_PLE_HD int past() const { return (conv_kernel - 1) * ngram_size; }  // conv inputs a sequence carries
};

// v [T, S, H]: per token t and stream k, g = Σ_i key[t, k, i] · query[t, k, i] (in double) / √H,
// g ← sign(g) · √max(|g|, 1e-6), v[t, k] = sigmoid(g) · value[t]. key, query [T, S, H] (normed),
// value [T, H].
absl::Status PleGate(const float* key, const float* query, const float* value, const PleShape& shape, int first,
                     int n, float* v, StreamHandle stream);

// h [T, S · H] += v + silu(conv) per channel c: conv = Σ_i w[c, i] · u(j + i · ngram_size, c) for a
// row at index j of its chunk, u(p, c) the chunk's window: the carried input p for p < past (from
// the chunk's read row of `chunks.states`, [past, S · H] there), else normed[chunk first + p − past].
// conv_weight [S · H, K]; normed, v [T, S · H].
absl::Status PleConv(const float* v, const float* normed, const float* conv_weight, const PleShape& shape,
                     const RecurrentChunks& chunks, int first, int n, float* h, StreamHandle stream);

// The conv inputs each chunk of [first_chunk, first_chunk + num_chunks) leaves to its sequence: its
// window's last `past` inputs, written to its write row of `chunks.states`; a verify chunk's after
// each of its kept tokens, to their rows (engine/cuda/recurrent_chunks.h).
absl::Status PleConvState(const float* normed, const PleShape& shape, const RecurrentChunks& chunks, int first_chunk,
                          int num_chunks, StreamHandle stream);

}  // namespace exl3::engine::cuda

// The delta-rule recurrence of the GPU's recurrent layers, one kernel for Qwen3-Next's gated
// DeltaNet (engine/cuda/deltanet_kernels.h: one decay per head) and GLM-5.3-Flash's KDA
// (engine/cuda/kda_kernels.h: one decay per key channel). Per chunk (engine/cuda/recurrent_chunks.h)
// and value head h, with S [key_head_dim, value_head_dim] fp32 read from the chunk's read_row:
//
//   per token t:  S ← diag(g_t) · S          g: the head's decay, or per key channel
//                 S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)
//                 core[t, h] = Sᵀ q_t
//   S to the chunk's write_row (a verify chunk's: also after each of its other kept tokens, to
//   their rows, engine/cuda/recurrent_chunks.h).
//
// Each column of S (a value channel) evolves alone, so the kernel spreads them: a block holds 32
// columns of one (chunk, head) in registers (eight lanes per column, 16 key rows each, two partial
// sums a lane) and stages the tokens' k, q, g, v and β in shared memory 8 at a time (the next 8
// loading into registers meanwhile); the sums over key rows end in three warp shuffles. Host
// launcher only: no CUDA header here.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/recurrent_chunks.h"

namespace exl3::engine::cuda {

// Where the recurrence finds its inputs in the layer's conv output and its state in a store row.
struct DeltaRuleShape {
  int num_heads = 0;           // value heads, each with its own S
  int heads_per_key_head = 1;  // value heads h share key head h / heads_per_key_head's q and k
  int key_head_dim = 0, value_head_dim = 0;
  int row_floats = 0;          // conv_out's row stride
  int q_at = 0, k_at = 0;      // q and k of key head 0 in a conv_out row (key head g at + g · key_head_dim)
  int v_at = 0;                // v of value head 0 (head h at + h · value_head_dim)
  int64_t state_at = 0;        // S of head 0 in the layer's part of a store row ([heads, DK, DV])
};

// What `decay` holds.
enum class DeltaRuleDecay {
  kPerHead,             // [step rows, num_heads]: the factor g
  kPerKeyChannelLog,    // [step rows, num_heads · key_head_dim]: log g
};

// The recurrence of chunks [first_chunk, first_chunk + num_chunks). conv_out [step rows,
// row_floats] fp32 (q and k normalised); beta [step rows, num_heads] fp32; decay as `form` says;
// core [step rows, num_heads · value_head_dim] fp32 (written for the chunks' rows).
absl::Status DeltaRuleRecurrence(const float* conv_out, const float* beta, const float* decay,
                                 DeltaRuleDecay form, const DeltaRuleShape& shape,
                                 const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                                 float* core, StreamHandle stream);

// Whether the kernel takes `shape` (key_head_dim at most 128, heads dividing evenly).
absl::Status CheckDeltaRuleShape(const DeltaRuleShape& shape);

}  // namespace exl3::engine::cuda

// One layer of DeepSeek-V4's attention on the GPU: the CPU engine's engine/cpu/attention/dsv4_attention.h (which
// says what it computes: shared-KV MQA over the sliding window plus, on compressed layers, the
// compressed entries, with its compressors and CSA's indexer) on device memory, for CudaModel
// (engine/cuda/cuda_model.h). Kernels: engine/cuda/dsv4_attention_kernels.h.
//
// The cache is fp32 in the CPU engine's layout (engine/cpu/paged_kv_cache.h with engine/config/dsv4_config.h's
// Dsv4CacheLayout): the same block holds the same positions' kv and the same compressor state, so
// a sequence stops and resumes at any token (prefill, decode, prefill again) and full blocks can be
// shared, as on the CPU. The linear layers go through CudaLinear (EXL3 or dense); the grouped
// low-rank output projection's wo_a is decoded once at load into a dense fp32 copy (as the CPU
// engine decodes it) and runs as one batched cuBLAS product over the groups. Verify chunks
// (speculative decoding): the compressors keep their accumulators after each verify row in the
// layer's kept rows (Dsv4CacheView::kept, Dsv4Step::chunk_keeping) and the sequence's next chunk
// restores the accepted length's before folding on, as the CPU engine's layer does
// (engine/cuda/dsv4_kept_row_slots.h).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/dsv4_attention_kernels.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/model_config.h"
#include "engine/cpu/rope.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// Device buffers every V4 layer of a model shares, grown to the largest step.
struct Dsv4Workspace {
  DeviceArray<float> q_resid, q, kv, attn, low_rank, comp_kv, comp_gate, ix_kv, ix_gate, ix_q, ix_w, scores;
  DeviceArray<int32_t> selected, selected_count;  // CSA: [T, index_topk], [T]
  int score_rows = 0;    // tokens whose index scores fit `scores` at once
  int score_length = 0;  // floats per score row: the most CSA entries a sequence can have

  // For a step of `num_tokens` tokens, contexts up to `max_context` positions.
  absl::Status Reserve(const ModelConfig& cfg, int num_tokens, int max_context);
};

// What a step gives every V4 layer besides the cache: the step's device facts.
struct Dsv4Step {
  AttentionTokens tokens;                // position, first_visible (the sliding window), tables
  const int32_t* chunk_start = nullptr;  // [num_chunks + 1]: each chunk's first token, then T
  int num_chunks = 0;
  // [T, rope_dim / 2] each: rope "main" and "compress" at each token's position, and "compress"
  // at the first position of its CSA / HCA window ((position / m) * m: where a closing window's
  // entry is rotated).
  const float *main_cos = nullptr, *main_sin = nullptr, *compress_cos = nullptr, *compress_sin = nullptr;
  const float *csa_entry_cos = nullptr, *csa_entry_sin = nullptr, *hca_entry_cos = nullptr,
              *hca_entry_sin = nullptr;
  const int32_t* csa_last_entry = nullptr;  // [T]: (position + 1) / m_csa - 1
  int32_t* error = nullptr;                 // the compressors' fold's code (Dsv4Fold), 0 if none
  // With speculative decoding: each chunk's keeping [num_chunks, kDsv4KeepingInts]
  // (engine/cuda/dsv4_kept_row_slots.h); else null.
  const int32_t* chunk_keeping = nullptr;
  int sm_count = 1;
};

// Packs a step's V4 facts on the host, copies them to the device in one transfer, and keeps the
// fold's error word.
class Dsv4StepFacts {
 public:
  explicit Dsv4StepFacts(const ModelConfig& cfg);
  absl::Status Init();  // allocates the error word (zero)
  // *step: `base` (CudaModel's positions, windows, tables) and the rest from `tokens`.
  absl::Status Prepare(const StepTokens& tokens, const AttentionTokens& base, int sm_count, StreamHandle stream,
                       Dsv4Step* step);
  // After the step's synchronisation: the fold's error as the CPU engine words it (then cleared on
  // `stream`, before the next step's work).
  absl::Status TakeError(StreamHandle stream);

 private:
  const Dsv4Config& v4_;
  Rope main_, compress_;
  std::vector<int32_t> host_;
  DeviceArray<int32_t> device_, error_;
};

class CudaDsv4Attention {
 public:
  static absl::StatusOr<std::unique_ptr<CudaDsv4Attention>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                 int layer);
  // out [T, hidden] = the layer's attention of x [T, hidden] (input-normalised); writes the step's
  // kv and compressor state into `cache` (this layer's) first.
  absl::Status Forward(const float* x, int num_tokens, const Dsv4Step& step, const Dsv4CacheView& cache,
                       Dsv4Workspace& ws, const CudaLinearContext& ctx, float* out) const;

  int64_t weight_bytes() const;
  std::vector<const CudaLinear*> linears() const;

 private:
  struct Compressor {
    CudaLinear wkv, wgate;
    DeviceArray<float> ape, norm;
    int dim = 0, width = 0;
  };
  struct Indexer {
    CudaLinear wq_b, weights_proj;
    Compressor compressor;
  };
  CudaDsv4Attention(const ModelConfig& cfg, int layer);

  const ModelConfig& cfg_;
  const Dsv4Config& v4_;
  int layer_;
  Dsv4LayerType type_;
  int rate_ = 0;
  CudaLinear wq_a_, wq_b_, wkv_, wo_b_;
  DeviceArray<float> wo_a_;  // [o_groups * o_lora_rank, heads * head_dim / o_groups] fp32
  DeviceArray<float> q_norm_, kv_norm_, sinks_;
  std::optional<Compressor> compressor_;
  std::optional<Indexer> indexer_;
};

}  // namespace exl3::engine::cuda

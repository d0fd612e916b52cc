// One layer's latent attention on the GPU: DeepSeek-V3 multi-head latent attention
// (engine/cpu/attention/mla_attention.h) and GLM-MoE-DSA's, whose queries see only the positions its lightning
// indexer chooses (engine/cpu/attention/dsa_attention.h). The same arithmetic as the CPU engine's, on device
// memory, for CudaModel (engine/cuda/cuda_model.h):
//
//   q      = q_b_proj(rmsnorm(q_a_proj(x)))  (or q_proj(x)), per head [nope | rope], rope rotated
//   latent = rmsnorm(kv_a_proj_with_mqa(x)[:R]), rope key = rotate(kv_a_proj_with_mqa(x)[R:])
//   cache  <- fp16 [latent | rope key | (DSA, own indexer) indexer key]
//   q_latent[t, h] = q_nope[t, h] · W_uk(h)      (kv_b_proj's key part, absorbed: cuBLAS, batched over heads)
//   o_latent[t, h] = softmax over the seen positions of scale (q_latent · latent_j + q_rope · key_j) · latent_j
//   out = o_proj(o_latent[t, h] · W_uv(h)ᵀ)        (kv_b_proj's value part, cuBLAS batched over heads)
//
// Every token, prefill or decode, goes through the absorbed path (engine/cuda/
// latent_attention_kernels.h): each cached position is read once per tile of 16 heads, the
// products on tensor cores (fp16 operands, fp32 sums) where the shape allows. kv_b_proj
// is decoded once at load (EXL3 or dense, on the host as the CPU engine decodes it) into a dense
// fp32 device copy. DSA layers with their own indexer score every earlier position and choose the
// top index_topk (engine/cuda/dsa_indexer_kernels.h); "shared" layers reuse the selection of the
// last layer that ran one this step (LatentWorkspace::selected). A layer runs any rows of a step
// (LatentStep::first_row): each call works in the workspaces' rows of its own tokens, so with two
// micro-batches the selection one leaves for the next layer outlives the other's call of the same
// layer (engine/cuda/cuda_model.cc RunLayers). GLM-5.3-Flash's indexed layers
// use the same latent attention without rope (qk_rope_head_dim 0) through ProjectAndCache and
// AttendAndProject, with their own k-pooled indexer between them (engine/cuda/kpool_attention.h).
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/latent_attention_kernels.h"
#include "engine/cuda/step_facts.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// Device buffers every latent layer of a model shares, grown to the largest step; every buffer
// but `scores` holds a row per token of the step.
struct LatentWorkspace {
  DeviceArray<float> q_resid, q, ckv, q_latent, o_latent, attn, scratch;
  // DSA: the indexer's projections, the score rows of up to score_rows tokens at a time, and the
  // step's selection [T, index_topk] with its counts [T].
  DeviceArray<float> index_q, index_k, index_w, scores;
  DeviceArray<int32_t> selected, selected_count;
  int score_rows = 0;    // tokens whose scores fit `scores` at once
  int score_length = 0;  // floats per score row: the longest context a sequence can have
  bool selection_written = false;  // a layer with its own indexer ran this step (Load checks the order)

  // Grows the buffers for a step of `num_tokens` tokens and `splits` attention splits; contexts up
  // to `max_context` positions. *moved: whether any address changed (CUDA graphs must be dropped).
  absl::Status Reserve(const ModelConfig& cfg, int num_tokens, int splits, int max_context, bool* moved);

  // The per-token buffers from step row `row` on (the DSA ones null on other models).
  struct Rows {
    float *q_resid, *q, *ckv, *q_latent, *o_latent, *attn, *scratch;
    float *index_q, *index_k, *index_w;
    int32_t *selected, *selected_count;
  };
  Rows RowsFrom(const ModelConfig& cfg, int row, int splits) const;
};

// What a step gives a layer's call for its tokens [first_row, first_row + T): the step's device
// facts of those tokens.
struct LatentStep {
  AttentionTokens tokens;                   // position, first_visible, table_offset, tables, block_size
  const int32_t* slot = nullptr;            // [T] cache slot of each token
  const float *cos = nullptr, *sin = nullptr;  // [T, rotary_dim / 2]
  int splits = 1;
  const int32_t* split_positions = nullptr;  // one int32: positions per split
  int sm_count = 1;
  // The attention kernel's products; tensor cores where the shape allows (else CUDA cores).
  LatentKernel kernel = LatentKernel::kTensorCores;
  int first_row = 0;  // the step's row of the first token: where its rows of the workspaces start
};

// The facts of `step`'s rows [first, ...) (CudaMixer::Forward's row range).
LatentStep LatentStepOf(const CudaStep& step, int first);

class CudaLatentAttention {
 public:
  static absl::StatusOr<std::unique_ptr<CudaLatentAttention>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                   int layer);
  // out [T, hidden] = the layer's attention of x [T, hidden] (normed); writes the step's tokens
  // into cache_layer (KvWidth(layer) halves per slot) first.
  absl::Status Forward(const float* x, int num_tokens, const LatentStep& step, KvHalf* cache_layer,
                       LatentWorkspace& ws, const CudaLinearContext& ctx, float* out) const;
  // Forward's two halves: the queries into ws.q (and, with a low-rank q, the normalised q_a_proj
  // output into ws.q_resid), each token's latent and rope key written to its slot; then the
  // attention over each token's causal range or, given a selection, its chosen positions, and
  // o_proj into out.
  absl::Status ProjectAndCache(const float* x, int num_tokens, const LatentStep& step, KvHalf* cache_layer,
                               LatentWorkspace& ws, const CudaLinearContext& ctx) const;
  absl::Status AttendAndProject(int num_tokens, const LatentStep& step, const KvHalf* cache_layer,
                                const LatentSelection* selection, LatentWorkspace& ws, const CudaLinearContext& ctx,
                                float* out) const;

  // Bytes a forward reads of the projections (kv_b_proj's dense copy included), and the EXL3
  // views it decodes (for the benchmarks' floors).
  int64_t weight_bytes() const;
  std::vector<const CudaLinear*> linears() const;

 private:
  struct Indexer {
    CudaLinear wq_b, wk, weights_proj;
    DeviceArray<float> k_norm_weight, k_norm_bias;
  };
  explicit CudaLatentAttention(const ModelConfig& cfg, int layer) : cfg_(cfg), layer_(layer) {}
  absl::Status Select(const float* x, int num_tokens, const LatentStep& step, KvHalf* cache_layer,
                      LatentWorkspace& ws, const CudaLinearContext& ctx) const;

  const ModelConfig& cfg_;
  int layer_;
  bool q_low_rank_ = false;
  CudaLinear q_a_, q_b_, q_, kv_a_, o_;
  DeviceArray<float> q_a_norm_, kv_a_norm_;
  DeviceArray<float> kv_b_;  // [heads * (nope + v), kv_lora_rank] fp32
  std::optional<Indexer> indexer_;  // DSA layers with their own indexer
};

}  // namespace exl3::engine::cuda

// One layer of GLM-5.3-Flash's indexed attention on the GPU: the CPU engine's
// engine/cpu/attention/kpool_dsa_attention.h on device memory, for CudaModel (engine/cuda/cuda_model.h). The
// latent attention without rope is CudaLatentAttention's (engine/cuda/latent_attention.h, its
// ProjectAndCache and AttendAndProject); between them a "full" layer runs its k-pooled indexer:
//
//   q_i  = wq_b(normalised q_a_proj output)   k_i = LayerNorm(wk(x))   gate = compress_gate · x
//   w    = weights_proj(x)                    (scaled by 1/√index_n_heads in the score kernel)
//   cache <- fp16 [latent | k_i | gate]
//   per query: pool scores over its sequence's complete pools (engine/cuda/kpool_indexer_kernels.h),
//   the top select_pools pools (engine/cuda/dsa_indexer_kernels.h's device top-k over pools), their
//   positions plus the query's own incomplete pool as its attended positions.
//
// "Shared" layers reuse the selection the last full layer made this step (KpoolWorkspace::selected),
// at the step's rows of their tokens: a call for some of a step's rows (LatentStep::first_row)
// leaves the other rows' selection as it was.
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/latent_attention.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// The indexer's device buffers every indexed layer of a model shares, grown to the largest step;
// every buffer but `scores` holds a row per token of the step.
struct KpoolWorkspace {
  DeviceArray<float> index_q, index_k, index_gate, index_w, scores;
  // The chosen pools [T, select_pools] with their counts, and the positions they give [T, stride].
  DeviceArray<int32_t> pools, pool_count, selected, selected_count;
  int score_rows = 0;    // tokens whose pool scores fit `scores` at once
  int score_length = 0;  // floats per score row: the most complete pools a sequence can have
  int stride = 0;        // ints per row of `selected`: select_pools · P + P

  // Grows the buffers for a step of `num_tokens` tokens, contexts up to `max_context` positions.
  // *moved: whether any address changed (CUDA graphs must be dropped).
  absl::Status Reserve(const ModelConfig& cfg, int num_tokens, int max_context, bool* moved);

  // The per-token buffers from step row `row` on.
  struct Rows {
    float *index_q, *index_k, *index_gate, *index_w;
    int32_t *pools, *pool_count, *selected, *selected_count;
  };
  Rows RowsFrom(const ModelConfig& cfg, int row) const;
};

class CudaKpoolAttention {
 public:
  static absl::StatusOr<std::unique_ptr<CudaKpoolAttention>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                  int layer);
  // out [T, hidden] = the layer's attention of x [T, hidden] (normed); writes the step's tokens
  // into cache_layer (KvWidth(layer) halves per slot) first. step.cos and step.sin are not read.
  absl::Status Forward(const float* x, int num_tokens, const LatentStep& step, KvHalf* cache_layer,
                       LatentWorkspace& latent_ws, KpoolWorkspace& ws, const CudaLinearContext& ctx,
                       float* out) const;

  int64_t weight_bytes() const;
  std::vector<const CudaLinear*> linears() const;

 private:
  struct Indexer {
    CudaLinear wq_b, wk, weights_proj, compress_gate;
    DeviceArray<float> k_norm_weight, k_norm_bias;
    DeviceArray<float> ape;  // index_kpool_compress_ape [P, index_head_dim]
  };
  CudaKpoolAttention(const ModelConfig& cfg, int layer) : cfg_(cfg), layer_(layer) {}
  // The indexer on the step's tokens (caching k_i and the gate), then each token's positions.
  absl::Status Select(const float* x, int num_tokens, const LatentStep& step, KvHalf* cache_layer,
                      const LatentWorkspace& latent_ws, KpoolWorkspace& ws, const CudaLinearContext& ctx) const;

  const ModelConfig& cfg_;
  int layer_;
  std::unique_ptr<CudaLatentAttention> latent_;
  std::optional<Indexer> indexer_;  // unset on "shared" layers
};

}  // namespace exl3::engine::cuda

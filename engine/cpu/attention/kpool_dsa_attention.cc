#include "engine/cpu/attention/kpool_dsa_attention.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/glm5next_config.h"

namespace exl3::engine {

KpoolDsaAttention::KpoolDsaAttention(const ModelConfig& cfg, int layer) : cfg_(cfg), layer_(layer) {
  shape_.num_heads = cfg.indexer.num_heads;
  shape_.head_dim = cfg.indexer.head_dim;
  shape_.pool = cfg.glm5next->index_kpool;
  shape_.select_pools = cfg.indexer.topk / cfg.glm5next->index_kpool;
}

absl::StatusOr<std::unique_ptr<KpoolDsaAttention>> KpoolDsaAttention::Load(const ModelConfig& cfg,
                                                                           const TensorSource& src,
                                                                           int layer) {
  std::unique_ptr<KpoolDsaAttention> a(new KpoolDsaAttention(cfg, layer));
  EXL3_ASSIGN_OR_RETURN(a->mla_, MlaAttention::Load(cfg, src, layer));
  const std::string p = LayerPrefix(cfg.moe, layer) + "self_attn.indexer.";
  EXL3_ASSIGN_OR_RETURN(std::optional<IndexerProjections> projections, IndexerProjections::Load(cfg, src, layer, p));
  if (!projections) return a;
  const int H = cfg.hidden_size, DI = a->shape_.head_dim, P = a->shape_.pool;
  Indexer in;
  in.projections = *std::move(projections);
  const std::string gate = p + "index_kpool_compress_gate", ape = p + "index_kpool_compress_ape";
  EXL3_ASSIGN_OR_RETURN(TensorView g, src.Get(gate));
  if (g.info->shape != std::vector<int64_t>{DI, H})
    return absl::InvalidArgumentError(absl::StrCat(gate, ": expected shape [", DI, ", ", H, "]"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> gw, ToFloat32(g));
  in.compress_gate = Linear::FromDense(std::move(gw), H, DI);
  EXL3_ASSIGN_OR_RETURN(TensorView e, src.Get(ape));
  if (e.info->shape != std::vector<int64_t>{P, DI})
    return absl::InvalidArgumentError(absl::StrCat(ape, ": expected shape [", P, ", ", DI, "] (index_kpool, index_head_dim)"));
  EXL3_ASSIGN_OR_RETURN(in.ape, ToFloat32(e));
  a->indexer_ = std::move(in);
  return a;
}

absl::Status KpoolDsaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                        AttentionCarry& carry, float* out, CpuCompute& compute) {
  MlaAttention::SelectPositions select;
  if (indexer_) select = std::bind_front(&KpoolDsaAttention::Select, this);
  return mla_->ForwardSelected(x, tokens, cache, carry, select,
                               "shares the pooled selection of the layer before it, and that one ran no indexer "
                               "this step",
                               out, compute);
}

absl::Status KpoolDsaAttention::Select(const float* x, const std::vector<float>& q_resid,
                                       const StepTokens& tokens, PagedKvCache& cache,
                                       TopkSelection* selection, CpuCompute& compute) const {
  const Indexer& in = *indexer_;
  const int T = tokens.num_tokens, NI = shape_.num_heads, DI = shape_.head_dim;
  const int key_offset = cfg_.kv_lora_rank;  // after the latent
  std::vector<float> qi(static_cast<size_t>(T) * NI * DI), ki(static_cast<size_t>(T) * DI),
      gi(static_cast<size_t>(T) * DI), w(static_cast<size_t>(T) * NI);
  EXL3_RETURN_IF_ERROR(in.projections.Forward(x, q_resid.data(), T, NI, DI, qi.data(), ki.data(), w.data(), compute));
  EXL3_RETURN_IF_ERROR(in.compress_gate.Forward(x, T, gi.data(), compute));
  for (int t = 0; t < T; ++t) {
    const float* k = &ki[static_cast<size_t>(t) * DI];
    float* slot = cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]) + key_offset;
    std::copy_n(k, DI, slot);
    std::copy_n(&gi[static_cast<size_t>(t) * DI], DI, slot + DI);
  }

  // Per chunk (one sequence): the pool keys its queries see, then each query's positions.
  selection->positions.assign(T, {});
  std::vector<int> chunk_first(tokens.batch->chunks.size(), -1), chunk_last(tokens.batch->chunks.size(), -1);
  for (int t = 0; t < T; ++t) {
    if (chunk_first[tokens.chunk_of[t]] < 0) chunk_first[tokens.chunk_of[t]] = t;
    chunk_last[tokens.chunk_of[t]] = t;
  }
  for (size_t c = 0; c < chunk_first.size(); ++c) {
    if (chunk_first[c] < 0) continue;
    const int last = chunk_last[c];
    const int n = tokens.positions[last] + 1;  // positions [0, n) are cached
    const int complete = n / shape_.pool * shape_.pool;
    const std::vector<int32_t>& table = tokens.block_table(last);
    std::vector<float> keys(static_cast<size_t>(complete) * DI), gates(keys.size());
    for (int j = 0; j < complete; ++j) {
      const float* slot = cache.Slot(layer_, table, j) + key_offset;
      std::copy_n(slot, DI, &keys[static_cast<size_t>(j) * DI]);
      std::copy_n(slot + DI, DI, &gates[static_cast<size_t>(j) * DI]);
    }
    const std::vector<float> pool_keys = KpoolKeys(keys.data(), gates.data(), complete, in.ape.data(), shape_);
    compute.ParallelFor(last - chunk_first[c] + 1, [&](int i) {
      const int t = chunk_first[c] + i;
      selection->positions[t] = SelectPooledPositions(&qi[static_cast<size_t>(t) * NI * DI],
                                                      &w[static_cast<size_t>(t) * NI], pool_keys.data(),
                                                      tokens.positions[t], shape_);
    });
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine

#include "engine/cpu/attention/kpool_dsa_attention.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/glm5next_config.h"

namespace exl3::engine {
namespace {

constexpr float kIndexerNormEps = 1e-6f;  // the indexer's k_norm (nn.LayerNorm(eps=1e-6))

void LayerNormInPlace(float* x, const float* w, const float* b, int n, float eps) {
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  double var = 0.0;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
  const float m = static_cast<float>(mean);
  for (int i = 0; i < n; ++i) x[i] = (x[i] - m) * inv * w[i] + b[i];
}

}  // namespace

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
  const bool has_tensors = src.Has(p + "wk.weight") || src.Has(p + "wk.trellis");
  if (!cfg.HasOwnIndexer(layer)) {
    if (has_tensors)
      return absl::InvalidArgumentError(absl::StrCat(
          p, "*: layer ", layer, " has indexer weights but config.json marks it shared"));
    return a;
  }
  const int H = cfg.hidden_size, NI = a->shape_.num_heads, DI = a->shape_.head_dim, P = a->shape_.pool;
  Indexer in;
  EXL3_ASSIGN_OR_RETURN(in.wq_b, Linear::Load(src, p + "wq_b", cfg.q_lora_rank, NI * DI));
  EXL3_ASSIGN_OR_RETURN(in.wk, Linear::Load(src, p + "wk", H, DI));
  EXL3_ASSIGN_OR_RETURN(in.weights_proj, Linear::Load(src, p + "weights_proj", H, NI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_weight, LoadVector(src, p + "k_norm.weight", DI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_bias, LoadVector(src, p + "k_norm.bias", DI));
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
  std::vector<float> q, q_resid;
  EXL3_RETURN_IF_ERROR(mla_->ProjectAndCache(x, tokens, cache, &q, &q_resid, compute));
  if (indexer_) {
    TopkSelection selection;
    EXL3_RETURN_IF_ERROR(Select(x, q_resid, tokens, cache, &selection, compute));
    carry.topk = std::move(selection);
  } else if (!carry.topk || static_cast<int>(carry.topk->positions.size()) != tokens.num_tokens) {
    return absl::InternalError(absl::StrCat("layer ", layer_, " shares the pooled selection of the "
                                            "layer before it, and that one ran no indexer this step"));
  }
  return mla_->AttendAndProject(q, tokens, cache, &*carry.topk, out, compute);
}

absl::Status KpoolDsaAttention::Select(const float* x, const std::vector<float>& q_resid,
                                       const StepTokens& tokens, PagedKvCache& cache,
                                       TopkSelection* selection, CpuCompute& compute) const {
  const Indexer& in = *indexer_;
  const int T = tokens.num_tokens, NI = shape_.num_heads, DI = shape_.head_dim;
  const int key_offset = cfg_.kv_lora_rank;  // after the latent
  std::vector<float> qi(static_cast<size_t>(T) * NI * DI), ki(static_cast<size_t>(T) * DI),
      gi(static_cast<size_t>(T) * DI), w(static_cast<size_t>(T) * NI);
  EXL3_RETURN_IF_ERROR(in.wq_b.Forward(q_resid.data(), T, qi.data(), compute));
  EXL3_RETURN_IF_ERROR(in.wk.Forward(x, T, ki.data(), compute));
  EXL3_RETURN_IF_ERROR(in.compress_gate.Forward(x, T, gi.data(), compute));
  EXL3_RETURN_IF_ERROR(in.weights_proj.Forward(x, T, w.data(), compute));
  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
  for (float& v : w) v *= head_weight;
  for (int t = 0; t < T; ++t) {
    float* k = &ki[static_cast<size_t>(t) * DI];
    LayerNormInPlace(k, in.k_norm_weight.data(), in.k_norm_bias.data(), DI, kIndexerNormEps);
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

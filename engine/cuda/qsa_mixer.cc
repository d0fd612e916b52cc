#include "engine/cuda/qsa_mixer.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/kpool_indexer_kernels.h"
#include "engine/cuda/qsa_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rope.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

// What the kind's layers share: their caches, the blocks' rope angles and the step's buffers.
struct QsaShared {
  QsaShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), indexer(c.qwen4exp->indexer), linear(l) {}
  const ModelConfig& cfg;
  const QsaIndexerConfig indexer;
  CudaLinearContext linear;
  std::vector<int> layers;                      // the model layers of the kind
  std::vector<size_t> layer_index;              // by model layer: its index among `layers`
  size_t slots = 0;                             // per layer (num_blocks + 1 blocks)
  int max_context = 0;                          // positions a sequence can reach in the cache
  DeviceArray<KvHalf> kv;                       // [layers, slots, 2 * kv_heads * head_dim]
  DeviceArray<float> raw_keys;                  // [layers, slots, indexer head_dim]
  DeviceArray<float> block_cos, block_sin;      // [max_context / m, rotary_dim / 2]
  DeviceArray<float> qg, q, gate, k, v, iqk, iq, attn, scores;
  DeviceArray<float> attn_workspace;            // QsaAttention's split outputs
  DeviceArray<int32_t> blocks, block_count, positions, position_count;

  int kv_floats() const { return cfg.num_kv_heads * cfg.head_dim; }
  int row_length() const { return max_context / indexer.compress_ratio; }  // most complete blocks
  int stride() const { return indexer.budget + indexer.compress_ratio; }   // most attended positions
  KvHalf* kv_layer(int l) const { return kv.get() + layer_index[l] * slots * 2 * kv_floats(); }
  float* raw_keys_layer(int l) const { return raw_keys.get() + layer_index[l] * slots * indexer.head_dim; }
};

class QsaMixer final : public CudaMixer {
 public:
  QsaMixer(QsaShared& shared, int layer) : s_(shared), cfg_(shared.cfg), layer_(layer) {}

  // `layer_prefix`: where the layer's tensors are ("model.language_model.layers.L.", or an MTP
  // layer's own).
  absl::Status Load(const TensorSource& src, const std::string& layer_prefix) {
    const int H = cfg_.hidden_size, q_out = cfg_.num_heads * cfg_.head_dim, kv_out = s_.kv_floats();
    const QsaIndexerConfig& ix = s_.indexer;
    const std::string p = layer_prefix + "self_attn.";
    const NormWeightConvention zc = NormWeightConvention::kOffsetFromOne;
    EXL3_ASSIGN_OR_RETURN(q_, CudaLinear::Load(src, p + "q_proj", H, 2 * q_out));
    EXL3_ASSIGN_OR_RETURN(k_, CudaLinear::Load(src, p + "k_proj", H, kv_out));
    EXL3_ASSIGN_OR_RETURN(v_, CudaLinear::Load(src, p + "v_proj", H, kv_out));
    EXL3_ASSIGN_OR_RETURN(o_, CudaLinear::Load(src, p + "o_proj", q_out, H));
    EXL3_ASSIGN_OR_RETURN(q_norm_, UploadNorm(src, p + "q_norm.weight", cfg_.head_dim, zc));
    EXL3_ASSIGN_OR_RETURN(k_norm_, UploadNorm(src, p + "k_norm.weight", cfg_.head_dim, zc));
    EXL3_ASSIGN_OR_RETURN(index_qk_,
                          CudaLinear::Load(src, p + "indexer.index_qk_proj", H, (ix.num_heads + 1) * ix.head_dim));
    EXL3_ASSIGN_OR_RETURN(index_q_norm_, UploadNorm(src, p + "indexer.q_layernorm.weight", ix.head_dim, zc));
    EXL3_ASSIGN_OR_RETURN(index_k_norm_, UploadNorm(src, p + "indexer.k_layernorm.weight", ix.head_dim, zc));
    return absl::OkStatus();
  }

  absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) override;
  int64_t weight_bytes() const override {
    int64_t bytes = 0;
    for (const CudaLinear* l : linears()) bytes += l->weight_bytes();
    return bytes;
  }
  std::vector<const CudaLinear*> linears() const override { return {&q_, &k_, &v_, &index_qk_, &o_}; }

 private:
  QsaShared& s_;
  const ModelConfig& cfg_;
  int layer_;
  CudaLinear q_, k_, v_, o_, index_qk_;
  DeviceArray<float> q_norm_, k_norm_, index_q_norm_, index_k_norm_;  // 1 + w
};

absl::Status QsaMixer::Forward(const CudaStep& step, const float* x_step, int first, int T, float* out_step) {
  if (s_.kv.empty()) return absl::FailedPreconditionError("QSA attention: a step before the cache is allocated");
  const int D = cfg_.head_dim, NH = cfg_.num_heads, KV = cfg_.num_kv_heads;
  const QsaIndexerConfig& ix = s_.indexer;
  const int IH = ix.num_heads, ID = ix.head_dim, m = ix.compress_ratio;
  const float eps = cfg_.rms_norm_eps;
  const StreamHandle stream = s_.linear.stream;
  // Rows [first, first + T) of the step (a micro-batch, or all of it): its activations and
  // per-token facts. The workspaces are the call's own from their start: nothing in them outlives
  // the call, and micro-batches run one after the other on one stream.
  const size_t r = static_cast<size_t>(first), half = static_cast<size_t>(step.rotary_half);
  const float* x = x_step + r * cfg_.hidden_size;
  float* out = out_step + r * cfg_.hidden_size;
  const float* cos = step.cos + r * half;
  const float* sin = step.sin + r * half;
  const int32_t* slot = step.slot + r;
  const int32_t* position = step.position + r;
  const AttentionTokens tokens = step.attention_tokens(first);
  const CudaLinear* in[4] = {&q_, &k_, &v_, &index_qk_};
  float* const in_out[4] = {s_.qg.get(), s_.k.get(), s_.v.get(), s_.iqk.get()};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(in, 4, x, T, in_out, s_.linear));
  float* q = s_.q.get();
  float* k = s_.k.get();
  EXL3_RETURN_IF_ERROR(SplitQueryGate(s_.qg.get(), static_cast<int64_t>(T) * NH, D, q, s_.gate.get(), stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(q, q_norm_.get(), T * NH, D, eps, q, stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(k, k_norm_.get(), T * KV, D, eps, k, stream));
  const int rotary_dim = 2 * step.rotary_half;
  EXL3_RETURN_IF_ERROR(ApplyRope(q, T, NH, NH * D, D, rotary_dim, false, cos, sin, stream));
  EXL3_RETURN_IF_ERROR(ApplyRope(k, T, KV, KV * D, D, rotary_dim, false, cos, sin, stream));
  KvHalf* kv = s_.kv_layer(layer_);
  EXL3_RETURN_IF_ERROR(WriteKv(k, s_.v.get(), slot, T, KV * D, kv, stream));

  // The indexer: its raw keys cached, its queries normed and rotated (the attention's angles).
  float* raw_keys = s_.raw_keys_layer(layer_);
  float* iq = s_.iq.get();
  EXL3_RETURN_IF_ERROR(QsaSplitIndexer(s_.iqk.get(), slot, T, IH, ID, iq, raw_keys, stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(iq, index_q_norm_.get(), T * IH, ID, eps, iq, stream));
  EXL3_RETURN_IF_ERROR(ApplyRope(iq, T, IH, IH * ID, ID, rotary_dim, false, cos, sin, stream));
  const int row_length = s_.row_length();
  EXL3_RETURN_IF_ERROR(QsaBlockScores(iq, raw_keys, tokens, QsaIndexerShape{IH, ID, m, eps}, index_k_norm_.get(),
                                      s_.block_cos.get(), s_.block_sin.get(), step.rotary_half, T, s_.scores.get(),
                                      row_length, stream));
  EXL3_RETURN_IF_ERROR(IndexerTopk(s_.scores.get(), row_length, position, 0, T, ix.block_topk(), s_.blocks.get(),
                                   s_.block_count.get(), stream, m));
  EXL3_RETURN_IF_ERROR(KpoolSelectedPositions(s_.blocks.get(), s_.block_count.get(), ix.block_topk(), position, m, T,
                                              s_.positions.get(), s_.position_count.get(), s_.stride(), stream));
  float* attn = s_.attn.get();
  EXL3_RETURN_IF_ERROR(QsaAttention(q, kv, tokens, s_.positions.get(), s_.position_count.get(), s_.stride(), T, NH,
                                    KV, D, cfg_.attention_scale, attn, s_.attn_workspace.get(),
                                    s_.attn_workspace.size(), stream));
  EXL3_RETURN_IF_ERROR(SigmoidGate(attn, s_.gate.get(), static_cast<int64_t>(T) * NH * D, stream));
  return o_.Forward(attn, T, out, s_.linear);
}

class QsaKind final : public CudaMixerKind {
 public:
  QsaKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    return LoadLayerUnder(src, layer, LayerPrefix(s_.cfg.moe, layer));
  }
  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayerUnder(const TensorSource& src, int layer,
                                                             const std::string& prefix) override {
    EXL3_RETURN_IF_ERROR(CheckShape());
    auto mixer = std::make_unique<QsaMixer>(s_, layer);
    EXL3_RETURN_IF_ERROR(mixer->Load(src, prefix));
    if (s_.layer_index.empty()) s_.layer_index.assign(s_.cfg.num_layers, 0);
    s_.layer_index[layer] = s_.layers.size();
    s_.layers.push_back(layer);
    return mixer;
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    const ModelConfig& cfg = s_.cfg;
    const int m = s_.indexer.compress_ratio;
    s_.slots = static_cast<size_t>(shape.num_blocks + 1) * shape.block_size;
    s_.max_context = static_cast<int>(
        std::min<int64_t>(cfg.max_position_embeddings, static_cast<int64_t>(shape.num_blocks) * shape.block_size));
    const size_t L = s_.layers.size();
    s_.kv = DeviceArray<KvHalf>();
    s_.raw_keys = DeviceArray<float>();
    EXL3_RETURN_IF_ERROR(s_.kv.Reserve(std::max<size_t>(1, L * s_.slots * 2 * s_.kv_floats())));
    EXL3_RETURN_IF_ERROR(s_.raw_keys.Reserve(std::max<size_t>(1, L * s_.slots * s_.indexer.head_dim)));
    // The angles of each block's first position, as the CPU's rope computes them (the sequence's
    // length never passes max_position_embeddings here, where dynamic NTK would change them).
    const Rope rope(cfg.rope, cfg.max_position_embeddings);
    const int half = cfg.rope.rotary_dim / 2, blocks = std::max(1, s_.row_length());
    std::vector<float> cos(static_cast<size_t>(blocks) * half), sin(cos.size());
    RopeAngles angles;
    for (int b = 0; b < s_.row_length(); ++b) {
      rope.Angles(b * m, b * m + 1, &angles);
      std::copy(angles.cos.begin(), angles.cos.end(), cos.begin() + static_cast<size_t>(b) * half);
      std::copy(angles.sin.begin(), angles.sin.end(), sin.begin() + static_cast<size_t>(b) * half);
    }
    EXL3_RETURN_IF_ERROR(s_.block_cos.Upload(cos));
    EXL3_RETURN_IF_ERROR(s_.block_sin.Upload(sin));
    s_.scores = DeviceArray<float>();  // its rows are the new row length's
    return absl::OkStatus();
  }
  int64_t KvBytesPerToken() const override {
    const int64_t per_layer = 2 * static_cast<int64_t>(s_.kv_floats()) * sizeof(KvHalf) +
                              static_cast<int64_t>(s_.indexer.head_dim) * sizeof(float);
    return per_layer * static_cast<int64_t>(s_.layers.size());
  }

  absl::Status Reserve(int rows, int, bool* moved) override {
    const ModelConfig& cfg = s_.cfg;
    const QsaIndexerConfig& ix = s_.indexer;
    const size_t t = static_cast<size_t>(std::max(rows, 1));
    const size_t q = t * cfg.num_heads * cfg.head_dim, kv = t * s_.kv_floats();
    const std::pair<DeviceArray<float>*, size_t> floats[] = {
        {&s_.qg, 2 * q},
        {&s_.q, q},
        {&s_.gate, q},
        {&s_.k, kv},
        {&s_.v, kv},
        {&s_.iqk, t * (ix.num_heads + 1) * ix.head_dim},
        {&s_.iq, t * ix.num_heads * ix.head_dim},
        {&s_.attn, q},
        {&s_.scores, t * std::max(1, s_.row_length())},
        {&s_.attn_workspace, QsaAttentionWorkspaceFloats(static_cast<int>(t), cfg.num_heads, cfg.num_kv_heads,
                                                         cfg.head_dim, s_.stride())}};
    for (const auto& [array, n] : floats) {
      if (array->size() >= n) continue;
      *moved = true;
      EXL3_RETURN_IF_ERROR(array->Reserve(n));
    }
    const std::pair<DeviceArray<int32_t>*, size_t> ints[] = {{&s_.blocks, t * ix.block_topk()},
                                                             {&s_.block_count, t},
                                                             {&s_.positions, t * s_.stride()},
                                                             {&s_.position_count, t}};
    for (const auto& [array, n] : ints) {
      if (array->size() >= n) continue;
      *moved = true;
      EXL3_RETURN_IF_ERROR(array->Reserve(n));
    }
    return absl::OkStatus();
  }

 private:
  // What the kernels take, refused by name before anything is loaded.
  absl::Status CheckShape() const {
    const ModelConfig& cfg = s_.cfg;
    const QsaIndexerConfig& ix = s_.indexer;
    if (cfg.rope.layout != RopeLayout::kHalfSplit)
      return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": QSA attention with interleaved rope"));
    if (cfg.rope.rotary_dim > ix.head_dim)
      return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": the rope's ", cfg.rope.rotary_dim,
                                                   " rotary dims exceed indexer_head_dim ", ix.head_dim));
    if (ix.head_dim > kQsaMaxIndexerHeadDim)
      return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": indexer_head_dim ", ix.head_dim,
                                                   " above the GPU kernels' ", kQsaMaxIndexerHeadDim));
    if (!QsaAttentionShapeSupported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
      return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": QSA attention of ", cfg.num_heads,
                                                   " heads over ", cfg.num_kv_heads, " KV heads of ", cfg.head_dim,
                                                   " (the GPU kernel takes 1, 2, 4, 8 or 16 heads a KV head, "
                                                   "head_dim at most ", kQsaMaxHeadDim, ")"));
    return absl::OkStatus();
  }

  QsaShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeQsaKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<QsaKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda

#include "engine/cuda/latent_mixer.h"

#include "base/status_macros.h"
#include "engine/cuda/latent_attention.h"
#include "engine/cuda/latent_attention_kernels.h"
#include "engine/cuda/layer_kv_cache.h"

namespace exl3::engine::cuda {
namespace {

struct LatentShared {
  LatentShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  LayerKvCache cache;  // per latent layer [slots, KvWidth(layer)]
  LatentWorkspace ws;
};

class LatentMixer final : public CudaMixer {
 public:
  LatentMixer(LatentShared& shared, int layer, std::unique_ptr<CudaLatentAttention> attention)
      : s_(shared), layer_(layer), attention_(std::move(attention)) {}

  absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) override {
    const size_t r = static_cast<size_t>(first) * s_.cfg.hidden_size;
    return attention_->Forward(x + r, n, LatentStepOf(step, first), s_.cache.layer(layer_), s_.ws, s_.linear, out + r);
  }
  int64_t weight_bytes() const override { return attention_->weight_bytes(); }
  std::vector<const CudaLinear*> linears() const override { return attention_->linears(); }

 private:
  LatentShared& s_;
  int layer_;
  std::unique_ptr<CudaLatentAttention> attention_;
};

class LatentKind final : public CudaMixerKind {
 public:
  LatentKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaLatentAttention> attention, CudaLatentAttention::Load(s_.cfg, src, layer));
    s_.cache.AddLayer(layer);
    return std::make_unique<LatentMixer>(s_, layer, std::move(attention));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    return s_.cache.Allocate(s_.cfg, shape);
  }
  int64_t KvBytesPerToken() const override { return s_.cache.BytesPerToken(s_.cfg); }

  absl::Status Reserve(int rows, int splits, bool* moved) override {
    bool latent_moved = false;
    EXL3_RETURN_IF_ERROR(s_.ws.Reserve(s_.cfg, rows, splits, s_.cache.max_context(), &latent_moved));
    *moved |= latent_moved;
    return absl::OkStatus();
  }

  SplitShape split_shape() const override {
    // A block per tile of query heads; DSA attends to at most index_topk chosen positions.
    SplitShape shape{LatentAttentionHeadTiles(s_.cfg.num_heads)};
    if (s_.cfg.attention == AttentionKind::kDsa) shape.max_positions = s_.cfg.indexer.topk;
    return shape;
  }

 private:
  LatentShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeLatentKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<LatentKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda

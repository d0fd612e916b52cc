#include "engine/cuda/kpool_mixer.h"

#include "base/status_macros.h"
#include "engine/cuda/kpool_attention.h"
#include "engine/cuda/latent_attention_kernels.h"
#include "engine/cuda/layer_kv_cache.h"
#include "engine/config/glm5next_config.h"

namespace exl3::engine::cuda {
namespace {

struct KpoolShared {
  KpoolShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  LayerKvCache cache;  // per indexed layer [slots, KvWidth(layer)]
  LatentWorkspace latent_ws;
  KpoolWorkspace ws;
};

class KpoolMixer final : public CudaMixer {
 public:
  KpoolMixer(KpoolShared& shared, int layer, std::unique_ptr<CudaKpoolAttention> attention)
      : s_(shared), layer_(layer), attention_(std::move(attention)) {}

  absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) override {
    const size_t r = static_cast<size_t>(first) * s_.cfg.hidden_size;
    return attention_->Forward(x + r, n, LatentStepOf(step, first), s_.cache.layer(layer_), s_.latent_ws, s_.ws,
                               s_.linear, out + r);
  }
  int64_t weight_bytes() const override { return attention_->weight_bytes(); }
  std::vector<const CudaLinear*> linears() const override { return attention_->linears(); }

 private:
  KpoolShared& s_;
  int layer_;
  std::unique_ptr<CudaKpoolAttention> attention_;
};

class KpoolKind final : public CudaMixerKind {
 public:
  KpoolKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaKpoolAttention> attention, CudaKpoolAttention::Load(s_.cfg, src, layer));
    s_.cache.AddLayer(layer);
    return std::make_unique<KpoolMixer>(s_, layer, std::move(attention));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    return s_.cache.Allocate(s_.cfg, shape);
  }
  int64_t KvBytesPerToken() const override { return s_.cache.BytesPerToken(s_.cfg); }

  absl::Status Reserve(int rows, int splits, bool* moved) override {
    bool latent_moved = false, kpool_moved = false;
    EXL3_RETURN_IF_ERROR(s_.latent_ws.Reserve(s_.cfg, rows, splits, s_.cache.max_context(), &latent_moved));
    EXL3_RETURN_IF_ERROR(s_.ws.Reserve(s_.cfg, rows, s_.cache.max_context(), &kpool_moved));
    *moved |= latent_moved || kpool_moved;
    return absl::OkStatus();
  }

  SplitShape split_shape() const override {
    // A block per tile of query heads; a query attends to its select_pools chosen pools and at most
    // one pool's worth of its own incomplete pool (index_topk + P positions).
    SplitShape shape{LatentAttentionHeadTiles(s_.cfg.num_heads)};
    shape.max_positions = s_.cfg.indexer.topk + s_.cfg.glm5next->index_kpool;
    return shape;
  }

 private:
  KpoolShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeKpoolKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<KpoolKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda

#include "engine/cuda/load_cuda_mixers.h"

#include <array>
#include <memory>

#include "base/status_macros.h"
#include "engine/cuda/cuda_gated_deltanet.h"
#include "engine/cuda/cuda_kimi_delta_attention.h"
#include "engine/cuda/dsv4_mixer.h"
#include "engine/cuda/gqa_mixer.h"
#include "engine/cuda/kpool_mixer.h"
#include "engine/cuda/latent_mixer.h"
#include "engine/cuda/qsa_mixer.h"
#include "engine/cuda/recurrent_mixer.h"

namespace exl3::engine::cuda {
namespace {

enum class MixerKindId { kGqa, kLatent, kGatedDeltaNet, kKda, kKpool, kDsv4, kQsa, kCount };

MixerKindId KindOf(const ModelConfig& cfg, int layer) {
  if (cfg.IsLinearAttentionLayer(layer))
    return cfg.attention == AttentionKind::kPooledDsa ? MixerKindId::kKda : MixerKindId::kGatedDeltaNet;
  if (cfg.attention == AttentionKind::kPooledDsa) return MixerKindId::kKpool;
  if (cfg.attention == AttentionKind::kQsa) return MixerKindId::kQsa;
  if (cfg.attention == AttentionKind::kDsv4) return MixerKindId::kDsv4;
  if (cfg.IsLatentAttention()) return MixerKindId::kLatent;
  return MixerKindId::kGqa;
}

absl::StatusOr<std::unique_ptr<CudaMixerKind>> MakeKind(MixerKindId id, const ModelConfig& cfg,
                                                        const CudaLinearContext& linear) {
  switch (id) {
    case MixerKindId::kGqa: return MakeGqaKind(cfg, linear);
    case MixerKindId::kLatent: return MakeLatentKind(cfg, linear);
    case MixerKindId::kGatedDeltaNet:
      return std::make_unique<RecurrentMixerKind<CudaGatedDeltaNet, DeltaNetWorkspace>>(cfg, linear);
    case MixerKindId::kKda:
      return std::make_unique<RecurrentMixerKind<CudaKimiDeltaAttention, KdaWorkspace>>(cfg, linear);
    case MixerKindId::kKpool: return MakeKpoolKind(cfg, linear);
    case MixerKindId::kDsv4: return MakeDsv4Kind(cfg, linear);
    case MixerKindId::kQsa: return MakeQsaKind(cfg, linear);
    case MixerKindId::kCount: break;
  }
  return absl::InternalError("unknown mixer kind");
}

}  // namespace

absl::StatusOr<CudaMixers> LoadCudaMixers(const ModelConfig& cfg, const TensorSource& src,
                                          const CudaLinearContext& linear) {
  CudaMixers mixers;
  std::array<CudaMixerKind*, static_cast<size_t>(MixerKindId::kCount)> by_id{};
  for (int l = 0; l < cfg.num_layers; ++l) {
    const MixerKindId id = KindOf(cfg, l);
    CudaMixerKind*& kind = by_id[static_cast<size_t>(id)];
    if (kind == nullptr) {
      EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaMixerKind> made, MakeKind(id, cfg, linear));
      kind = made.get();
      mixers.kinds.push_back(std::move(made));
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaMixer> mixer, kind->LoadLayer(src, l));
    mixers.layers.push_back(std::move(mixer));
  }
  return mixers;
}

absl::StatusOr<CudaLayerMixer> LoadCudaLayerMixer(const ModelConfig& cfg, const TensorSource& src, int layer,
                                                  const CudaLinearContext& linear, const std::string& prefix) {
  CudaLayerMixer m;
  EXL3_ASSIGN_OR_RETURN(m.kind, MakeKind(KindOf(cfg, layer), cfg, linear));
  if (prefix.empty()) {
    EXL3_ASSIGN_OR_RETURN(m.mixer, m.kind->LoadLayer(src, layer));
  } else {
    EXL3_ASSIGN_OR_RETURN(m.mixer, m.kind->LoadLayerUnder(src, layer, prefix));
  }
  return m;
}

}  // namespace exl3::engine::cuda

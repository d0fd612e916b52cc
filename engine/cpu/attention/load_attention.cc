#include "engine/cpu/attention/load_attention.h"

#include "engine/cpu/attention/dsa_attention.h"
#include "engine/cpu/attention/dsv4_attention.h"
#include "engine/cpu/attention/gqa_attention.h"
#include "engine/cpu/attention/kpool_dsa_attention.h"
#include "engine/cpu/attention/mla_attention.h"
#include "engine/cpu/attention/qsa_attention.h"

namespace exl3::engine {

namespace {

template <typename Kind>
absl::StatusOr<std::unique_ptr<Attention>> LoadAs(const ModelConfig& cfg, const TensorSource& src,
                                                  int layer) {
  auto a = Kind::Load(cfg, src, layer);
  if (!a.ok()) return a.status();
  return std::unique_ptr<Attention>(std::move(*a));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Attention>> LoadAttention(const ModelConfig& cfg,
                                                         const TensorSource& src, int layer) {
  switch (cfg.attention) {
    case AttentionKind::kGqa:
      return LoadAs<GqaAttention>(cfg, src, layer);
    case AttentionKind::kMla:
      return LoadAs<MlaAttention>(cfg, src, layer);
    case AttentionKind::kDsa:
      return LoadAs<DsaAttention>(cfg, src, layer);
    case AttentionKind::kDsv4:
      return LoadAs<Dsv4Attention>(cfg, src, layer);
    case AttentionKind::kPooledDsa:
      return LoadAs<KpoolDsaAttention>(cfg, src, layer);
    case AttentionKind::kQsa:
      return LoadAs<QsaAttention>(cfg, src, layer);
  }
  return absl::InternalError("unknown attention kind");
}

}  // namespace exl3::engine

#include "engine/cuda/gqa_mixer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/layer_kv_cache.h"
#include "engine/cuda/weight_upload.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

// What the kind's layers share: the cache of every GQA layer and the step's buffers.
struct GqaShared {
  GqaShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  LayerKvCache cache;  // per GQA layer [slots, 2 * kv_floats]
  DeviceArray<float> q, k, v, attn, scratch;
  DeviceArray<float> qg, qgate;  // gated attention: q_proj's output, the heads' output gates
};

class GqaMixer final : public CudaMixer {
 public:
  GqaMixer(GqaShared& shared, int layer) : s_(shared), cfg_(shared.cfg), layer_(layer) {}

  absl::Status Load(const TensorSource& src) {
    const int H = cfg_.hidden_size;
    const int q_out = cfg_.num_heads * cfg_.head_dim, kv_out = cfg_.num_kv_heads * cfg_.head_dim;
    const std::string a = absl::StrCat("model.layers.", layer_, ".self_attn.");
    EXL3_ASSIGN_OR_RETURN(q_, CudaLinear::Load(src, a + "q_proj", H, cfg_.attention_output_gate ? 2 * q_out : q_out));
    EXL3_ASSIGN_OR_RETURN(k_, CudaLinear::Load(src, a + "k_proj", H, kv_out));
    EXL3_ASSIGN_OR_RETURN(v_, CudaLinear::Load(src, a + "v_proj", H, kv_out));
    EXL3_ASSIGN_OR_RETURN(o_, CudaLinear::Load(src, a + "o_proj", q_out, H));
    if (cfg_.qk_norm) {
      EXL3_ASSIGN_OR_RETURN(q_norm_, UploadNorm(src, a + "q_norm.weight", cfg_.head_dim, cfg_.norm_weights));
      EXL3_ASSIGN_OR_RETURN(k_norm_, UploadNorm(src, a + "k_norm.weight", cfg_.head_dim, cfg_.norm_weights));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(const CudaStep& step, const float* x_step, int first, int T, float* out) override;
  int64_t weight_bytes() const override {
    return q_.weight_bytes() + k_.weight_bytes() + v_.weight_bytes() + o_.weight_bytes();
  }
  std::vector<const CudaLinear*> linears() const override { return {&q_, &k_, &v_, &o_}; }

 private:
  GqaShared& s_;
  const ModelConfig& cfg_;
  int layer_;
  CudaLinear q_, k_, v_, o_;
  DeviceArray<float> q_norm_, k_norm_;  // empty without qk_norm
};

absl::Status GqaMixer::Forward(const CudaStep& step, const float* x_step, int first, int T, float* out) {
  const int D = cfg_.head_dim, NH = cfg_.num_heads, KV = cfg_.num_kv_heads;
  const StreamHandle stream = s_.linear.stream;
  KvHalf* cache_layer = s_.cache.layer(layer_);
  // Rows [first, first + T) of the step's activations and per-token facts.
  const size_t r = static_cast<size_t>(first), half = static_cast<size_t>(step.rotary_half);
  const float* x = x_step + r * cfg_.hidden_size;
  float* q = s_.q.get() + r * NH * D;
  float* k = s_.k.get() + r * KV * D;
  float* v = s_.v.get() + r * KV * D;
  const CudaLinear* qkv[3] = {&q_, &k_, &v_};
  const bool gated = cfg_.attention_output_gate;
  float* gate = gated ? s_.qgate.get() + r * NH * D : nullptr;
  float* const qkv_out[3] = {gated ? s_.qg.get() + r * 2 * NH * D : q, k, v};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(qkv, 3, x, T, qkv_out, s_.linear));
  if (gated) EXL3_RETURN_IF_ERROR(SplitQueryGate(qkv_out[0], static_cast<int64_t>(T) * NH, D, q, gate, stream));
  if (!q_norm_.empty()) {
    EXL3_RETURN_IF_ERROR(RmsNorm(q, q_norm_.get(), T * NH, D, cfg_.rms_norm_eps, q, stream));
    EXL3_RETURN_IF_ERROR(RmsNorm(k, k_norm_.get(), T * KV, D, cfg_.rms_norm_eps, k, stream));
  }
  const bool interleaved = cfg_.rope.layout == RopeLayout::kInterleaved;
  const int rotary_dim = 2 * step.rotary_half;
  const float* cos = step.cos + r * half;
  const float* sin = step.sin + r * half;
  EXL3_RETURN_IF_ERROR(ApplyRope(q, T, NH, NH * D, D, rotary_dim, interleaved, cos, sin, stream));
  EXL3_RETURN_IF_ERROR(ApplyRope(k, T, KV, KV * D, D, rotary_dim, interleaved, cos, sin, stream));
  EXL3_RETURN_IF_ERROR(WriteKv(k, v, step.slot + r, T, KV * D, cache_layer, stream));
  for (const AttentionRun& run : step.attention_runs) {
    // The part of the run in these rows (a micro-batch holds whole chunks: a prefill run is in
    // one micro-batch, a run of decode tokens may span both).
    const int begin = std::max(run.first_token, first);
    const int end = std::min(run.first_token + run.num_tokens, first + T);
    if (begin >= end) continue;
    const size_t t0 = static_cast<size_t>(begin);
    const float* run_q = s_.q.get() + t0 * NH * D;
    float* run_out = s_.attn.get() + t0 * NH * D;
    float* scratch = s_.scratch.get() + AttentionScratchFloats(begin, NH, D, step.splits);
    EXL3_RETURN_IF_ERROR((run.prefill ? PrefillAttention : PagedAttention)(
        run_q, cache_layer, step.attention_tokens(begin), end - begin, NH, KV, D, cfg_.attention_scale, step.splits,
        step.split_positions, scratch, run_out, stream));
  }
  float* o = s_.attn.get() + r * NH * D;
  if (gated) EXL3_RETURN_IF_ERROR(SigmoidGate(o, gate, static_cast<int64_t>(T) * NH * D, stream));
  return o_.Forward(o, T, out + r * cfg_.hidden_size, s_.linear);
}

class GqaKind final : public CudaMixerKind {
 public:
  GqaKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    auto mixer = std::make_unique<GqaMixer>(s_, layer);
    EXL3_RETURN_IF_ERROR(mixer->Load(src));
    s_.cache.AddLayer(layer);
    return mixer;
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    return s_.cache.Allocate(s_.cfg, shape);
  }
  int64_t KvBytesPerToken() const override { return s_.cache.BytesPerToken(s_.cfg); }

  absl::Status Reserve(int rows, int splits, bool* moved) override {
    const ModelConfig& cfg = s_.cfg;
    const size_t t = static_cast<size_t>(rows);
    const size_t q = t * cfg.num_heads * cfg.head_dim, kv = t * cfg.num_kv_heads * cfg.head_dim;
    const size_t gated_q = cfg.attention_output_gate ? q : 0;
    const std::pair<DeviceArray<float>*, size_t> needs[] = {
        {&s_.q, q}, {&s_.k, kv}, {&s_.v, kv}, {&s_.attn, q},
        {&s_.scratch, static_cast<size_t>(AttentionScratchFloats(rows, cfg.num_heads, cfg.head_dim, splits))},
        {&s_.qg, 2 * gated_q}, {&s_.qgate, gated_q}};
    for (const auto& [array, n] : needs) {
      if (array->size() >= n) continue;
      *moved = true;
      EXL3_RETURN_IF_ERROR(array->Reserve(n));
    }
    return absl::OkStatus();
  }

  SplitShape split_shape() const override { return SplitShape{s_.cfg.num_kv_heads}; }  // a block per KV head

 private:
  GqaShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeGqaKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<GqaKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda

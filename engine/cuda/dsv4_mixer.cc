#include "engine/cuda/dsv4_mixer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/dsv4_attention.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

struct Dsv4Shared {
  Dsv4Shared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l), facts(c) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  DeviceArray<float> cache;
  std::vector<size_t> layer_offset;  // [layers + 1] floats
  std::vector<int> block_stride;     // by layer
  int block_size = 16;
  int max_context = 0;
  Dsv4StepFacts facts;
  Dsv4Step step;
  Dsv4Workspace ws;
};

class Dsv4Mixer final : public CudaMixer {
 public:
  Dsv4Mixer(Dsv4Shared& shared, int layer, std::unique_ptr<CudaDsv4Attention> attention)
      : s_(shared), layer_(layer), attention_(std::move(attention)) {}

  absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) override {
    if (first != 0 || n != step.rows)
      return absl::InternalError(absl::StrCat("DeepSeek-V4 attention runs whole steps (rows ", first, "+", n, " of ",
                                              step.rows, ")"));
    const Dsv4CacheView cache{s_.cache.get() + s_.layer_offset[layer_], s_.block_size, s_.cfg.KvWidth(layer_),
                              s_.block_stride[layer_]};
    return attention_->Forward(x, n, s_.step, cache, s_.ws, s_.linear, out);
  }
  int64_t weight_bytes() const override { return attention_->weight_bytes(); }
  std::vector<const CudaLinear*> linears() const override { return attention_->linears(); }

 private:
  Dsv4Shared& s_;
  int layer_;
  std::unique_ptr<CudaDsv4Attention> attention_;
};

class Dsv4Kind final : public CudaMixerKind {
 public:
  Dsv4Kind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}
  absl::Status Init() { return s_.facts.Init(); }  // the fold's error word

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaDsv4Attention> attention, CudaDsv4Attention::Load(s_.cfg, src, layer));
    return std::make_unique<Dsv4Mixer>(s_, layer, std::move(attention));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream) override {
    const int L = s_.cfg.num_layers, B = shape.block_size;
    s_.layer_offset.assign(L + 1, 0);
    s_.block_stride.assign(L, 0);
    for (int l = 0; l < L; ++l) {
      s_.block_stride[l] = B * s_.cfg.KvWidth(l) + s_.cfg.KvBlockFloats(l, B);
      s_.layer_offset[l + 1] = s_.layer_offset[l] + static_cast<size_t>(shape.num_blocks + 1) * s_.block_stride[l];
    }
    s_.block_size = B;
    s_.max_context = static_cast<int>(
        std::min<int64_t>(s_.cfg.max_position_embeddings, static_cast<int64_t>(shape.num_blocks) * B));
    s_.cache = DeviceArray<float>();
    EXL3_RETURN_IF_ERROR(s_.cache.Reserve(s_.layer_offset[L]));
    // On the model's stream (non-blocking: the legacy stream's work would not order before its steps).
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s_.cache.get(), 0, s_.layer_offset[L] * sizeof(float),
                                              static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }
  int64_t KvBytesPerToken() const override {
    return s_.cfg.KvFloatsPerToken() * static_cast<int64_t>(sizeof(float));
  }

  absl::Status Reserve(int rows, int, bool*) override {  // no decode graphs: no address to keep
    return s_.ws.Reserve(s_.cfg, rows, s_.max_context);
  }
  absl::Status BindStep(const CudaStep& step, const StepTokens& tokens, const int32_t*, StreamHandle stream) override {
    return s_.facts.Prepare(tokens, step.attention_tokens(), step.sm_count, stream, &s_.step);
  }
  // The compressors' fold fails a step as the CPU engine's does (after the step: its error word).
  absl::Status EndStep(const StepBatch&, StreamHandle stream) override { return s_.facts.TakeError(stream); }

  bool graph_capturable() const override { return false; }
  bool rows_split() const override { return false; }

 private:
  Dsv4Shared s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaMixerKind>> MakeDsv4Kind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  auto kind = std::make_unique<Dsv4Kind>(cfg, linear);
  EXL3_RETURN_IF_ERROR(kind->Init());
  return kind;
}

}  // namespace exl3::engine::cuda

#include "engine/cuda/dsv4_mixer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/dsv4_attention.h"
#include "engine/cuda/dsv4_kept_row_slots.h"
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
  // Speculative decoding: which rows hold the compressors' kept states, and those rows (the
  // compressed layers', each at kept_offset[layer] floats; none without speculation).
  Dsv4KeptRowSlots kept_slots;
  DeviceArray<float> kept;
  std::vector<size_t> kept_offset;  // by layer; sliding layers keep nothing
  size_t keeping_at = 0;            // the chunks' keeping in the step's fact array
};

class Dsv4Mixer final : public CudaMixer {
 public:
  Dsv4Mixer(Dsv4Shared& shared, int layer, std::unique_ptr<CudaDsv4Attention> attention)
      : s_(shared), layer_(layer), attention_(std::move(attention)) {}

  absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) override {
    if (first != 0 || n != step.rows)
      return absl::InternalError(absl::StrCat("DeepSeek-V4 attention runs whole steps (rows ", first, "+", n, " of ",
                                              step.rows, ")"));
    Dsv4CacheView cache{s_.cache.get() + s_.layer_offset[layer_], s_.block_size, s_.cfg.KvWidth(layer_),
                        s_.block_stride[layer_]};
    if (s_.kept_slots.enabled() && s_.cfg.dsv4->CompressRate(layer_) > 0)
      cache.kept = s_.kept.get() + s_.kept_offset[layer_];
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
    return AllocateKeptStates(shape, stream);
  }
  int64_t KvBytesPerToken() const override {
    return s_.cfg.KvFloatsPerToken() * static_cast<int64_t>(sizeof(float));
  }

  absl::Status Reserve(int rows, int, bool*) override {  // no decode graphs: no address to keep
    return s_.ws.Reserve(s_.cfg, rows, s_.max_context);
  }
  // Checks the step's chunks against the kept states' room and, with speculative decoding, plans
  // what each chunk restores and keeps (into the step's fact array).
  absl::Status PackStep(const StepTokens& tokens, int, std::vector<int32_t>* facts) override {
    s_.keeping_at = facts->size();
    return s_.kept_slots.PlanStep(tokens, s_.block_size, facts);
  }
  absl::Status BindStep(const CudaStep& step, const StepTokens& tokens, const int32_t* device_facts,
                        StreamHandle stream) override {
    EXL3_RETURN_IF_ERROR(s_.facts.Prepare(tokens, step.attention_tokens(), step.sm_count, stream, &s_.step));
    if (s_.kept_slots.enabled()) s_.step.chunk_keeping = device_facts + s_.keeping_at;
    return absl::OkStatus();
  }
  // The compressors' fold fails a step as the CPU engine's does (after the step: its error word);
  // a step that succeeded makes what its verify chunks kept their slots'.
  absl::Status EndStep(const StepBatch&, StreamHandle stream) override {
    EXL3_RETURN_IF_ERROR(s_.facts.TakeError(stream));
    s_.kept_slots.CommitStep();
    return absl::OkStatus();
  }

  bool graph_capturable() const override { return false; }
  bool rows_split() const override { return false; }

 private:
  // With speculative decoding (max_logit_rows_per_chunk > 1): per compressed layer, each slot's
  // rows of kept accumulators (engine/cuda/dsv4_kept_row_slots.h); nothing without.
  absl::Status AllocateKeptStates(const KvCacheShape& shape, StreamHandle stream) {
    const int L = s_.cfg.num_layers;
    s_.kept = DeviceArray<float>();
    s_.kept_offset.assign(L, 0);
    EXL3_RETURN_IF_ERROR(s_.kept_slots.Allocate(shape.num_sequence_slots, shape.max_logit_rows_per_chunk - 1));
    if (!s_.kept_slots.enabled()) return absl::OkStatus();
    size_t total = 0;
    for (int l = 0; l < L; ++l) {
      s_.kept_offset[l] = total;
      const Dsv4LayerType type = s_.cfg.dsv4->layer_types[l];
      if (type == Dsv4LayerType::kSlidingWindow) continue;
      const Dsv4CacheLayout layout = CacheLayoutFor(*s_.cfg.dsv4, type, shape.block_size);
      total += static_cast<size_t>(s_.kept_slots.rows()) * (layout.accumulators_end - (layout.folded + 1));
    }
    if (!s_.kept.Reserve(std::max<size_t>(total, 1)).ok())
      return absl::ResourceExhaustedError(absl::StrCat(
          "DeepSeek-V4's kept compressor states on the GPU (", s_.kept_slots.num_slots(), " slots x ",
          s_.kept_slots.max_kept() + 1, " rows, ", total * sizeof(float), " bytes) cannot be allocated; lower "
          "--max-num-seqs or --num-speculative-tokens"));
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s_.kept.get(), 0, std::max<size_t>(total, 1) * sizeof(float),
                                              static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  Dsv4Shared s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaMixerKind>> MakeDsv4Kind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  auto kind = std::make_unique<Dsv4Kind>(cfg, linear);
  EXL3_RETURN_IF_ERROR(kind->Init());
  return kind;
}

}  // namespace exl3::engine::cuda

// The drafter of speculative method mtp: a checkpoint's MTP layer run on the model's own hidden
// states, one class per MTP design behind this interface:
//
//   engine/cpu/mtp/mtp_head.h           the DeepSeek-V3 design: DeepseekV3, Glm4Moe, GlmMoeDsa and Glm5Next
//                               (GLM-5.3-Flash) checkpoints, model.layers.{num_hidden_layers}.*
//   engine/cpu/mtp/qwen4exp_mtp_head.h  Qwen4-Exp's (Qwen3.8-Flash-Next): mtp.*, over the hyper-connection
//                               streams
//
// The runner keeps, for every token of a step that asks for it, the state the drafter reads
// (input(): what the model's head reads, or the residual streams before the head collapses
// them), state_width() floats a token; Forward runs the MTP layer on those states and the embedded
// next tokens, writing its KV into cache layer cache_layer() (one past the decoder layers), and
// returns per token an output of the same width, which is also the state a chained draft (K > 1)
// runs on; Logits turns outputs into the next tokens' logits.
//
//   EXL3_RETURN_IF_ERROR(CheckMtpDrafter(cfg, src));                 // engine/cpu/mtp/load_mtp_drafter.h
//   EXL3_ASSIGN_OR_RETURN(auto mtp, LoadMtpDrafter(cfg, src, model_head));
//   EXL3_RETURN_IF_ERROR(mtp->Forward(states, embedded, tokens, cache, out, compute));
//   EXL3_RETURN_IF_ERROR(mtp->Logits(out_rows, rows, logits, compute));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

// The model state an MTP design reads at each position.
enum class MtpInput {
  kHeadInput,  // what the model's head reads: after its final norm (hyper-connected streams
               // collapsed by the model's hyper head first) [hidden]
  kStreams,    // the residual streams before the model's head collapses them [streams, hidden]
};

class MtpDrafter {
 public:
  virtual ~MtpDrafter() = default;
  virtual MtpInput input() const = 0;
  // Floats a token of the input state and of Forward's output.
  virtual int state_width() const = 0;
  virtual int cache_layer() const = 0;
  virtual KvLayerShape CacheShape(int block_size) const = 0;
  // out [T, state_width] from states `hidden` [T, state_width] (the model's, or this drafter's
  // own output when chaining) and the embedded next tokens `embedded` [T, hidden]
  // (tokens.token_ids are those tokens, tokens.positions the positions of the states); writes the
  // layer's KV at those positions.
  virtual absl::Status Forward(const float* hidden, const float* embedded, const StepTokens& tokens,
                               PagedKvCache& cache, float* out, CpuCompute& compute) = 0;
  // logits [rows, vocab] for `rows` rows of Forward's output.
  virtual absl::Status Logits(const float* o, int rows, float* logits, CpuCompute& compute) const = 0;
};

// The model's config with its MTP layer as one more layer (index cfg.num_layers), as the drafters'
// blocks load and run it: an attention layer (DSA and GLM-5.3-Flash's k-pooled DSA running their own
// indexer; never a recurrent mixer), MoE when `moe` (the layer stores a router).
ModelConfig WithMtpLayer(const ModelConfig& cfg, bool moe);

}  // namespace exl3::engine

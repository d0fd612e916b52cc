// A whole model's forward pass on the CPU, in fp32: embeddings; per layer input norm → attention
// → residual → post-attention norm → MoE block or dense MLP → residual; final norm; head. The
// engine's ModelRunner for machines without a GPU (and the reference the GPU runner is checked
// against).
//
//   CpuModelOptions o;                               // o.num_threads = 0: every hardware thread
//   EXL3_ASSIGN_OR_RETURN(auto model, CpuModel::Open("/models/glm-exl3", o));   // experts here
//   // or CpuModel::Open(dir, o, std::move(remote_moe)) with the experts on workers
//
// Linear layers are EXL3 or dense as the files store them (engine/cpu/linear.h); embeddings and norms
// as stored, converted to fp32; a tied head reuses the embedding matrix. DeepSeek-V4 (and
// GLM-5.3-Flash, whose head is the streams' mean) keeps
// hc_mult residual streams per token instead of one, mixed around each block by its
// hyper-connections (engine/cpu/residual/hyper_connections.h) and collapsed by hc_head before the final norm.
// Qwen4-Exp keeps hc_count streams too, mixed by its gated residual connections
// (engine/cpu/residual/gated_residual.h) in place of the layer norms, PLE n-gram layers
// (engine/cpu/residual/ple_layer.h) ahead of some layers, and no final norm.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/attention/attention.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/residual/gated_residual.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/linear_attention/linear_attention.h"
#include "engine/config/model_config.h"
#include "engine/core/kept_chunks.h"
#include "engine/core/model_runner.h"
#include "engine/core/moe_executor.h"
#include "engine/cpu/mtp/dspark_drafter.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/cpu/residual/ple_layer.h"
#include "engine/cpu/sequence_state.h"
#include "model/config/config_file.h"
#include "model/safetensors.h"

namespace exl3::engine {

struct CpuModelOptions {
  int num_threads = 0;       // 0: every hardware thread
  std::string served_name;   // empty: the directory's base name
  // A step of two or more sequences runs as this many micro-batches (1 or 2) whose layers
  // alternate: one's attention runs while the other's MoE call is out (MegaScale-Infer's
  // ping-pong). It pays when the MoE runs elsewhere (workers); the tokens are the same either way.
  int micro_batches = 1;
  // kOwned: the weights this model reads (its experts too, when held here) are moved into memory
  // the process owns as they load, so a model file changed under the server cannot crash it.
  TensorResidency residency = TensorResidency::kMapped;
};

class CpuModel final : public ModelRunner {
 public:
  // `moe` null: the experts are loaded from `dir` and run in this process (engine/cpu/local_moe.h).
  // Reads DIR/config.json (ConfigFile::Read) and opens the model.
  static absl::StatusOr<std::unique_ptr<CpuModel>> Open(const std::string& dir,
                                                        const CpuModelOptions& options,
                                                        std::unique_ptr<MoeExecutor> moe = nullptr);
  // `config`: DIR's config.json as the caller read it (ConfigFile::Read); the file is not read
  // again (a process that also opens the experts or a router core hands all of them one read).
  static absl::StatusOr<std::unique_ptr<CpuModel>> Open(const std::string& dir, const ConfigFile& config,
                                                        const CpuModelOptions& options,
                                                        std::unique_ptr<MoeExecutor> moe = nullptr);

  const ModelInfo& info() const override { return info_; }
  const ModelConfig& config() const { return cfg_; }
  absl::Status AllocateKvCache(const KvCacheShape& shape) override;
  absl::Status Forward(const StepBatch& batch, float* logits) override;
  StepPhaseTimes LastPhaseTimes() const override { return times_; }
  // OK for the families that keep nothing per sequence but each position's KV (GQA, MLA, DSA,
  // GLM-5.3-Flash's pooled and Qwen4-Exp's block indexers): a rejected draft's KV is overwritten
  // when its position runs again and never read before; and for the recurrent layers beside them,
  // which keep the state after each verify position (engine/cpu/sequence_state.h), and DeepSeek-V4,
  // whose compressed layers keep their accumulators after each verify position
  // (engine/cpu/attention/dsv4_kept_accumulators.h).
  absl::Status CheckDraftVerification() const override;
  // OK for every family: Forward computes any rows a chunk asks for, and a prompt chunk's
  // positions are all kept (no state or compressed cache to roll back).
  absl::Status CheckPromptLogitRows() const override { return absl::OkStatus(); }
  // The checkpoint's MTP head (engine/cpu/mtp/mtp_drafter.h): the DeepSeek-V3 design of DeepseekV3,
  // Glm4Moe, GlmMoeDsa and Glm5Next checkpoints, Qwen4-Exp's mtp.*; refused otherwise, naming what
  // is missing.
  absl::Status CheckMtpDrafting() const override;
  // Loads the MTP layer; its KV becomes one more layer of the cache.
  absl::Status EnableMtpDrafting() override;
  absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeMtpDrafts(std::span<const MtpSpan> spans) override;
  // The MTP layer run over the spans' kept positions as ProposeMtpDrafts runs it (writing its KV),
  // returning the logits of every one of them: [Σ num_positions, vocab] in span order.
  absl::StatusOr<std::vector<float>> MtpLogits(std::span<const MtpSpan> spans);

 private:
  struct DenseMlp {
    Linear gate, up, down;
  };
  struct Layer {
    std::vector<float> input_norm, post_attention_norm;
    // The token mixer: attention over the KV cache, or (linear_attention layers: Qwen3-Next's
    // gated DeltaNet, GLM-5.3-Flash's KDA) linear attention over the per-sequence state; exactly
    // one is set.
    std::unique_ptr<Attention> attention;
    std::unique_ptr<LinearAttention> linear_attention;
    std::optional<DenseMlp> dense_mlp;  // unset on MoE layers
    std::optional<HyperConnection> attn_hc, ffn_hc;  // DeepSeek-V4, GLM-5.3-Flash
    std::optional<GatedResidual> attn_gr, ffn_gr;    // Qwen4-Exp only (no layer norms then)
    std::unique_ptr<PleLayer> ple;                   // Qwen4-Exp's PLE layers only
  };

  // One micro-batch's tokens and activations through the layers.
  struct MicroBatch {
    StepTokens tokens;
    std::vector<float> h, x, d;       // residual stream, normed input, block output [T, hidden]
                                      // (h: [T, hc_mult, hidden] with hyper-connections)
    AttentionCarry carry;             // what a layer's attention leaves for later layers
    HyperConnectionMix mix;           // hyper-connections: the open block's post / comb weights
    std::vector<float> inject;        // gated residual: the open block's injection weights [T, streams]
    std::vector<float> taps;          // DSPARK drafting: [T, taps * hidden] (TapLayer)
    int pending_layer = -1;           // the layer whose MoE call is in flight
    std::unique_ptr<MoeCall> pending;  // its MoE call in flight (declared last: waited first)
  };

  CpuModel(ModelConfig cfg, int num_threads) : cfg_(std::move(cfg)), compute_(num_threads) {}
  absl::Status LoadWeights(const TensorSource& src);
  // Qwen4-Exp: embeddings, per layer the gated residual connections, PLE, token mixer; the
  // mixer before the head; the vision tower beside them (loaded, not run); the MTP head's
  // tensors are counted (run only as the mtp drafter).
  absl::Status LoadQwen4ExpWeights(const TensorSource& src);
  // h [T, streams, hidden]: each token's embedding in every one of its `streams` rows.
  void Embed(const std::vector<int32_t>& token_ids, int streams, float* h) const;
  absl::Status RunDenseMlp(const DenseMlp& mlp, const float* x, int num_tokens, float* y);
  // Attention half of layer l (norm, attention, residual, post-attention norm into mb.x), then
  // the dense MLP, or the MoE call started (its result added by FinishMoe).
  absl::Status RunLayer(int l, MicroBatch& mb);
  // RunLayer with hyper-connections: each block's input is its streams collapsed, its output
  // expanded back into them (the MoE's by FinishMoe).
  absl::Status RunHyperConnectedLayer(int l, MicroBatch& mb);
  // Layer L's token mixer on mb.x into mb.d.
  absl::Status MixTokens(const Layer& L, MicroBatch& mb);
  // RunLayer with Qwen4-Exp's gated residual connections: PLE first where the layer has one.
  absl::Status RunGatedResidualLayer(int l, MicroBatch& mb);
  absl::Status FinishMoe(MicroBatch& mb);
  // The MTP layer's step over the spans' kept positions (logit rows: every position, or the
  // last of the decoding spans), with their hidden states from kept_.
  absl::Status MtpBatchOf(std::span<const MtpSpan> spans, bool every_position, StepBatch* batch,
                          std::vector<float>* hidden) const;
  // o = the head's output rows of the batch's logit rows, logits = their logits.
  absl::Status RunMtp(const StepBatch& batch, const std::vector<float>& hidden, std::vector<float>* o,
                      std::vector<float>* logits);
  // kept_ = every token's state the MTP drafter reads (MtpInput): the final norm of its residual
  // stream (hyper-connected streams collapsed by hc_head first: what the model's head reads), or
  // its residual streams as they are (Qwen4-Exp: before the mixer collapses them).
  // DeepSeek-V4's DSPARK drafter: kept_ = every token's taps [T * hidden] instead.
  void KeepHiddenStates(const StepBatch& batch, const std::vector<MicroBatch>& mbs);
  // DSPARK drafting: when `layer` is one of dspark_target_layer_ids, its output (complete: after
  // its MoE's hyper-connection expand) averaged over the streams into mb.taps at that tap's slot.
  void TapLayer(int layer, MicroBatch& mb) const;
  // ProposeMtpDrafts with the DSPARK drafter: each span's main-kv rows written at its kept
  // positions (cache layer num_layers), then per decoding span one block draft at
  // p0 = start_position + num_positions, seed next_tokens.back(); up to num_drafts of its drafts,
  // fewer (none) where its confidence length is shorter.
  absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeDsparkDrafts(std::span<const MtpSpan> spans);

  ModelConfig cfg_;
  ModelInfo info_;
  CpuCompute compute_;
  std::unique_ptr<TensorSource> src_;
  TensorView embedding_;  // [vocab, hidden] as stored (rows converted on gather)
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;
  int streams_ = 1;                  // residual streams per token (hyper-connections: hc_mult)
  std::optional<HyperHead> hc_head_;  // hyper-connections: collapses the streams before the final norm
  std::optional<GatedResidual> final_mixer_;  // Qwen4-Exp: collapses the streams into the head's input
  Linear head_;
  std::unique_ptr<MtpDrafter> mtp_head_;      // speculative method mtp (EnableMtpDrafting)
  std::unique_ptr<DsparkDrafter> dspark_;     // DeepSeek-V4's mtp.* block drafter instead
  // The last Forward's states the MTP drafter reads when its batch asked to keep them: [step
  // tokens, its state_width()] in chunk order, and which chunks they are.
  struct KeptHiddenStates {
    std::vector<float> rows;
    KeptChunks chunks;
  };
  KeptHiddenStates kept_;
  std::unique_ptr<MoeExecutor> moe_;
  std::unique_ptr<PagedKvCache> cache_;
  std::unique_ptr<SequenceStateStore> states_;  // models with recurrent layers only
  int micro_batches_ = 1;
  StepPhaseTimes times_;
};

}  // namespace exl3::engine

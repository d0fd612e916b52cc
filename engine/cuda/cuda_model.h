// A whole model's forward pass on one NVIDIA GPU: the CUDA backend of the engine's ModelRunner
// (engine/core/model_runner.h), the CPU model's layer loop (engine/cpu/cpu_model.h) on device memory. A
// layer is its token mixer (engine/cuda/cuda_mixer.h: GQA, latent attention, gated DeltaNet or
// DeepSeek-V4's attention, each kind with its own cache and workspace) and a dense MLP or an MoE
// block (engine/cuda/cuda_moe.h: the gate on the device, the experts in process or on expert
// workers, ping-pong micro-batches), joined by the residual stream (engine/cuda/residual_stream.h:
// plain, or DeepSeek-V4's hyper-connections) with its norms. One loop runs every family with the
// experts anywhere:
//
//   embed → per layer, per micro-batch: [its previous MoE answer] → mixer input → mixer →
//   MLP input → dense MLP / experts (in process at once, remote: sent) → ... → head input → head
//
// EXL3 linear layers run on the project's kernels and dense ones through cuBLAS
// (engine/cuda/cuda_linear.h). The step's per-token facts go to the device in one transfer
// (engine/cuda/step_facts.h); decode steps replay CUDA graphs (engine/cuda/decode_graphs.h); the
// head's logits are sampled on the GPU (engine/cuda/device_sampler.h: only the tokens come back)
// when the engine asks ForwardSampled, or copied to the host for the engine's sampler.
// Activations are fp32.
//
//   EXL3_ASSIGN_OR_RETURN(auto model, CudaModel::Open("/models/glm-exl3", CudaModelOptions{}));
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mixer.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/decode_graphs.h"
#include "engine/cuda/dense_mlp.h"
#include "engine/cuda/finite_check.h"
#include "engine/cuda/mtp_drafting.h"
#include "engine/cuda/device_context.h"
#include "engine/cuda/device_sampler.h"
#include "engine/cuda/phase_timer.h"
#include "engine/cuda/remote_moe_exchange.h"
#include "engine/cuda/residual_stream.h"
#include "engine/cuda/step_facts.h"
#include "engine/cuda/weight_bytes.h"
#include "engine/core/micro_batches.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/moe_executor.h"
#include "model/config/config_file.h"

namespace exl3::engine::cuda {

struct CudaModelOptions {
  std::string served_name;  // empty: the directory's base name
  // Token rows of the MoE kernels' workspace (one workspace serves every layer); a step with more
  // tokens runs its MoE layers in pieces of this many, each piece decoding every expert it touches
  // again. 2048, the scheduler's default step budget (engine/core/scheduler.h max_num_batched_tokens):
  // one piece per step (on an H200, 46 GLM-4.5-Air-shaped layers: time to first token 241 -> 199 ms
  // at 1k, 2434 -> 1864 ms at 8k against 512), for a workspace of about 0.8 GB at those shapes.
  int max_moe_tokens = 2048;
  // Decode steps (one token per sequence, up to 64 sequences, experts on this GPU) replay a CUDA
  // graph captured per batch-size bucket (engine/cuda/decode_graphs.h). A capture that fails turns
  // graphs off with a warning. DeepSeek-V4 ignores it (engine/cuda/dsv4_mixer.h says why).
  bool cuda_graphs = true;
  // With cuda_graphs, speculative decoding's verify steps of one shape replay a graph too
  // (engine/cuda/decode_graphs.h). Their replays match eager steps on an H100
  // (tests/engine/cuda/cuda_model_test.cc CudaVerifyGraphTest), but they stay off until a run
  // through the engine shows them correct and faster (bench/results/engine-h100.md, session 22).
  bool verify_graphs = false;
  // Chunks of at least kPrefillMinTokens tokens of one sequence (head dims 64, 128, 256) run
  // attention on the tensor-core prefill kernel; off: every token through the decode kernel.
  // Latent attention (MLA, DSA): on, every token's attention products on tensor cores (where the
  // shape allows); off, on CUDA cores in fp32.
  bool tensor_core_prefill = true;
  // The engine's rows are sampled on the GPU (SamplesRows / ForwardSampled); off: every step's
  // logits go to the host for the engine's sampler.
  bool device_sampling = true;
  // With remote experts, a step of two sequences or more runs as this many micro-batches (1 or 2,
  // engine/core/micro_batches.h) whose layers alternate: one's hidden states are out at the workers
  // while the other's attention runs on the GPU (MegaScale-Infer's ping-pong). Each token's
  // arithmetic is the same either way. In-process experts ignore it (no exchange to hide).
  int micro_batches = 1;
  // After each block of each layer, wait for the GPU and fail the step naming the first layer and
  // block whose output holds a NaN or an infinity (engine/cuda/finite_check.h). A debugging aid: it
  // synchronises per block and turns decode graphs off.
  bool check_finite = false;
};

class CudaModel final : public ModelRunner {
 public:
  // `remote_moe` null: every expert is loaded from `dir` onto the GPU. Reads DIR/config.json
  // (ConfigFile::Read) and opens the model.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Open(const std::string& dir,
                                                         const CudaModelOptions& options,
                                                         std::unique_ptr<MoeExecutor> remote_moe = nullptr);
  // `config`: DIR's config.json as the caller read it (ConfigFile::Read); the file is not read again.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Open(const std::string& dir, const ConfigFile& config,
                                                         const CudaModelOptions& options,
                                                         std::unique_ptr<MoeExecutor> remote_moe = nullptr);
  ~CudaModel() override;

  const ModelInfo& info() const override { return info_; }
  const ModelConfig& config() const { return cfg_; }
  absl::Status AllocateKvCache(const KvCacheShape& shape) override;
  absl::Status Forward(const StepBatch& batch, float* logits) override;
  // A verify chunk runs as a decode-like chunk of several tokens (in a verify graph where every
  // chunk of the step has the same length, engine/cuda/decode_graphs.h) and wants the logits of its
  // last rows (StepTokens::logit_tokens). Attention keeps nothing of a rejected position but
  // its cache slot, which the sequence's next chunk overwrites before anything reads it: GLM-5.3-
  // Flash's k-pooled indexer and Qwen4-Exp's QSA form each query's pool / block keys afresh from
  // the complete pools at or before its own position (engine/cuda/kpool_indexer_kernels.h,
  // qsa_kernels.h). Recurrent layers (gated DeltaNet, KDA, PLE) keep a verify chunk's state after
  // each of its positions in the device store (engine/cuda/device_sequence_states.h) and PLE's
  // windows their contexts (engine/cuda/ple_windows.h). DeepSeek-V4's compressors keep their
  // accumulators after each verify row per state slot, and the next chunk restores the accepted
  // length's before folding on (engine/cuda/dsv4_kept_row_slots.h); the entries of windows that
  // rejected drafts closed are written again before anything reads them.
  absl::Status CheckDraftVerification() const override;
  // Prompt chunks wanting every row run eagerly like any prefill chunk; the step's logit rows
  // (StepTokens::logit_tokens) come back whatever their number.
  absl::Status CheckPromptLogitRows() const override { return absl::OkStatus(); }
  bool SamplesRows(const SamplingParams& params) const override {
    return sampler_ != nullptr && DeviceSampler::Supports(params);
  }
  absl::Status ForwardSampled(const StepBatch& batch, std::span<const RowSampling> rows,
                              std::span<SampledToken> tokens, const std::function<void()>& masks_ready) override;
  absl::Status MaskedRowLogits(int row, std::span<float> logits) override;
  // The checkpoint's MTP head on this GPU (engine/cuda/cuda_mtp_drafter.h: the DeepSeek-V3 design of
  // DeepseekV3, Glm4Moe, GlmMoeDsa and Glm5Next, Qwen4-Exp's; DeepSeek-V4's DSPARK block drafter,
  // engine/cuda/cuda_dspark_drafter.h); refused by name otherwise.
  absl::Status CheckMtpDrafting() const override;
  // Loads the MTP layer from the model's directory; its KV (DSPARK: each position's main-kv rows)
  // becomes one more cache layer.
  absl::Status EnableMtpDrafting() override;
  absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeMtpDrafts(std::span<const MtpSpan> spans) override;
  const CudaWeightBytes& weight_bytes() const { return weight_bytes_; }
  // GPU time of the last Forward by phase (device events between the phases' launches).
  StepPhaseTimes LastPhaseTimes() const override { return last_.phases; }
  // With remote experts: the last Forward's exchanges (copies out and back, calls); else empty.
  const RemoteExchangeTimes& LastExchangeTimes() const { return last_.exchange; }
  int micro_batches() const { return moe_ != nullptr ? moe_->micro_batches() : 1; }
  // Steps run by replaying a decode or verify graph (engine/cuda/decode_graphs.h), ever.
  int64_t graph_replays() const { return graphs_->replays(); }

 private:
  using FeedForward = std::variant<CudaDenseMlp, CudaMoeLayer>;
  // Device activations, grown to the largest step seen.
  struct Activations {
    DeviceArray<float> x, d;         // [rows, hidden]: the blocks' input and output
    DeviceArray<float> gate, up;     // [rows, intermediate]: dense MLPs
    DeviceArray<float> head_in, logits;  // [logit rows, hidden], [logit rows, vocab]
  };
  // The token embeddings on the device.
  struct Embedding {
    DeviceArray<uint8_t> table;  // [vocab, hidden] as stored
    EmbeddingDType dtype = EmbeddingDType::kF32;
  };
  // The last step's GPU time by phase and, with remote experts, its exchanges.
  struct LastStepTimes {
    StepPhaseTimes phases;
    RemoteExchangeTimes exchange;
  };
  // Where a step's head output goes: the logits to the host, or the rows sampled on the device.
  struct StepOutput {
    float* logits = nullptr;  // host [rows, vocab]; null: sample
    std::span<const RowSampling> rows;
    std::span<SampledToken> tokens;
    const std::function<void()>* masks_ready = nullptr;  // called before the rows are read
  };

  explicit CudaModel(ModelConfig cfg) : cfg_(std::move(cfg)) {}
  // `file`: dir's config.json as Open read it.
  absl::Status Load(const std::string& dir, const ConfigFile& file, const CudaModelOptions& options,
                    std::unique_ptr<MoeExecutor> remote_moe);
  // Grows every step buffer for `rows` rows, `logit_rows` head rows and `splits` attention splits
  // (dropping the decode graphs when an address changes).
  absl::Status Reserve(int rows, int logit_rows, int splits);
  // Packs and uploads the step's facts (the model's and its mixer kinds') into `device`.
  absl::StatusOr<const CudaStep*> PrepareStep(const StepTokens& tokens, const StepLayout& layout,
                                              DeviceArray<int32_t>* device);
  // Every launch of a step from the embeddings to the head's logits; `micro_batches` partition
  // the step's rows; host_token_ids: the step's (remote experts), or null.
  // keep_states: every row's state the MTP drafter reads into the MTP drafting's kept rows too (its head input,
  // the residual streams before the head, or the DSPARK drafter's taps).
  absl::Status RunLayers(const CudaStep& step, const std::vector<MicroBatchRange>& micro_batches, int logit_rows,
                         const int32_t* host_token_ids, bool keep_states = false);
  // The DSPARK drafter's tap of layer `layer` (if it taps it) for rows [first, first + n): the
  // stream mean of its output into its slot of the kept rows.
  absl::Status TapLayer(int layer, int first, int n);
  // With check_finite: OK where rows [first, first + n) of `values` ([rows, width]) are finite.
  absl::Status CheckFinite(const float* values, int first, int n, int width, const char* block, int layer);
  // Micro-batch m's answer of its MoE layer `layer` (if out) into its rows of d.
  absl::Status FinishMoe(int layer, int m, const MicroBatchRange& mb);
  // Copies the first `rows` logit rows to the host or samples them (`out`), waits for the step,
  // collects its phase times.
  absl::Status FinishStep(int rows, const StepOutput& out);
  absl::Status RunStep(const StepBatch& batch, const StepOutput& out);
  absl::Status RunEagerStep(const StepBatch& batch, const StepTokens& tokens, const StepOutput& out);
  absl::Status RunStepGraph(const StepTokens& tokens, int tokens_per_chunk, const StepOutput& out);
  // Room for a step of T rows to keep its states (before its launches).
  absl::Status ReserveKeptStates(int T);

  ModelConfig cfg_;
  ModelInfo info_;
  std::unique_ptr<DeviceContext> device_;
  Embedding embedding_;
  CudaMixers mixers_;
  std::unique_ptr<ResidualStream> residual_;
  std::vector<FeedForward> feed_forward_;  // by layer
  std::unique_ptr<CudaMoe> moe_;           // null without MoE layers
  CudaLinear head_;
  std::unique_ptr<StepFacts> facts_;
  std::unique_ptr<DecodeGraphs> graphs_;
  std::unique_ptr<PhaseTimer> timer_;
  LastStepTimes last_;
  Activations act_;
  CudaWeightBytes weight_bytes_;
  std::unique_ptr<DeviceSampler> sampler_;  // null: device sampling off
  std::optional<KvCacheShape> cache_shape_;  // once AllocateKvCache ran
  std::unique_ptr<FiniteCheck> finite_check_;  // null unless CudaModelOptions::check_finite
  std::unique_ptr<CudaMtpDrafting> mtp_;  // speculative method mtp: loaded by EnableMtpDrafting
};

}  // namespace exl3::engine::cuda

// A whole model's forward pass on one NVIDIA GPU: the CUDA backend of the engine's ModelRunner
// (engine/model_runner.h), the same layer loop as the CPU model (engine/cpu_model.h) with every
// tensor in device memory: embedding gather, RMSNorm fused with the residual add, RoPE, the paged
// fp16 KV cache, split-K decode attention and tensor-core prefill attention
// (engine/cuda/attention_kernels.h), EXL3 linear layers through
// the project's kernels and dense ones through cuBLAS (engine/cuda/cuda_linear.h), the MoE gate on
// the device and the experts through the fused MoE kernels (kernels/cuda/cuda_backend.h), or on
// expert workers through a MoeExecutor (one device-to-host and one host-to-device copy per MoE
// layer and micro-batch, engine/cuda/remote_moe_exchange.h; with two micro-batches one's exchange
// runs while the other's attention does). The head's logits are sampled on the GPU
// (engine/cuda/device_sampler.h: only the tokens come back) when the engine asks ForwardSampled,
// or copied to the host for the engine's sampler.
//
//   EXL3_ASSIGN_OR_RETURN(auto model, CudaModel::Open("/models/glm-exl3", CudaModelOptions{}));
//
// Families: the GQA ones (Glm4Moe, Qwen3Moe, Mixtral), DeepSeek-V3's multi-head latent attention
// and GLM-MoE-DSA's (latent attention over the positions its indexer chooses;
// engine/cuda/latent_attention.h), Qwen3-Next's: per layer_types gated DeltaNet layers
// (engine/cuda/cuda_gated_deltanet.h, their per-sequence state in a device store beside the KV
// cache, engine/cuda/device_sequence_states.h) or gated full attention (q_proj's query and output
// gate per head), zero-centred norm weights, the shared expert's sigmoid gate in the MoE kernels,
// and DeepSeek-V4 (its sliding-window / compressed attention, engine/cuda/dsv4_attention.h,
// between hyper-connections, engine/cuda/hyper_connection_kernels.h; hash-routed MoE layers gated
// from the step's token ids; experts in process, no decode graphs). Activations are fp32, the KV
// cache fp16 (DeepSeek-V4's fp32, in the CPU engine's layout with its compressor state), the
// recurrent state fp32.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_gated_deltanet.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/device_sequence_states.h"
#include "engine/cuda/device_sampler.h"
#include "engine/cuda/dsv4_attention.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/latent_attention.h"
#include "engine/cuda/remote_moe_exchange.h"
#include "engine/model_config.h"
#include "engine/micro_batches.h"
#include "engine/model_runner.h"
#include "engine/moe_executor.h"
#include "engine/rope.h"
#include "engine/step_tokens.h"

namespace exl3::engine::cuda {

struct CudaModelOptions {
  std::string served_name;  // empty: the directory's base name
  // Token rows of the MoE kernels' workspace (one workspace serves every layer); a step with more
  // tokens runs its MoE layers in pieces of this many, each piece decoding every expert it touches
  // again. 2048, the scheduler's default step budget (engine/scheduler.h max_num_batched_tokens):
  // one piece per step (on an H200, 46 GLM-4.5-Air-shaped layers: time to first token 241 -> 199 ms
  // at 1k, 2434 -> 1864 ms at 8k against 512), for a workspace of about 0.8 GB at those shapes.
  int max_moe_tokens = 2048;
  // Decode steps (one token per sequence, up to 64 sequences, experts on this GPU) replay a CUDA
  // graph captured per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, 64; padded to the bucket):
  // one launch instead of a few hundred. A capture that fails turns graphs off with a warning.
  // DeepSeek-V4 ignores it (its decode steps run eagerly: engine/cuda/cuda_model.cc Open says why).
  bool cuda_graphs = true;
  // Chunks of at least kPrefillMinTokens tokens of one sequence (head dims 64, 128, 256) run
  // attention on the tensor-core prefill kernel; off: every token through the decode kernel.
  // Latent attention (MLA, DSA): on, every token's attention products on tensor cores (where the
  // shape allows); off, on CUDA cores in fp32.
  bool tensor_core_prefill = true;
  // The engine's rows are sampled on the GPU (SamplesRows / ForwardSampled); off: every step's
  // logits go to the host for the engine's sampler.
  bool device_sampling = true;
  // With remote experts, a step of two sequences or more runs as this many micro-batches (1 or 2,
  // engine/micro_batches.h) whose layers alternate: one's hidden states are out at the workers
  // while the other's attention runs on the GPU (MegaScale-Infer's ping-pong). Each token's
  // arithmetic is the same either way. In-process experts ignore it (no exchange to hide).
  int micro_batches = 1;
};

// EXL3 weights a forward decodes, by bit width and codebook (the benchmarks' decode floor: the
// trellis decode, not the bytes, bounds an EXL3 layer below K of about 7 on an H200).
struct DecodedWeights {
  int64_t count[9][3] = {};  // [K][codebook]
  void Add(const Exl3LinearView& v) {
    count[v.bits][static_cast<int>(v.codebook)] += static_cast<int64_t>(v.in_features) * v.out_features;
  }
};

// Bytes of weights, by part, that a forward reads, and the EXL3 weights it decodes (for the
// benchmarks' floors).
struct CudaWeightBytes {
  int64_t attention = 0, dense_mlp = 0, router = 0, head = 0, embedding_row = 0;
  int64_t experts_resident = 0;  // routed and shared experts held on this GPU
  DecodedWeights attention_decoded, dense_mlp_decoded, head_decoded;
  DecodedWeights experts_decoded;  // every resident expert
};

class CudaModel final : public ModelRunner {
 public:
  // `remote_moe` null: every expert is loaded from `dir` onto the GPU.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Open(const std::string& dir,
                                                         const CudaModelOptions& options,
                                                         std::unique_ptr<MoeExecutor> remote_moe = nullptr);
  ~CudaModel() override;

  const ModelInfo& info() const override { return info_; }
  const ModelConfig& config() const { return cfg_; }
  absl::Status AllocateKvCache(const KvCacheShape& shape) override;
  absl::Status Forward(const StepBatch& batch, float* logits) override;
  bool SamplesRows(const SamplingParams& params) const override {
    return device_sampling_ && DeviceSampler::Supports(params);
  }
  absl::Status ForwardSampled(const StepBatch& batch, std::span<const RowSampling> rows,
                              std::span<SampledToken> tokens) override;
  const CudaWeightBytes& weight_bytes() const { return weight_bytes_; }
  // GPU time of the last Forward by phase (device events between the phases' launches).
  StepPhaseTimes LastPhaseTimes() const override { return times_; }
  // With remote experts: the last Forward's exchanges (copies out and back, calls); else empty.
  const RemoteExchangeTimes& LastExchangeTimes() const { return exchange_times_; }
  int micro_batches() const { return micro_batches_; }

 private:
  struct DenseMlp {
    CudaLinear gate, up, down;
  };
  struct MoeBlock {
    CudaLinear router;                 // [E, hidden] fp32
    DeviceArray<float> bias;           // correction bias [E] or empty
    DeviceArray<int32_t> hash_table;   // hash-routed layers: tid2eid [vocab, top_k]; else empty
    std::unique_ptr<exl3::cuda::DeviceMoeLayer> experts;  // null with remote experts
  };
  // One hyper-connection's weights on the device (DeepSeek-V4).
  struct HyperConnectionWeights {
    DeviceArray<float> fn, base;
    HyperConnectionArgs args;  // fn and base point into the arrays above
  };
  struct Layer {
    DeviceArray<float> input_norm, post_attention_norm, q_norm, k_norm;
    CudaLinear q, k, v, o;
    std::unique_ptr<CudaLatentAttention> latent;  // MLA / DSA models: instead of q, k, v, o
    std::unique_ptr<CudaGatedDeltaNet> deltanet;  // linear attention layers: instead of q, k, v, o
    std::unique_ptr<CudaDsv4Attention> dsv4;      // DeepSeek-V4: instead of q, k, v, o
    std::optional<HyperConnectionWeights> attn_hc, ffn_hc;  // DeepSeek-V4
    std::optional<DenseMlp> dense_mlp;
    std::optional<MoeBlock> moe;
  };
  // Device activations, grown to the largest step seen.
  struct Activations {
    DeviceArray<float> h, x, d, q, k, v, attn, gate, up, router_logits, topk_weights, scratch,
        head_in, logits;
    DeviceArray<float> qg, qgate;  // gated attention: q_proj's output, the heads' output gates
    DeviceArray<float> hc_post, hc_comb, head_pre;  // DeepSeek-V4: the mix [T, N], [T, N, N]; the head's collapse
    DeviceArray<int32_t> topk_ids;
  };
  // The step's per-token facts, packed on the host and copied to the device in one transfer.
  struct StepMeta {
    std::vector<int32_t> host;
    DeviceArray<int32_t> device;  // eager steps'; a decode graph has its own (its addresses are fixed)
    const int32_t *ids = nullptr, *position = nullptr, *first_visible = nullptr, *slot = nullptr,
                  *table_offset = nullptr, *tables = nullptr, *logit_rows = nullptr,
                  *split_positions = nullptr;
    const float *cos = nullptr, *sin = nullptr;
    // Recurrent layers: each token's chunk and the chunks [first token, tokens, state row read,
    // state row written] (DeltaNetChunks).
    const int32_t *state_chunk_of = nullptr, *state_chunks = nullptr;
  };
  // How PrepareStep lays the step out.
  struct StepLayout {
    int tokens = 0;        // rows run: the step's tokens, or a decode graph's bucket (padded)
    int table_stride = 0;  // 0: the chunks' block tables packed; else chunk c's at c * stride
    int splits = 0;        // attention splits; 0: chosen from the step's longest context
  };
  // A captured decode step for one batch-size bucket.
  struct DecodeGraph {
    int table_stride = 0;
    DeviceArray<int32_t> meta;  // the step's facts, rewritten before each replay
    void* exec = nullptr;       // cudaGraphExec_t; null until captured
    StepPhaseTimes phases;      // of the eager run before the capture, to apportion replays' time
    uint64_t workspace_allocations = 0;  // the kernels' workspace it was captured with
  };

  // Where a step's head output goes: the logits to the host, or the rows sampled on the device.
  struct StepOutput {
    float* logits = nullptr;  // host [rows, vocab]; null: sample
    std::span<const RowSampling> rows;
    std::span<SampledToken> tokens;
  };

  // Device events marking where each phase's work ends on the stream.
  enum class Phase { kStart, kEmbed, kAttention, kDenseMlp, kMoe, kHead, kSample };
  struct PhaseMark {
    void* event;  // cudaEvent_t
    Phase phase;  // of the work between the previous mark and this one
  };

  explicit CudaModel(ModelConfig cfg);
  absl::Status Mark(Phase phase);
  absl::Status CollectPhaseTimes();  // after the step's synchronisation
  absl::Status Load(const std::string& dir);
  // Grows the activations for a step (dropping every decode graph when an address changes).
  absl::Status Reserve(int num_tokens, int num_logit_rows, int attention_splits);
  int SplitsFor(int num_tokens, int longest_context) const;
  int AttentionBlocksPerToken() const;  // attention blocks of one token and split
  // Packs the step's facts as `layout` says, copies them into `device` and points meta_ there.
  absl::Status PrepareStep(const StepTokens& tokens, const StepLayout& layout, DeviceArray<int32_t>* device);
  // Every launch of a step from the embeddings to the head's logits on the device. host_token_ids:
  // for remote experts (hash routing), null otherwise.
  absl::Status RunLayers(int num_tokens, int num_logit_rows, const int32_t* host_token_ids);
  // The layers with remote experts: the step's micro-batches (step_micro_batches_) alternate
  // attention on the GPU and their exchange.
  absl::Status RunRemoteLayers(const int32_t* host_token_ids);
  // DeepSeek-V4's layers (hc_mult residual streams, engine/hyper_connections.h) from the
  // embeddings to the head's logits.
  absl::Status RunHyperConnectedLayers(int num_tokens, int num_logit_rows);
  absl::StatusOr<HyperConnectionWeights> LoadHyperConnection(const TensorSource& src, const std::string& prefix) const;
  // Layer l up to its MLP's input for rows [first, first + n): the residual joins the previous
  // layer's output, the input norm, attention, the residual, the post-attention norm into x.
  absl::Status RunAttentionHalf(int l, int first, int n);
  absl::Status RunDenseMlp(int l, int first, int n);
  // attention_runs_ for the step's `num_rows` rows (its tokens, then a decode graph's padding).
  void PlanAttention(const StepTokens& tokens, int num_rows);
  // Attention of layer l for rows [first, first + n) of the step (a micro-batch, or all of it).
  absl::Status RunAttention(int l, int first, int n);
  absl::Status RunMoe(int l, int num_tokens);  // in-process experts
  // The gate of layer l on the device for rows [first, first + n): their router logits, then their
  // top-k into act_.topk_ids / topk_weights (DeviceRouting(first) points at them).
  absl::Status RouteRows(int l, int first, int n);
  MoeRouting DeviceRouting(int first) const;
  // Copies the first `rows` logit rows to the host or samples them (`out`), waits for the step,
  // collects its phase times.
  absl::Status FinishStep(int rows, const StepOutput& out);
  absl::Status ForwardDecodeGraph(const StepTokens& tokens, const StepOutput& out);
  absl::Status RunStep(const StepBatch& batch, const StepOutput& out);
  absl::Status RunEagerStep(const StepBatch& batch, const StepTokens& tokens, const StepOutput& out);
  // The DeltaNet facts of rows [first, first + n) (whole chunks).
  DeltaNetStep DeltaNetStepFor(int first, int n) const;
  void DropGraphs();

  ModelConfig cfg_;
  ModelInfo info_;
  Rope rope_;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t
  std::unique_ptr<exl3::cuda::Workspace> workspace_;
  CudaLinearContext ctx_;
  EmbeddingDType embedding_dtype_ = EmbeddingDType::kF32;
  DeviceArray<uint8_t> embedding_;  // [vocab, hidden] as stored
  std::vector<Layer> layers_;
  DeviceArray<float> final_norm_;
  CudaLinear head_;
  GateConfig gate_;  // the MoE layers' routing, as the device gate takes it
  std::unique_ptr<exl3::cuda::MoeRunner> moe_runner_;  // in-process experts
  int max_moe_tokens_ = 0;
  std::unique_ptr<MoeExecutor> remote_moe_;
  std::unique_ptr<RemoteMoeExchange> exchange_;  // with remote_moe_
  int micro_batches_ = 1;
  std::vector<MicroBatchRange> step_micro_batches_;  // the eager step's, as RunRemoteLayers runs them
  RemoteExchangeTimes exchange_times_;
  DeviceArray<KvHalf> cache_;  // fp16, per layer [slots, KvWidth(layer)] (GQA: 2 * kv_floats)
  KvCacheShape cache_shape_;
  std::vector<size_t> layer_cache_offset_;  // where each layer's slots start in cache_
  LatentWorkspace latent_ws_;  // MLA / DSA layers' buffers
  DeltaNetWorkspace deltanet_ws_;  // gated DeltaNet layers' buffers
  // Recurrent layers' per-sequence state (made by AllocateKvCache), and the step's chunks as the
  // DeltaNet layers run them: the first token of each (in step rows), in order.
  std::unique_ptr<DeviceSequenceStates> states_;
  std::vector<int> state_chunk_first_;
  // DeepSeek-V4: the fp32 cache (per layer (num_blocks + 1) blocks of block_stride floats), the
  // step's facts, the layers' buffers, the residual streams and the head's collapse.
  DeviceArray<float> dsv4_cache_;
  std::vector<size_t> dsv4_layer_offset_;
  std::vector<int> dsv4_block_stride_;
  std::unique_ptr<Dsv4StepFacts> dsv4_facts_;
  Dsv4Step dsv4_step_;
  Dsv4Workspace dsv4_ws_;
  int streams_ = 1;  // residual streams per token (hc_mult; 1 without hyper-connections)
  DeviceArray<float> hc_head_fn_, hc_head_base_;
  float hc_head_scale_ = 1.0f;
  // The step's tokens as attention runs them: consecutive ranges, each a prefill chunk (one
  // sequence, PrefillAttention) or decode-like tokens (PagedAttention).
  struct AttentionRun {
    int first_token = 0, num_tokens = 0;
    bool prefill = false;
  };
  std::vector<AttentionRun> attention_runs_;
  bool tensor_core_prefill_ = true;
  Activations act_;
  StepMeta meta_;
  CudaWeightBytes weight_bytes_;
  int padding_block_ = 0;   // the cache's spare block (decode graphs' padding rows)
  int step_splits_ = 1;     // attention splits of the step being run
  bool graphs_enabled_ = true;
  std::vector<std::unique_ptr<DecodeGraph>> graphs_;  // by bucket index
  DeviceArray<uint8_t> cublas_workspace_;  // set on the handle, so cuBLAS allocates nothing in a capture
  bool marking_ = true;     // phase events are recorded (not while capturing)
  std::vector<void*> event_pool_;  // cudaEvent_t, created as needed, reused every step
  std::vector<PhaseMark> marks_;
  StepPhaseTimes times_;
  int sm_count_ = 0;
  bool device_sampling_ = true;
  std::unique_ptr<DeviceSampler> sampler_;
};

}  // namespace exl3::engine::cuda

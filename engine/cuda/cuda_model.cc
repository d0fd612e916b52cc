#include "engine/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/read_model_config.h"
#include "engine/cuda/load_cuda_mixers.h"
#include "engine/cuda/load_residual_stream.h"
#include "kernels/cuda/cuda_status.h"
#include "engine/config/qwen4exp_config.h"
#include "model/config/config_file.h"
#include "model/exl3_model.h"
#include "model/moe_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {
namespace {

// What the GPU engine does not run, refused by name before anything is loaded.
absl::Status CheckSupported(const ModelConfig& cfg, const CudaModelOptions& options) {
  // Recurrent layers are only known beside GQA attention layers (Qwen3-Next), GLM-5.3-Flash's
  // indexed attention and Qwen4-Exp's QSA (LoadCudaMixers' KindOf pairs each with its kind).
  if (cfg.HasRecurrentLayers() && cfg.attention != AttentionKind::kGqa && cfg.attention != AttentionKind::kPooledDsa &&
      cfg.attention != AttentionKind::kQsa)
    return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": recurrent layers beside ",
                                                 "this attention are not on the GPU engine"));
  if (options.micro_batches < 1 || options.micro_batches > 2)
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be 1 or 2, not ", options.micro_batches));
  return absl::OkStatus();
}

// The tokens of each chunk of a step a decode or verify graph can run (every chunk that many
// tokens, each wanting its logits for the next token: a decode step's 1, a verify step's k + 1),
// or 0.
int UniformTokensPerChunk(const StepBatch& batch) {
  if (batch.chunks.empty()) return 0;
  const size_t n = batch.chunks[0].tokens.size();
  for (const SequenceChunk& c : batch.chunks)
    if (c.tokens.size() != n || !c.wants_logits || c.num_logit_rows != static_cast<int>(n) ||
        c.logit_rows_use != LogitRowsUse::kNextTokens)
      return 0;
  return static_cast<int>(n);
}

}  // namespace

CudaModel::~CudaModel() {
  if (device_ != nullptr) (void)device_->Synchronize();
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Open(const std::string& dir, const CudaModelOptions& options,
                                                           std::unique_ptr<MoeExecutor> remote_moe) {
  if (exl3::cuda::DeviceCount() == 0)
    return absl::FailedPreconditionError("the CUDA engine needs a GPU and none is visible");
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Read(dir + "/config.json"));
  return Open(dir, file, options, std::move(remote_moe));
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Open(const std::string& dir, const ConfigFile& file,
                                                           const CudaModelOptions& options,
                                                           std::unique_ptr<MoeExecutor> remote_moe) {
  if (exl3::cuda::DeviceCount() == 0)
    return absl::FailedPreconditionError("the CUDA engine needs a GPU and none is visible");
  // config.json read once: the model's configuration, the experts and their fingerprint.
  EXL3_ASSIGN_OR_RETURN(ModelConfig cfg, LoadModelConfig(file, dir));
  EXL3_RETURN_IF_ERROR(CheckSupported(cfg, options));
  std::unique_ptr<CudaModel> m(new CudaModel(std::move(cfg)));
  EXL3_RETURN_IF_ERROR(m->Load(dir, file, options, std::move(remote_moe)));
  m->info_ = ModelInfoFor(m->cfg_, dir, options.served_name);
  m->info_.kv_bytes_per_token = 0;
  for (const auto& kind : m->mixers_.kinds) m->info_.kv_bytes_per_token += kind->KvBytesPerToken();
  return m;
}

absl::Status CudaModel::Load(const std::string& dir, const ConfigFile& file, const CudaModelOptions& options,
                             std::unique_ptr<MoeExecutor> remote_moe) {
  EXL3_ASSIGN_OR_RETURN(device_, DeviceContext::Create());
  const StreamHandle stream = device_->stream();
  timer_ = std::make_unique<PhaseTimer>(stream);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TensorSource> src, TensorSource::Open(dir));
  const int H = cfg_.hidden_size;
  // The language model's tensors: "model." (GLM-5.3-Flash: "model.language_model.", beside the
  // vision tower's and the MTP layer's, which stay in the mapped files unread, as on the CPU engine).
  EXL3_ASSIGN_OR_RETURN(TensorView emb, src->Get(TextModelPrefix(cfg_.moe) + "embed_tokens.weight"));
  if (emb.info->shape != std::vector<int64_t>{cfg_.vocab_size, H})
    return absl::InvalidArgumentError(absl::StrCat(emb.info->name, ": expected shape [", cfg_.vocab_size, ", ", H, "]"));
  switch (emb.info->dtype) {
    case DType::kF32: embedding_.dtype = EmbeddingDType::kF32; break;
    case DType::kF16: embedding_.dtype = EmbeddingDType::kF16; break;
    case DType::kBF16: embedding_.dtype = EmbeddingDType::kBF16; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(emb.info->name, ": embeddings of dtype ",
                                                     std::string(DTypeName(emb.info->dtype)), " are not supported"));
  }
  EXL3_RETURN_IF_ERROR(embedding_.table.Upload(emb.data, emb.size_bytes()));
  weight_bytes_.embedding_row = static_cast<int64_t>(emb.size_bytes() / cfg_.vocab_size);

  EXL3_ASSIGN_OR_RETURN(mixers_, LoadCudaMixers(cfg_, *src, device_->linear()));
  if (options.micro_batches > 1 && remote_moe != nullptr && !mixers_.rows_split())
    return absl::UnimplementedError(absl::StrCat(
        cfg_.architecture(), ": two micro-batches need attention that runs part of a step; its attention "
                             "(DeepSeek-V4's) runs a whole step at once"));
  for (const auto& mixer : mixers_.layers) {
    weight_bytes_.attention += mixer->weight_bytes();
    weight_bytes_.attention_decoded.Add(mixer->linears());
  }
  EXL3_ASSIGN_OR_RETURN(residual_, LoadResidualStream(cfg_, *src, device_->linear()));
  EXL3_RETURN_IF_ERROR(residual_->BindRecurrentStates(mixers_.recurrent_states()));
  // The routers (the gate runs on this GPU either way) and, in process, every routed and shared
  // expert. Remote experts get each micro-batch's top-k with its hidden states.
  std::unique_ptr<Exl3Model> experts;
  if (cfg_.moe.num_experts > 0) {
    Exl3ModelOptions opt;
    opt.require_exl3 = false;
    EXL3_ASSIGN_OR_RETURN(experts, Exl3Model::Open(dir, file, opt));
    EXL3_ASSIGN_OR_RETURN(moe_, CudaMoe::Create(cfg_, std::move(remote_moe),
                                                CudaMoe::Options{options.max_moe_tokens, options.micro_batches},
                                                device_->linear()));
  } else if (remote_moe != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(cfg_.architecture(), " has no MoE layers for expert workers"));
  }
  for (int l = 0; l < cfg_.num_layers; ++l) {
    if (cfg_.IsMoeLayer(l)) {
      EXL3_ASSIGN_OR_RETURN(CudaMoeLayer moe, moe_->LoadLayer(*experts, l, &weight_bytes_));
      feed_forward_.emplace_back(std::move(moe));
      continue;
    }
    EXL3_ASSIGN_OR_RETURN(CudaDenseMlp mlp, CudaDenseMlp::Load(*src, LayerPrefix(cfg_.moe, l) + "mlp.", H,
                                                               cfg_.intermediate_size, cfg_.dense_swiglu_limit));
    weight_bytes_.dense_mlp += mlp.weight_bytes();
    weight_bytes_.dense_mlp_decoded.Add(mlp.linears());
    feed_forward_.emplace_back(std::move(mlp));
  }
  // DeepSeek-V4's checkpoints name the head `head`.
  const std::string head = cfg_.dsv4 != nullptr ? "head" : "lm_head";
  if (src->Has(head + ".weight") || src->Has(head + ".trellis")) {
    EXL3_ASSIGN_OR_RETURN(head_, CudaLinear::Load(*src, head, H, cfg_.vocab_size));
  } else if (cfg_.tie_word_embeddings) {
    EXL3_ASSIGN_OR_RETURN(std::vector<float> w, ToFloat32(emb));
    EXL3_ASSIGN_OR_RETURN(head_, CudaLinear::UploadDense(w.data(), H, cfg_.vocab_size));
  } else {
    return absl::NotFoundError(absl::StrCat(head, ": no ", head, ".weight or ", head, ".trellis, and the "
                                            "embeddings are not tied (tie_word_embeddings false)"));
  }
  weight_bytes_.head = head_.weight_bytes();
  weight_bytes_.head_decoded.Add({&head_});

  facts_ = std::make_unique<StepFacts>(cfg_, mixers_.split_shape(), device_->sm_count(), options.tensor_core_prefill);
  graphs_ = std::make_unique<DecodeGraphs>(options.cuda_graphs && !options.check_finite && mixers_.graph_capturable(),
                                           options.verify_graphs);
  if (options.check_finite) {
    finite_check_ = std::make_unique<FiniteCheck>();
    residual_->SetFiniteCheck(finite_check_.get());
  }
  if (options.device_sampling) sampler_ = std::make_unique<DeviceSampler>(cfg_.vocab_size);
  const CudaMtpModelParts parts{device_->linear(), device_->sm_count(), options.tensor_core_prefill,
                                options.max_moe_tokens, embedding_.table.get(), embedding_.dtype, &head_};
  mtp_ = std::make_unique<CudaMtpDrafting>(cfg_, dir, parts, device_.get());
  // The uploads ran on the legacy stream, which the engine's non-blocking stream does not wait for.
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaModel::AllocateKvCache(const KvCacheShape& shape) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", shape.num_blocks, " blocks of ",
                                                   shape.block_size, " tokens"));
  graphs_->Drop();
  cache_shape_.reset();
  for (const auto& kind : mixers_.kinds) EXL3_RETURN_IF_ERROR(kind->AllocateCache(shape, device_->stream()));
  EXL3_RETURN_IF_ERROR(mtp_->AllocateCache(shape, device_->stream()));  // one more layer, if drafting
  facts_->SetCache(shape);
  cache_shape_ = shape;
  return absl::OkStatus();
}

absl::Status CudaModel::Reserve(int T, int R, int splits) {
  const size_t t = static_cast<size_t>(T), r = static_cast<size_t>(std::max(R, 1)), H = cfg_.hidden_size;
  const size_t I = static_cast<size_t>(cfg_.intermediate_size);
  bool moved = false;
  for (const auto& kind : mixers_.kinds) EXL3_RETURN_IF_ERROR(kind->Reserve(T, splits, &moved));
  EXL3_RETURN_IF_ERROR(residual_->Reserve(T, R, &moved));
  if (moe_ != nullptr) EXL3_RETURN_IF_ERROR(moe_->Reserve(T, &moved));
  const std::pair<DeviceArray<float>*, size_t> needs[] = {{&act_.x, t * H},         {&act_.d, t * H},
                                                          {&act_.gate, t * I},      {&act_.up, t * I},
                                                          {&act_.head_in, r * H},   {&act_.logits, r * cfg_.vocab_size}};
  for (const auto& [array, n] : needs) {
    if (array->size() >= n) continue;
    moved = true;
    EXL3_RETURN_IF_ERROR(array->Reserve(n));
  }
  if (moved) graphs_->Drop();  // they hold the old addresses
  return absl::OkStatus();
}

absl::StatusOr<const CudaStep*> CudaModel::PrepareStep(const StepTokens& tokens, const StepLayout& layout,
                                                       DeviceArray<int32_t>* device) {
  EXL3_RETURN_IF_ERROR(facts_->Pack(tokens, layout));
  std::vector<int32_t>& host = facts_->host();
  for (const auto& kind : mixers_.kinds) EXL3_RETURN_IF_ERROR(kind->PackStep(tokens, layout.rows, &host));
  EXL3_RETURN_IF_ERROR(residual_->PackStep(tokens, layout.rows, &host));
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, facts_->Upload(device, device_->stream()));
  for (const auto& kind : mixers_.kinds)
    EXL3_RETURN_IF_ERROR(kind->BindStep(*step, tokens, device->get(), device_->stream()));
  residual_->BindStep(device->get());
  return step;
}

absl::Status CudaModel::FinishMoe(int layer, int m, const MicroBatchRange& mb) {
  if (moe_ == nullptr || !moe_->in_flight(m)) return absl::OkStatus();
  EXL3_RETURN_IF_ERROR(moe_->Finish(m, mb.first_token, act_.d.get()));
  EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kMoe));  // the compute stream's wait for the experts
  return residual_->MlpOutput(layer, mb.first_token, mb.num_tokens, act_.d.get());
}

absl::Status CudaModel::RunLayers(const CudaStep& step, const std::vector<MicroBatchRange>& micro_batches, int R,
                                  const int32_t* host_token_ids, bool keep_states) {
  float* x = act_.x.get();
  float* d = act_.d.get();
  // DeepSeek-V4's DSPARK drafter keeps taps: a tapped layer's output once its MoE has joined the
  // streams, i.e. at the next layer's start (or after the last layer), as the CPU model takes them.
  const bool taps = keep_states && mtp_->kept() == CudaMtpDrafting::Kept::kTaps;
  EXL3_RETURN_IF_ERROR(residual_->Embed(embedding_.table.get(), embedding_.dtype, step.ids, step.rows, x));
  EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kEmbed));
  // Ping-pong with remote experts (as the CPU model runs it): micro-batch m waits for its own
  // previous MoE layer only, queues its attention and sends its hidden states out once that
  // attention is done; the other micro-batch's call is out meanwhile, and its attention runs on
  // the GPU while this one's call is out. Alone, a micro-batch's layers run one after the other.
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int m = 0; m < static_cast<int>(micro_batches.size()); ++m) {
      const MicroBatchRange& mb = micro_batches[m];
      const int first = mb.first_token, n = mb.num_tokens;
      if (n == 0) continue;
      EXL3_RETURN_IF_ERROR(FinishMoe(l - 1, m, mb));
      if (taps) EXL3_RETURN_IF_ERROR(TapLayer(l - 1, first, n));
      EXL3_RETURN_IF_ERROR(residual_->MixerInput(l, first, n, d, x));
      EXL3_RETURN_IF_ERROR(CheckFinite(x, first, n, cfg_.hidden_size, "mixer input", l));
      EXL3_RETURN_IF_ERROR(mixers_.layers[l]->Forward(step, x, first, n, d));
      EXL3_RETURN_IF_ERROR(CheckFinite(d, first, n, cfg_.hidden_size, "mixer", l));
      EXL3_RETURN_IF_ERROR(residual_->MlpInput(l, first, n, d, x));
      EXL3_RETURN_IF_ERROR(CheckFinite(x, first, n, cfg_.hidden_size, "feed-forward input", l));
      EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kAttention));  // norms with it, as the CPU model counts them
      if (const CudaDenseMlp* mlp = std::get_if<CudaDenseMlp>(&feed_forward_[l])) {
        const size_t rh = static_cast<size_t>(first) * cfg_.hidden_size;
        const size_t ri = static_cast<size_t>(first) * cfg_.intermediate_size;
        EXL3_RETURN_IF_ERROR(
            mlp->Forward(x + rh, n, act_.gate.get() + ri, act_.up.get() + ri, d + rh, device_->linear()));
        EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kDenseMlp));
      } else {
        EXL3_RETURN_IF_ERROR(
            moe_->Run(std::get<CudaMoeLayer>(feed_forward_[l]), step, m, first, n, x, d, host_token_ids));
        if (moe_->in_flight(m)) continue;  // its answer joins the stream at the next layer
        EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kMoe));
      }
      EXL3_RETURN_IF_ERROR(CheckFinite(d, first, n, cfg_.hidden_size, "feed-forward", l));
      EXL3_RETURN_IF_ERROR(residual_->MlpOutput(l, first, n, d));
    }
  }
  for (int m = 0; m < static_cast<int>(micro_batches.size()); ++m) {
    EXL3_RETURN_IF_ERROR(FinishMoe(cfg_.num_layers - 1, m, micro_batches[m]));
    if (taps && micro_batches[m].num_tokens > 0)
      EXL3_RETURN_IF_ERROR(TapLayer(cfg_.num_layers - 1, micro_batches[m].first_token, micro_batches[m].num_tokens));
  }
  if (keep_states && mtp_->kept() == CudaMtpDrafting::Kept::kHeadInput) {
    // Every row's head input kept (the same launches per row as the logit rows' alone), the logit
    // rows' gathered from them.
    EXL3_RETURN_IF_ERROR(residual_->HeadInput(step.rows, d, mtp_->all_rows(), step.rows, mtp_->kept_rows()));
    EXL3_RETURN_IF_ERROR(
        GatherRows(mtp_->kept_rows(), step.logit_rows, R, cfg_.hidden_size, act_.head_in.get(), device_->stream()));
  } else {
    // Qwen4-Exp's drafter reads the streams before the head collapses them.
    if (keep_states && mtp_->kept() == CudaMtpDrafting::Kept::kStreams)
      EXL3_RETURN_IF_ERROR(residual_->CopyStreams(step.rows, mtp_->kept_rows()));
    EXL3_RETURN_IF_ERROR(residual_->HeadInput(step.rows, d, step.logit_rows, R, act_.head_in.get()));
  }
  EXL3_RETURN_IF_ERROR(CheckFinite(act_.head_in.get(), 0, R, cfg_.hidden_size, "head input", cfg_.num_layers - 1));
  EXL3_RETURN_IF_ERROR(head_.Forward(act_.head_in.get(), R, act_.logits.get(), device_->linear()));
  return CheckFinite(act_.logits.get(), 0, R, cfg_.vocab_size, "head", cfg_.num_layers - 1);
}

absl::Status CudaModel::TapLayer(int layer, int first, int n) {
  const int slot = mtp_->TapSlot(layer);
  if (slot < 0) return absl::OkStatus();
  const size_t width = static_cast<size_t>(mtp_->state_width());
  return residual_->StreamMean(first, n, mtp_->kept_rows() + first * width + static_cast<size_t>(slot) * cfg_.hidden_size,
                               static_cast<int>(width));
}

absl::Status CudaModel::CheckFinite(const float* values, int first, int n, int width, const char* block, int layer) {
  if (finite_check_ == nullptr) return absl::OkStatus();
  return finite_check_->CheckRows(values, first, n, width, block, layer, device_->stream());
}

absl::Status CudaModel::FinishStep(int rows, const StepOutput& out) {
  const StreamHandle stream = device_->stream();
  if (out.logits != nullptr) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.logits, act_.logits.get(),
                                              static_cast<size_t>(rows) * cfg_.vocab_size * sizeof(float),
                                              cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
    EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kHead));
  } else {
    // Only the tokens come back: the sampling's launches follow the head (after a decode graph's
    // replay, outside it).
    EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kHead));
    // The forward pass is queued: the constraints' masks may finish filling while it runs.
    if (out.masks_ready != nullptr && *out.masks_ready) (*out.masks_ready)();
    EXL3_RETURN_IF_ERROR(sampler_->Launch(act_.logits.get(), out.rows.first(rows), stream));
    EXL3_RETURN_IF_ERROR(timer_->Mark(Phase::kSample));
  }
  EXL3_RETURN_IF_ERROR(device_->Synchronize());
  if (out.logits == nullptr) sampler_->Collect(out.tokens.first(rows));
  EXL3_ASSIGN_OR_RETURN(last_.phases, timer_->Collect());
  return absl::OkStatus();
}

absl::Status CudaModel::RunStepGraph(const StepTokens& tokens, int tokens_per_chunk, const StepOutput& out) {
  const int T = tokens.num_tokens, B = static_cast<int>(tokens.batch->chunks.size());
  const int rows = graphs_->GraphRows(B, tokens_per_chunk);
  const int splits = facts_->DecodeSplits(rows);
  EXL3_RETURN_IF_ERROR(Reserve(rows, rows, splits));  // may drop every graph
  int table_ints = 0;
  for (const SequenceChunk& c : tokens.batch->chunks)
    table_ints = std::max(table_ints, static_cast<int>(c.block_table.size()));
  DecodeGraph& g = graphs_->Get(B, tokens_per_chunk, table_ints, device_->workspace().allocations());
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, PrepareStep(tokens, StepLayout{rows, g.table_stride, splits}, &g.facts));
  const std::vector<MicroBatchRange> whole = {MicroBatchRange{0, static_cast<int>(tokens.batch->chunks.size()), 0, rows}};
  if (g.exec == nullptr) {
    // Run the step eagerly first (it sizes every workspace, so capture allocates nothing, and its
    // phase times apportion the graph's), then capture the same launches for the next steps.
    EXL3_RETURN_IF_ERROR(timer_->Begin());
    EXL3_RETURN_IF_ERROR(RunLayers(*step, whole, rows, nullptr));
    EXL3_RETURN_IF_ERROR(FinishStep(T, out));
    g.phases = last_.phases;
    g.workspace_allocations = device_->workspace().allocations();  // as the eager run left it
    timer_->set_recording(false);
    const absl::Status captured =
        graphs_->Capture(g, device_->stream(), [&] { return RunLayers(*step, whole, rows, nullptr); });
    timer_->set_recording(true);
    return captured;
  }
  EXL3_RETURN_IF_ERROR(timer_->Begin());
  EXL3_RETURN_IF_ERROR(graphs_->Replay(g, device_->stream()));
  EXL3_RETURN_IF_ERROR(FinishStep(T, out));
  // The replay's time falls between the start and the head's mark.
  last_.phases = ApportionReplay(g.phases, last_.phases.head_s, last_.phases.sample_s);
  return absl::OkStatus();
}

absl::Status CudaModel::CheckDraftVerification() const {
  switch (cfg_.attention) {
    case AttentionKind::kGqa:
    case AttentionKind::kMla:
    case AttentionKind::kDsa:
    case AttentionKind::kPooledDsa:
    case AttentionKind::kQsa:
    case AttentionKind::kDsv4:
      return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat(cfg_.architecture(), " on the GPU engine: an attention kind ",
                                          static_cast<int>(cfg_.attention), " unknown to draft verification"));
}

absl::Status CudaModel::Forward(const StepBatch& batch, float* logits) {
  return RunStep(batch, StepOutput{logits, {}, {}});
}

absl::Status CudaModel::ForwardSampled(const StepBatch& batch, std::span<const RowSampling> rows,
                                       std::span<SampledToken> tokens, const std::function<void()>& masks_ready) {
  const size_t R = static_cast<size_t>(batch.NumLogitRows());
  if (rows.size() != R || tokens.size() != R)
    return absl::InvalidArgumentError(absl::StrCat("ForwardSampled: ", rows.size(), " sampling rows and ", tokens.size(),
                                                   " tokens for a step of ", R, " logit rows"));
  if (sampler_ == nullptr) return absl::FailedPreconditionError("ForwardSampled: device sampling is off");
  return RunStep(batch, StepOutput{nullptr, rows, tokens, &masks_ready});
}

absl::Status CudaModel::MaskedRowLogits(int row, std::span<float> logits) {
  if (sampler_ == nullptr) return absl::FailedPreconditionError("MaskedRowLogits: device sampling is off");
  return sampler_->MaskedRow(row, logits, device_->stream());
}

absl::Status CudaModel::RunStep(const StepBatch& batch, const StepOutput& out) {
  if (!cache_shape_.has_value()) return absl::FailedPreconditionError("KV cache not allocated");
  mtp_->BeginStep();
  if (batch.keep_hidden_states && !mtp_->enabled())
    return absl::FailedPreconditionError("keep_hidden_states without MTP drafting enabled");
  StepTokens tokens;
  EXL3_RETURN_IF_ERROR(FlattenStep(batch, cfg_.vocab_size, *cache_shape_, cfg_.max_position_embeddings, &tokens));
  if (tokens.num_tokens == 0) return absl::OkStatus();
  // A recurrent kind's step reads each chunk's state as the last successful step left it and
  // writes other copies (a verify chunk: one per kept position); only EndStep, after the step's
  // synchronisation, makes those current, so a step that fails leaves every state as it was
  // (engine/core/model_runner.h).
  for (const auto& kind : mixers_.kinds) EXL3_RETURN_IF_ERROR(kind->BeginStep(batch, device_->stream()));
  // A step that keeps its states runs eagerly (a graph gathers only its logit rows).
  const int tokens_per_chunk = UniformTokensPerChunk(batch);
  const bool graph = graphs_->enabled() && (moe_ == nullptr || !moe_->remote()) && !batch.keep_hidden_states &&
                     graphs_->GraphRows(static_cast<int>(batch.chunks.size()), tokens_per_chunk) > 0;
  EXL3_RETURN_IF_ERROR(graph ? RunStepGraph(tokens, tokens_per_chunk, out) : RunEagerStep(batch, tokens, out));
  for (const auto& kind : mixers_.kinds) EXL3_RETURN_IF_ERROR(kind->EndStep(batch, device_->stream()));
  residual_->EndStep();
  if (batch.keep_hidden_states) mtp_->RecordKept(batch);
  return absl::OkStatus();
}

absl::Status CudaModel::RunEagerStep(const StepBatch& batch, const StepTokens& tokens, const StepOutput& out) {
  const int T = tokens.num_tokens, R = static_cast<int>(tokens.logit_tokens.size());
  EXL3_RETURN_IF_ERROR(timer_->Begin());
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, PrepareStep(tokens, StepLayout{T, 0, 0}, facts_->eager_device()));
  EXL3_RETURN_IF_ERROR(Reserve(T, R, step->splits));
  const bool remote = moe_ != nullptr && moe_->remote();
  const std::vector<MicroBatchRange> micro_batches =
      SplitIntoMicroBatches(batch, remote ? moe_->micro_batches() : 1);
  if (remote) EXL3_RETURN_IF_ERROR(moe_->BeginStep(micro_batches));
  if (batch.keep_hidden_states) EXL3_RETURN_IF_ERROR(ReserveKeptStates(T));
  EXL3_RETURN_IF_ERROR(RunLayers(*step, micro_batches, R, tokens.token_ids.data(), batch.keep_hidden_states));
  EXL3_RETURN_IF_ERROR(FinishStep(R, out));
  if (remote) {
    EXL3_ASSIGN_OR_RETURN(last_.exchange, moe_->StepTimes());
    last_.phases.remote_moe_calls = last_.exchange.exchanges;
    last_.phases.remote_moe_wait_s = last_.exchange.wait_s;
    last_.phases.remote_moe_to_host_s = last_.exchange.to_host_s;
    last_.phases.remote_moe_to_device_s = last_.exchange.to_device_s;
  }
  return absl::OkStatus();
}

absl::Status CudaModel::CheckMtpDrafting() const {
  EXL3_RETURN_IF_ERROR(mtp_->Check());  // the design and its tensors, by name
  return CheckDraftVerification();
}

absl::Status CudaModel::EnableMtpDrafting() {
  if (mtp_->enabled()) return absl::OkStatus();
  if (cache_shape_.has_value()) return absl::FailedPreconditionError("EnableMtpDrafting after AllocateKvCache");
  EXL3_RETURN_IF_ERROR(CheckDraftVerification());
  EXL3_RETURN_IF_ERROR(mtp_->Enable());
  if (mtp_->kept() != CudaMtpDrafting::Kept::kTaps &&
      mtp_->state_width() !=
          (mtp_->kept() == CudaMtpDrafting::Kept::kStreams ? residual_->streams() : 1) * cfg_.hidden_size)
    return absl::InternalError(absl::StrCat(cfg_.architecture(), ": the MTP drafter reads ", mtp_->state_width(),
                                            " floats a token, the model keeps ", residual_->streams(), " streams"));
  info_.kv_bytes_per_token += mtp_->KvBytesPerToken();
  return absl::OkStatus();
}

absl::Status CudaModel::ReserveKeptStates(int T) {
  EXL3_RETURN_IF_ERROR(mtp_->ReserveKept(T));
  // The streams as they are, or the taps (written in the layer loop).
  if (mtp_->kept() != CudaMtpDrafting::Kept::kHeadInput) return absl::OkStatus();
  // The head input of every row, not only the logit rows'.
  bool moved = false;
  EXL3_RETURN_IF_ERROR(residual_->Reserve(T, T, &moved));
  if (moved) graphs_->Drop();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<int32_t>>> CudaModel::ProposeMtpDrafts(std::span<const MtpSpan> spans) {
  if (!cache_shape_.has_value()) return absl::FailedPreconditionError("KV cache not allocated");
  return mtp_->ProposeDrafts(spans, *cache_shape_);
}

}  // namespace exl3::engine::cuda

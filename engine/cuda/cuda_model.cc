#include "engine/cuda/cuda_model.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/attention.h"
#include "engine/cuda/deltanet_kernels.h"
#include "engine/cuda/latent_attention_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/dsv4_config.h"
#include "engine/hyper_connections.h"
#include "kernels/cuda/cuda_status.h"
#include "model/exl3_model.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {
namespace {

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }


}  // namespace

CudaModel::CudaModel(ModelConfig cfg)
    : cfg_(std::move(cfg)), rope_(cfg_.rope, cfg_.max_position_embeddings) {}

CudaModel::~CudaModel() {
  if (stream_ != nullptr) cudaStreamSynchronize(Stream(stream_));
  DropGraphs();
  for (void* e : event_pool_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (cublas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(Stream(stream_));
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Open(const std::string& dir,
                                                           const CudaModelOptions& options,
                                                           std::unique_ptr<MoeExecutor> remote_moe) {
  if (exl3::cuda::DeviceCount() == 0)
    return absl::FailedPreconditionError("the CUDA engine needs a GPU and none is visible");
  EXL3_ASSIGN_OR_RETURN(ModelConfig cfg, LoadModelConfig(dir));
  if (cfg.attention == AttentionKind::kPooledDsa)
    return absl::UnimplementedError(absl::StrCat(
        cfg.architecture(), " (GLM-5.3-Flash: KDA, k-pooled DSA, hyper-connections) runs on the CPU "
        "engine only (--engine-device cpu); the GPU engine does not run it"));
  // Qwen4-Exp (gated hyper-connections, QSA attention, PLE n-gram layers) runs on the CPU engine.
  if (cfg.moe.family == MoeFamily::kQwen4Exp)
    return absl::UnimplementedError(absl::StrCat(
        cfg.architecture(), " (Qwen4-Exp: gated hyper-connections, QSA attention, PLE) runs on the "
                            "CPU engine only (--engine-device cpu); the GPU engine does not run it"));
  const bool v4 = cfg.attention == AttentionKind::kDsv4;
  // DeepSeek-V4's hyper-connected layers run in RunHyperConnectedLayers, which has no exchange with
  // expert workers (RunRemoteLayers is the single-residual layer loop) yet.
  if (v4 && remote_moe != nullptr)
    return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": with expert workers its hyper-connected "
                                                 "layers run on the CPU engine only so far (--engine-device cpu); "
                                                 "the GPU engine runs it with its experts in process"));
  // Qwen3-Next (gated DeltaNet layers, gated attention, zero-centred norms) runs here; recurrent
  // layers are only known beside GQA attention layers.
  if (cfg.HasRecurrentLayers() && cfg.attention != AttentionKind::kGqa)
    return absl::UnimplementedError(absl::StrCat(cfg.architecture(), ": recurrent layers beside ",
                                                 "non-GQA attention are not on the GPU engine"));
  // Hash-routed MoE layers (DeepSeek-V4's hash_moe) are gated on the device from the step's token
  // ids (HashRouteOnDevice), experts in process only (refused above otherwise).
  if (options.max_moe_tokens < 1) return absl::InvalidArgumentError("max_moe_tokens must be positive");
  if (options.micro_batches < 1 || options.micro_batches > 2)
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be 1 or 2, not ", options.micro_batches));
  if (options.micro_batches > 1 && remote_moe != nullptr && cfg.IsLatentAttention())
    return absl::UnimplementedError(
        "two micro-batches need GQA attention layers: latent attention runs a whole step at once");
  std::unique_ptr<CudaModel> m(new CudaModel(std::move(cfg)));
  m->remote_moe_ = std::move(remote_moe);
  if (m->remote_moe_ != nullptr) {
    m->micro_batches_ = options.micro_batches;
    EXL3_ASSIGN_OR_RETURN(m->exchange_,
                          RemoteMoeExchange::Create(m->remote_moe_.get(), m->micro_batches_, m->cfg_.hidden_size,
                                                    m->cfg_.moe.top_k));
  }
  m->max_moe_tokens_ = options.max_moe_tokens;
  // DeepSeek-V4 decode runs eagerly: its layers read per-step facts of their own (Dsv4StepFacts:
  // chunk starts, four rope tables, the indexer's entry counts) outside the decode graph's fixed
  // meta buffer, and its fold reports errors through a word read after the step; capturing it
  // would need those in the graph's buffer first.
  m->graphs_enabled_ = options.cuda_graphs && !v4;
  m->tensor_core_prefill_ = options.tensor_core_prefill;
  m->device_sampling_ = options.device_sampling;
  EXL3_RETURN_IF_ERROR(m->Load(dir));

  m->info_ = ModelInfoFor(m->cfg_, dir, options.served_name);
  m->sampler_ = std::make_unique<DeviceSampler>(m->cfg_.vocab_size);
  // fp16 cache; DeepSeek-V4's fp32 (its compressor state as the CPU engine keeps it).
  m->info_.kv_bytes_per_token =
      m->cfg_.KvFloatsPerToken() * static_cast<int64_t>(v4 ? sizeof(float) : sizeof(KvHalf));
  return m;
}

absl::Status CudaModel::Load(const std::string& dir) {
  cudaStream_t stream;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return absl::InternalError("cublasCreate failed");
  cublas_ = handle;
  cublasSetStream(handle, stream);
  constexpr size_t kCublasWorkspace = 32 << 20;
  EXL3_RETURN_IF_ERROR(cublas_workspace_.Reserve(kCublasWorkspace));
  if (cublasSetWorkspace(handle, cublas_workspace_.get(), kCublasWorkspace) != CUBLAS_STATUS_SUCCESS)
    return absl::InternalError("cublasSetWorkspace failed");
  workspace_ = std::make_unique<exl3::cuda::Workspace>();
  ctx_ = CudaLinearContext{cublas_, workspace_.get(), stream_};
  int dev = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, dev));

  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TensorSource> src, TensorSource::Open(dir));
  const int H = cfg_.hidden_size;
  EXL3_ASSIGN_OR_RETURN(TensorView emb, src->Get("model.embed_tokens.weight"));
  if (emb.info->shape != std::vector<int64_t>{cfg_.vocab_size, H})
    return absl::InvalidArgumentError(absl::StrCat(emb.info->name, ": expected shape [", cfg_.vocab_size, ", ", H, "]"));
  switch (emb.info->dtype) {
    case DType::kF32: embedding_dtype_ = EmbeddingDType::kF32; break;
    case DType::kF16: embedding_dtype_ = EmbeddingDType::kF16; break;
    case DType::kBF16: embedding_dtype_ = EmbeddingDType::kBF16; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(emb.info->name, ": embeddings of dtype ",
                                                     std::string(DTypeName(emb.info->dtype)), " are not supported"));
  }
  EXL3_RETURN_IF_ERROR(embedding_.Upload(emb.data, emb.size_bytes()));
  weight_bytes_.embedding_row = static_cast<int64_t>(emb.size_bytes() / cfg_.vocab_size);

  // The routers (the gate runs on this GPU either way) and, in process, every routed and shared
  // expert. Remote experts get each micro-batch's top-k with its hidden states.
  std::unique_ptr<Exl3Model> experts;
  if (cfg_.moe.num_experts > 0) {
    Exl3ModelOptions opt;
    opt.require_exl3 = false;
    EXL3_ASSIGN_OR_RETURN(experts, Exl3Model::Open(dir, opt));
  }
  const MoeConfig& mc = cfg_.moe;
  gate_ = GateConfigFor(mc);
  const int q_out = cfg_.num_heads * cfg_.head_dim, kv_out = cfg_.num_kv_heads * cfg_.head_dim;
  const NormWeightConvention norms = cfg_.norm_weights;
  // DeepSeek-V4's checkpoints keep the original names (attn_norm / ffn_norm, head) and its
  // hyper-connections' weights (as engine/cpu_model.cc loads them).
  const bool v4 = cfg_.attention == AttentionKind::kDsv4;
  if (v4) {
    const Dsv4Config& d = *cfg_.dsv4;
    const HyperConnectionShape hc{H, d.hc_mult, d.hc_sinkhorn_iters, d.hc_eps, cfg_.rms_norm_eps};
    streams_ = d.hc_mult;
    EXL3_ASSIGN_OR_RETURN(HyperHead head, HyperHead::Load(*src, "model.hc_head.", hc));
    EXL3_RETURN_IF_ERROR(hc_head_fn_.Upload(head.fn()));
    EXL3_RETURN_IF_ERROR(hc_head_base_.Upload(head.base()));
    hc_head_scale_ = head.scale();
    dsv4_facts_ = std::make_unique<Dsv4StepFacts>(cfg_);
    EXL3_RETURN_IF_ERROR(dsv4_facts_->Init());
  }
  layers_.resize(cfg_.num_layers);
  int64_t state_offset = 0;  // layer l's state within a state row (DeviceSequenceStates)
  for (int l = 0; l < cfg_.num_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    EXL3_ASSIGN_OR_RETURN(L.input_norm, UploadNorm(*src, p + (v4 ? "attn_norm.weight" : "input_layernorm.weight"), H,
                                                   norms));
    EXL3_ASSIGN_OR_RETURN(L.post_attention_norm,
                          UploadNorm(*src, p + (v4 ? "ffn_norm.weight" : "post_attention_layernorm.weight"), H,
                                     norms));
    const std::string a = p + "self_attn.";
    if (cfg_.IsLinearAttentionLayer(l)) {
      EXL3_ASSIGN_OR_RETURN(L.deltanet, CudaGatedDeltaNet::Load(cfg_, *src, l, state_offset));
      weight_bytes_.attention += L.deltanet->weight_bytes();
      for (const CudaLinear* lin : L.deltanet->linears())
        if (const Exl3LinearView* v = lin->exl3_view()) weight_bytes_.attention_decoded.Add(*v);
    } else if (v4) {
      EXL3_ASSIGN_OR_RETURN(L.attn_hc, LoadHyperConnection(*src, p + "hc_attn_"));
      EXL3_ASSIGN_OR_RETURN(L.ffn_hc, LoadHyperConnection(*src, p + "hc_ffn_"));
      EXL3_ASSIGN_OR_RETURN(L.dsv4, CudaDsv4Attention::Load(cfg_, *src, l));
      weight_bytes_.attention += L.dsv4->weight_bytes();
      for (const CudaLinear* lin : L.dsv4->linears())
        if (const Exl3LinearView* v = lin->exl3_view()) weight_bytes_.attention_decoded.Add(*v);
    } else if (cfg_.IsLatentAttention()) {
      EXL3_ASSIGN_OR_RETURN(L.latent, CudaLatentAttention::Load(cfg_, *src, l));
      weight_bytes_.attention += L.latent->weight_bytes();
      for (const CudaLinear* lin : L.latent->linears())
        if (const Exl3LinearView* v = lin->exl3_view()) weight_bytes_.attention_decoded.Add(*v);
    } else {
      // Gated attention: q_proj gives per head the query, then its output gate.
      EXL3_ASSIGN_OR_RETURN(L.q, CudaLinear::Load(*src, a + "q_proj", H, cfg_.attention_output_gate ? 2 * q_out : q_out));
      EXL3_ASSIGN_OR_RETURN(L.k, CudaLinear::Load(*src, a + "k_proj", H, kv_out));
      EXL3_ASSIGN_OR_RETURN(L.v, CudaLinear::Load(*src, a + "v_proj", H, kv_out));
      EXL3_ASSIGN_OR_RETURN(L.o, CudaLinear::Load(*src, a + "o_proj", q_out, H));
      weight_bytes_.attention += L.q.weight_bytes() + L.k.weight_bytes() + L.v.weight_bytes() + L.o.weight_bytes();
      for (const CudaLinear* lin : {&L.q, &L.k, &L.v, &L.o})
        if (const Exl3LinearView* v = lin->exl3_view()) weight_bytes_.attention_decoded.Add(*v);
    }
    state_offset += cfg_.StateFloats(l);
    if (cfg_.qk_norm && L.deltanet == nullptr && !v4) {
      EXL3_ASSIGN_OR_RETURN(L.q_norm, UploadNorm(*src, a + "q_norm.weight", cfg_.head_dim, norms));
      EXL3_ASSIGN_OR_RETURN(L.k_norm, UploadNorm(*src, a + "k_norm.weight", cfg_.head_dim, norms));
    }
    if (!cfg_.IsMoeLayer(l)) {
      const int I = cfg_.intermediate_size;
      DenseMlp mlp;
      EXL3_ASSIGN_OR_RETURN(mlp.gate, CudaLinear::Load(*src, p + "mlp.gate_proj", H, I));
      EXL3_ASSIGN_OR_RETURN(mlp.up, CudaLinear::Load(*src, p + "mlp.up_proj", H, I));
      EXL3_ASSIGN_OR_RETURN(mlp.down, CudaLinear::Load(*src, p + "mlp.down_proj", I, H));
      weight_bytes_.dense_mlp += mlp.gate.weight_bytes() + mlp.up.weight_bytes() + mlp.down.weight_bytes();
      for (const CudaLinear* lin : {&mlp.gate, &mlp.up, &mlp.down})
        if (const Exl3LinearView* v = lin->exl3_view()) weight_bytes_.dense_mlp_decoded.Add(*v);
      L.dense_mlp = std::move(mlp);
      continue;
    }
    MoeBlock moe;
    EXL3_ASSIGN_OR_RETURN(moe.router, CudaLinear::UploadDense(experts->RouterWeight(l), H, mc.num_experts));
    weight_bytes_.router += moe.router.weight_bytes();
    if (const float* bias = experts->CorrectionBias(l)) EXL3_RETURN_IF_ERROR(moe.bias.Upload(bias, mc.num_experts));
    if (mc.IsHashRoutedLayer(l)) {
      // Checked once here: the device gate reads tid2eid[token id] unchecked.
      int64_t vocab = 0;
      const int32_t* table = experts->HashTable(l, &vocab);
      if (table == nullptr)
        return absl::NotFoundError(absl::StrCat("layer ", l, " is hash-routed but the model has no ",
                                                HashTableKey(mc, l)));
      if (vocab < cfg_.vocab_size)
        return absl::InvalidArgumentError(absl::StrCat(HashTableKey(mc, l), ": ", vocab, " rows for a vocabulary of ",
                                                       cfg_.vocab_size));
      const size_t n = static_cast<size_t>(cfg_.vocab_size) * mc.top_k;
      for (size_t i = 0; i < n; ++i)
        if (table[i] < 0 || table[i] >= mc.num_experts)
          return absl::DataLossError(absl::StrCat(HashTableKey(mc, l), "[", i / mc.top_k, "] names expert ", table[i],
                                                  ", outside [0, ", mc.num_experts, ")"));
      EXL3_RETURN_IF_ERROR(moe.hash_table.Upload(table, n));
    }
    if (remote_moe_ == nullptr) {
      EXL3_ASSIGN_OR_RETURN(MoeLayerView view, experts->LayerView(l));
      EXL3_ASSIGN_OR_RETURN(moe.experts, exl3::cuda::DeviceMoeLayer::Upload(view));
      weight_bytes_.experts_resident += static_cast<int64_t>(moe.experts->device_bytes());
      for (const ExpertMlp* e : view.experts)
        if (e != nullptr) for (const Exl3LinearView* v : {&e->gate, &e->up, &e->down}) weight_bytes_.experts_decoded.Add(*v);
      if (view.shared != nullptr)
        for (const Exl3LinearView* v : {&view.shared->gate, &view.shared->up, &view.shared->down})
          weight_bytes_.experts_decoded.Add(*v);
      if (moe_runner_ == nullptr) {
        EXL3_ASSIGN_OR_RETURN(moe_runner_, exl3::cuda::MoeRunner::Create(*moe.experts, max_moe_tokens_, mc.top_k));
      }
    }
    L.moe = std::move(moe);
  }
  EXL3_ASSIGN_OR_RETURN(final_norm_, UploadNorm(*src, "model.norm.weight", H, norms));
  const std::string head = v4 ? "head" : "lm_head";
  if (src->Has(head + ".weight") || src->Has(head + ".trellis")) {
    EXL3_ASSIGN_OR_RETURN(head_, CudaLinear::Load(*src, head, H, cfg_.vocab_size));
  } else if (cfg_.tie_word_embeddings) {
    EXL3_ASSIGN_OR_RETURN(std::vector<float> w, ToFloat32(emb));
    EXL3_ASSIGN_OR_RETURN(head_, CudaLinear::UploadDense(w.data(), H, cfg_.vocab_size));
  } else {
    return absl::NotFoundError("lm_head: no lm_head.weight or lm_head.trellis, and the "
                               "embeddings are not tied (tie_word_embeddings false)");
  }
  weight_bytes_.head = head_.weight_bytes();
  if (const Exl3LinearView* v = head_.exl3_view()) weight_bytes_.head_decoded.Add(*v);
  // The uploads ran on the legacy stream, which the engine's non-blocking stream does not wait for.
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::StatusOr<CudaModel::HyperConnectionWeights> CudaModel::LoadHyperConnection(const TensorSource& src,
                                                                                  const std::string& prefix) const {
  const Dsv4Config& d = *cfg_.dsv4;
  const HyperConnectionShape shape{cfg_.hidden_size, d.hc_mult, d.hc_sinkhorn_iters, d.hc_eps, cfg_.rms_norm_eps};
  EXL3_ASSIGN_OR_RETURN(HyperConnection hc, HyperConnection::Load(src, prefix, shape));
  HyperConnectionWeights w;
  EXL3_RETURN_IF_ERROR(w.fn.Upload(hc.fn()));
  EXL3_RETURN_IF_ERROR(w.base.Upload(hc.base()));
  w.args.fn = w.fn.get();  // the arrays' storage moves with them
  w.args.base = w.base.get();
  for (int i = 0; i < 3; ++i) w.args.scale[i] = hc.scale()[i];
  w.args.streams = d.hc_mult;
  w.args.hidden = cfg_.hidden_size;
  w.args.sinkhorn_iters = d.hc_sinkhorn_iters;
  w.args.eps = d.hc_eps;
  w.args.norm_eps = cfg_.rms_norm_eps;
  return w;
}

absl::Status CudaModel::AllocateKvCache(const KvCacheShape& shape) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", shape.num_blocks, " blocks of ",
                                                   shape.block_size, " tokens"));
  if (cfg_.attention == AttentionKind::kDsv4) {
    // fp32, the CPU engine's layout (engine/paged_kv_cache.h): per layer, num_blocks + 1 blocks of
    // block_size slots and the block area; zeroed as the CPU's is.
    const int L = cfg_.num_layers, B = shape.block_size;
    dsv4_layer_offset_.assign(L + 1, 0);
    dsv4_block_stride_.assign(L, 0);
    for (int l = 0; l < L; ++l) {
      dsv4_block_stride_[l] = B * cfg_.KvWidth(l) + cfg_.KvBlockFloats(l, B);
      dsv4_layer_offset_[l + 1] =
          dsv4_layer_offset_[l] + static_cast<size_t>(shape.num_blocks + 1) * dsv4_block_stride_[l];
    }
    dsv4_cache_ = DeviceArray<float>();
    EXL3_RETURN_IF_ERROR(dsv4_cache_.Reserve(dsv4_layer_offset_[L]));
    // On the engine's stream (non-blocking: the legacy stream's work would not order before its steps).
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dsv4_cache_.get(), 0, dsv4_layer_offset_[L] * sizeof(float),
                                              Stream(stream_)));
    cache_shape_ = shape;
    padding_block_ = shape.num_blocks;
    return absl::OkStatus();
  }
  // One block more than asked: the padding rows of decode graphs write their keys there. Each
  // layer's slots as wide as the CPU engine's (KvWidth: DSA layers without their own indexer hold
  // no indexer keys).
  const size_t slots = static_cast<size_t>(shape.num_blocks + 1) * shape.block_size;
  layer_cache_offset_.assign(cfg_.num_layers + 1, 0);
  for (int l = 0; l < cfg_.num_layers; ++l) layer_cache_offset_[l + 1] = layer_cache_offset_[l] + slots * cfg_.KvWidth(l);
  DropGraphs();
  cache_ = DeviceArray<KvHalf>();
  EXL3_RETURN_IF_ERROR(cache_.Reserve(layer_cache_offset_[cfg_.num_layers]));
  cache_shape_ = shape;
  padding_block_ = shape.num_blocks;
  states_.reset();
  if (cfg_.HasRecurrentLayers()) {
    EXL3_ASSIGN_OR_RETURN(std::vector<int64_t> floats, StateFloatsPerLayer(cfg_, shape.num_sequence_slots));
    EXL3_ASSIGN_OR_RETURN(states_, DeviceSequenceStates::Create(std::move(floats), shape.num_sequence_slots));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Reserve(int T, int R, int splits) {
  const size_t t = static_cast<size_t>(T), H = cfg_.hidden_size;
  const size_t q = t * cfg_.num_heads * cfg_.head_dim, kv = t * cfg_.num_kv_heads * cfg_.head_dim;
  const size_t k = std::max(cfg_.moe.top_k, 1), r = std::max(R, 1);
  struct Need {
    DeviceArray<float>* a;
    size_t n;
  };
  const size_t N = static_cast<size_t>(streams_);
  const Need needs[] = {{&act_.h, t * H * N}, {&act_.x, t * H}, {&act_.hc_post, t * N}, {&act_.hc_comb, t * N * N},
                        {&act_.head_pre, r * H}, {&act_.d, t * H}, {&act_.q, q}, {&act_.k, kv},
                        {&act_.v, kv}, {&act_.attn, q}, {&act_.gate, t * cfg_.intermediate_size},
                        {&act_.up, t * cfg_.intermediate_size},
                        {&act_.router_logits, t * std::max(cfg_.moe.num_experts, 1)}, {&act_.topk_weights, t * k},
                        {&act_.head_in, r * H}, {&act_.logits, r * cfg_.vocab_size},
                        {&act_.scratch, static_cast<size_t>(AttentionScratchFloats(T, cfg_.num_heads, cfg_.head_dim, splits))},
                        {&act_.qg, cfg_.attention_output_gate ? 2 * q : 0},
                        {&act_.qgate, cfg_.attention_output_gate ? q : 0}};
  bool moved = act_.topk_ids.size() < t * k;
  if (cfg_.IsLatentAttention()) {
    const int64_t context = std::min<int64_t>(cfg_.max_position_embeddings,
                                              static_cast<int64_t>(cache_shape_.num_blocks) * cache_shape_.block_size);
    bool latent_moved = false;
    EXL3_RETURN_IF_ERROR(latent_ws_.Reserve(cfg_, T, splits, static_cast<int>(context), &latent_moved));
    if (latent_moved) DropGraphs();
  }
  if (cfg_.HasRecurrentLayers()) {
    bool deltanet_moved = false;
    EXL3_RETURN_IF_ERROR(deltanet_ws_.Reserve(cfg_.linear_attention, T, &deltanet_moved));
    if (deltanet_moved) DropGraphs();
  }
  if (cfg_.attention == AttentionKind::kDsv4) {  // no decode graphs: nothing to drop
    const int64_t context = std::min<int64_t>(cfg_.max_position_embeddings,
                                              static_cast<int64_t>(cache_shape_.num_blocks) * cache_shape_.block_size);
    EXL3_RETURN_IF_ERROR(dsv4_ws_.Reserve(cfg_, T, static_cast<int>(context)));
  }
  for (const Need& n : needs) moved |= n.a->size() < n.n;
  if (!moved) return absl::OkStatus();
  DropGraphs();  // they hold the old addresses
  for (const Need& n : needs) EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  return act_.topk_ids.Reserve(t * k);
}

int CudaModel::AttentionBlocksPerToken() const {
  // GQA: a block per KV head; latent attention: a block per tile of query heads.
  return cfg_.IsLatentAttention() ? LatentAttentionHeadTiles(cfg_.num_heads) : cfg_.num_kv_heads;
}

int CudaModel::SplitsFor(int T, int span) const {
  // Split-K: enough blocks to fill the GPU twice, each split at least 64 positions long.
  const int blocks = T * AttentionBlocksPerToken();
  const int splits = std::max(1, std::min((2 * sm_count_ + blocks - 1) / blocks, (span + 63) / 64));
  const int per = (span + splits - 1) / splits;
  return (span + per - 1) / per;
}

absl::Status CudaModel::PrepareStep(const StepTokens& tokens, const StepLayout& layout, DeviceArray<int32_t>* device) {
  const int T = tokens.num_tokens, Tp = layout.tokens;
  const bool padded = layout.table_stride > 0;
  const int R = padded ? Tp : static_cast<int>(tokens.logit_tokens.size());
  const int half = rope_.rotary_dim() / 2, bs = cache_shape_.block_size;
  const StepBatch& batch = *tokens.batch;
  int table_ints = 0;
  if (padded) {
    table_ints = Tp * layout.table_stride;
  } else {
    for (const SequenceChunk& c : batch.chunks) table_ints += static_cast<int>(c.block_table.size());
  }
  // Recurrent layers' chunks (DeltaNetChunks): one per chunk of the step's tokens, in order, and
  // one per padding row of a decode graph (reading the store's zero row, writing its spare row).
  std::vector<int32_t> chunk_of, chunk_table;
  state_chunk_first_.clear();
  if (states_ != nullptr) {
    chunk_of.resize(Tp);
    for (int t = 0; t < Tp; ++t) {
      const bool real = t < T;
      if (!real || t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) {
        int32_t read = states_->padding_read_row(), write = states_->padding_write_row();
        if (real) {
          const int slot = batch.chunks[tokens.chunk_of[t]].state_slot;
          read = states_->ReadRow(slot);
          write = states_->WriteRow(slot);
        }
        state_chunk_first_.push_back(t);
        chunk_table.insert(chunk_table.end(), {t, 0, read, write});
      }
      chunk_table[chunk_table.size() - kDeltaNetChunkInts + 1] += 1;
      chunk_of[t] = static_cast<int32_t>(state_chunk_first_.size()) - 1;
    }
  }
  // Layout: ids, position, first_visible, slot, table_offset [Tp] | logit_rows [R] |
  // split_positions [1] | tables | cos, sin [Tp, half] (float bits) | state chunk_of [Tp] and
  // chunks [chunks, 4] (recurrent layers).
  std::vector<int32_t>& h = meta_.host;
  const size_t angles_end = 5 * static_cast<size_t>(Tp) + R + 1 + table_ints + 2 * static_cast<size_t>(Tp) * half;
  h.assign(angles_end + chunk_of.size() + chunk_table.size(), 0);
  std::copy(chunk_of.begin(), chunk_of.end(), h.begin() + angles_end);
  std::copy(chunk_table.begin(), chunk_table.end(), h.begin() + angles_end + chunk_of.size());
  int32_t* ids = h.data();
  int32_t* position = ids + Tp;
  int32_t* first = position + Tp;
  int32_t* slot = first + Tp;
  int32_t* table_offset = slot + Tp;
  int32_t* logit_rows = table_offset + Tp;
  int32_t* split_positions = logit_rows + R;
  int32_t* tables = split_positions + 1;
  float* cos = reinterpret_cast<float*>(tables + table_ints);
  float* sin = cos + static_cast<size_t>(Tp) * half;
  std::vector<int32_t> chunk_offset(batch.chunks.size());
  int off = 0;
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    chunk_offset[c] = padded ? static_cast<int>(c) * layout.table_stride : off;
    std::copy(batch.chunks[c].block_table.begin(), batch.chunks[c].block_table.end(), tables + chunk_offset[c]);
    off += static_cast<int>(batch.chunks[c].block_table.size());
  }
  int span = 1;
  RopeAngles angles;
  for (int t = 0; t < Tp; ++t) {
    const bool real = t < T;
    const int pos = real ? tokens.positions[t] : 0;
    ids[t] = real ? tokens.token_ids[t] : 0;
    position[t] = pos;
    first[t] = FirstVisiblePosition(pos, cfg_.sliding_window);
    if (real) {
      const std::vector<int32_t>& table = tokens.block_table(t);
      slot[t] = table[pos / bs] * bs + pos % bs;
      table_offset[t] = chunk_offset[tokens.chunk_of[t]];
      span = std::max(span, pos - first[t] + 1);
    } else {  // a padding row of a decode graph: position 0 of the spare block
      slot[t] = padding_block_ * bs;
      table_offset[t] = t * layout.table_stride;
      tables[table_offset[t]] = padding_block_;
    }
    rope_.Angles(pos, real ? tokens.seq_len_after[t] : 1, &angles);
    std::copy(angles.cos.begin(), angles.cos.end(), cos + static_cast<size_t>(t) * half);
    std::copy(angles.sin.begin(), angles.sin.end(), sin + static_cast<size_t>(t) * half);
  }
  if (padded) {
    for (int r = 0; r < R; ++r) logit_rows[r] = r;  // one token per chunk: row r is token r
  } else {
    std::copy(tokens.logit_tokens.begin(), tokens.logit_tokens.end(), logit_rows);
  }
  // GLM-MoE-DSA attends to at most index_topk chosen positions: splits of the whole span would
  // leave all but the first few idle (their split count or length is from the positions taken).
  if (cfg_.attention == AttentionKind::kDsa) span = std::min(span, cfg_.indexer.topk);
  step_splits_ = layout.splits > 0 ? layout.splits : SplitsFor(Tp, span);
  *split_positions = (span + step_splits_ - 1) / step_splits_;
  PlanAttention(tokens, Tp);

  EXL3_RETURN_IF_ERROR(device->Reserve(h.size()));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device->get(), h.data(), h.size() * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, Stream(stream_)));
  int32_t* d = device->get();
  meta_.ids = d;
  meta_.position = d + Tp;
  meta_.first_visible = d + 2 * Tp;
  meta_.slot = d + 3 * Tp;
  meta_.table_offset = d + 4 * Tp;
  meta_.logit_rows = d + 5 * Tp;
  meta_.split_positions = meta_.logit_rows + R;
  meta_.tables = meta_.split_positions + 1;
  meta_.cos = reinterpret_cast<const float*>(meta_.tables + table_ints);
  meta_.sin = meta_.cos + static_cast<size_t>(Tp) * half;
  meta_.state_chunk_of = d + angles_end;
  meta_.state_chunks = meta_.state_chunk_of + chunk_of.size();
  return absl::OkStatus();
}

void CudaModel::PlanAttention(const StepTokens& tokens, int num_rows) {
  attention_runs_.clear();
  const bool prefill_kernel = tensor_core_prefill_ && PrefillAttentionSupports(cfg_.head_dim);
  int t = 0;
  for (const SequenceChunk& c : tokens.batch->chunks) {  // tokens are flattened chunk by chunk
    const int n = static_cast<int>(c.tokens.size());
    if (n == 0) continue;
    const bool prefill = prefill_kernel && n >= kPrefillMinTokens;
    if (!prefill && !attention_runs_.empty() && !attention_runs_.back().prefill) {
      attention_runs_.back().num_tokens += n;  // decode-like tokens of consecutive chunks: one launch
    } else {
      attention_runs_.push_back({t, n, prefill});
    }
    t += n;
  }
  // A decode graph's padding rows (each its own one-position sequence) join the last decode run.
  if (num_rows > t) {
    if (!attention_runs_.empty() && !attention_runs_.back().prefill) {
      attention_runs_.back().num_tokens += num_rows - t;
    } else {
      attention_runs_.push_back({t, num_rows - t, false});
    }
  }
}

DeltaNetStep CudaModel::DeltaNetStepFor(int first, int n) const {
  DeltaNetStep step;
  step.chunks.chunk_of = meta_.state_chunk_of;
  step.chunks.table = meta_.state_chunks;
  step.chunks.row_floats = states_->row_floats();
  step.store = states_->layer(0);
  const auto begin = std::lower_bound(state_chunk_first_.begin(), state_chunk_first_.end(), first);
  const auto end = std::lower_bound(state_chunk_first_.begin(), state_chunk_first_.end(), first + n);
  step.first_chunk = static_cast<int>(begin - state_chunk_first_.begin());
  step.num_chunks = static_cast<int>(end - begin);
  return step;
}

absl::Status CudaModel::RunAttention(int l, int first, int T) {
  Layer& L = layers_[l];
  if (L.deltanet != nullptr)
    return L.deltanet->Forward(act_.x.get(), first, T, DeltaNetStepFor(first, T), deltanet_ws_, ctx_,
                               act_.d.get());
  KvHalf* cache_layer = cache_.get() + layer_cache_offset_[l];
  if (L.latent != nullptr) {
    LatentStep step;
    step.tokens = AttentionTokens{meta_.position, meta_.first_visible, meta_.table_offset, meta_.tables,
                                  cache_shape_.block_size};
    step.slot = meta_.slot;
    step.cos = meta_.cos;
    step.sin = meta_.sin;
    step.splits = step_splits_;
    step.split_positions = meta_.split_positions;
    step.sm_count = sm_count_;
    step.kernel = tensor_core_prefill_ ? LatentKernel::kTensorCores : LatentKernel::kCudaCores;
    return L.latent->Forward(act_.x.get(), T, step, cache_layer, latent_ws_, ctx_, act_.d.get());
  }
  const int D = cfg_.head_dim, NH = cfg_.num_heads, KV = cfg_.num_kv_heads;
  // Rows [first, first + T) of the step's activations and per-token facts.
  const size_t r = static_cast<size_t>(first), half = static_cast<size_t>(rope_.rotary_dim() / 2);
  const float* x = act_.x.get() + r * cfg_.hidden_size;
  float* q = act_.q.get() + r * NH * D;
  float* k = act_.k.get() + r * KV * D;
  float* v = act_.v.get() + r * KV * D;
  const CudaLinear* qkv[3] = {&L.q, &L.k, &L.v};
  const bool gated = cfg_.attention_output_gate;
  float* gate = gated ? act_.qgate.get() + r * NH * D : nullptr;
  float* const qkv_out[3] = {gated ? act_.qg.get() + r * 2 * NH * D : q, k, v};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(qkv, 3, x, T, qkv_out, ctx_));
  if (gated)
    EXL3_RETURN_IF_ERROR(SplitQueryGate(qkv_out[0], static_cast<int64_t>(T) * NH, D, q, gate, stream_));
  if (!L.q_norm.empty()) {
    EXL3_RETURN_IF_ERROR(RmsNorm(q, L.q_norm.get(), T * NH, D, cfg_.rms_norm_eps, q, stream_));
    EXL3_RETURN_IF_ERROR(RmsNorm(k, L.k_norm.get(), T * KV, D, cfg_.rms_norm_eps, k, stream_));
  }
  const bool interleaved = cfg_.rope.layout == RopeLayout::kInterleaved;
  const float* cos = meta_.cos + r * half;
  const float* sin = meta_.sin + r * half;
  EXL3_RETURN_IF_ERROR(ApplyRope(q, T, NH, NH * D, D, rope_.rotary_dim(), interleaved, cos, sin, stream_));
  EXL3_RETURN_IF_ERROR(ApplyRope(k, T, KV, KV * D, D, rope_.rotary_dim(), interleaved, cos, sin, stream_));
  EXL3_RETURN_IF_ERROR(WriteKv(k, v, meta_.slot + r, T, KV * D, cache_layer, stream_));
  for (const AttentionRun& run : attention_runs_) {
    // The part of the run in these rows (a micro-batch holds whole chunks: a prefill run is in
    // one micro-batch, a run of decode tokens may span both).
    const int begin = std::max(run.first_token, first);
    const int end = std::min(run.first_token + run.num_tokens, first + T);
    if (begin >= end) continue;
    const size_t t0 = static_cast<size_t>(begin);
    AttentionTokens at;
    at.position = meta_.position + t0;
    at.first_visible = meta_.first_visible + t0;
    at.table_offset = meta_.table_offset + t0;
    at.tables = meta_.tables;
    at.block_size = cache_shape_.block_size;
    const float* run_q = act_.q.get() + t0 * NH * D;
    float* out = act_.attn.get() + t0 * NH * D;
    float* scratch = act_.scratch.get() + AttentionScratchFloats(begin, NH, D, step_splits_);
    EXL3_RETURN_IF_ERROR((run.prefill ? PrefillAttention : PagedAttention)(
        run_q, cache_layer, at, end - begin, NH, KV, D, cfg_.attention_scale, step_splits_, meta_.split_positions,
        scratch, out, stream_));
  }
  if (gated)
    EXL3_RETURN_IF_ERROR(SigmoidGate(act_.attn.get() + r * NH * D, gate, static_cast<int64_t>(T) * NH * D, stream_));
  return L.o.Forward(act_.attn.get() + r * NH * D, T, act_.d.get() + r * cfg_.hidden_size, ctx_);
}

MoeRouting CudaModel::DeviceRouting(int first) const {
  const size_t k = static_cast<size_t>(cfg_.moe.top_k), r = static_cast<size_t>(first);
  return MoeRouting{cfg_.moe.top_k, act_.topk_ids.get() + r * k, act_.topk_weights.get() + r * k};
}

absl::Status CudaModel::RouteRows(int l, int first, int n) {
  const MoeBlock& moe = *layers_[l].moe;
  const size_t r = static_cast<size_t>(first);
  float* logits = act_.router_logits.get() + r * cfg_.moe.num_experts;
  const size_t k = static_cast<size_t>(cfg_.moe.top_k);
  EXL3_RETURN_IF_ERROR(moe.router.Forward(act_.x.get() + r * cfg_.hidden_size, n, logits, ctx_));
  if (!moe.hash_table.empty())  // experts from the token ids (this step's, on the device)
    return HashRouteOnDevice(gate_, logits, moe.hash_table.get(), meta_.ids + r, n, act_.topk_ids.get() + r * k,
                             act_.topk_weights.get() + r * k, stream_);
  return RouteOnDevice(gate_, logits, moe.bias.empty() ? nullptr : moe.bias.get(), n, act_.topk_ids.get() + r * k,
                       act_.topk_weights.get() + r * k, stream_);
}

absl::Status CudaModel::RunMoe(int l, int T) {
  MoeBlock& moe = *layers_[l].moe;
  const int H = cfg_.hidden_size;
  const int k = cfg_.moe.top_k;
  EXL3_RETURN_IF_ERROR(RouteRows(l, 0, T));
  EXL3_RETURN_IF_ERROR(moe_runner_->Rebind(*moe.experts));
  for (int t0 = 0; t0 < T; t0 += max_moe_tokens_) {
    const int n = std::min(max_moe_tokens_, T - t0);
    const size_t row = static_cast<size_t>(t0);
    EXL3_RETURN_IF_ERROR(moe_runner_->Forward(act_.x.get() + row * H, n, act_.topk_ids.get() + row * k,
                                              act_.topk_weights.get() + row * k, act_.d.get() + row * H, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Mark(Phase phase) {
  if (!marking_) return absl::OkStatus();
  if (marks_.size() == event_pool_.size()) {
    cudaEvent_t e;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    event_pool_.push_back(e);
  }
  void* e = event_pool_[marks_.size()];
  marks_.push_back({e, phase});
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(e), Stream(stream_)));
  return absl::OkStatus();
}

absl::Status CudaModel::CollectPhaseTimes() {
  times_ = StepPhaseTimes{};
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(marks_[i - 1].event),
                                                   static_cast<cudaEvent_t>(marks_[i].event)));
    const double s = ms * 1e-3;
    switch (marks_[i].phase) {
      case Phase::kEmbed: times_.embed_s += s; break;
      case Phase::kAttention: times_.attention_s += s; break;
      case Phase::kDenseMlp: times_.dense_mlp_s += s; break;
      case Phase::kMoe: times_.moe_s += s; break;
      case Phase::kHead: times_.head_s += s; break;
      case Phase::kSample: times_.sample_s += s; break;
      case Phase::kStart: break;
    }
  }
  marks_.clear();
  return absl::OkStatus();
}

absl::Status CudaModel::RunAttentionHalf(int l, int first, int n) {
  Layer& L = layers_[l];
  const int H = cfg_.hidden_size;
  const float eps = cfg_.rms_norm_eps;
  const size_t r = static_cast<size_t>(first) * H;
  float* h = act_.h.get() + r;
  float* x = act_.x.get() + r;
  const float* d = act_.d.get() + r;
  if (l == 0) {
    EXL3_RETURN_IF_ERROR(RmsNorm(h, L.input_norm.get(), n, H, eps, x, stream_));
  } else {  // the previous layer's MLP output joins the residual stream here
    EXL3_RETURN_IF_ERROR(AddRmsNorm(h, d, L.input_norm.get(), n, H, eps, x, stream_));
  }
  EXL3_RETURN_IF_ERROR(RunAttention(l, first, n));
  EXL3_RETURN_IF_ERROR(AddRmsNorm(h, d, L.post_attention_norm.get(), n, H, eps, x, stream_));
  return Mark(Phase::kAttention);  // norms with it, as the CPU model counts them
}

absl::Status CudaModel::RunDenseMlp(int l, int first, int n) {
  const DenseMlp& mlp = *layers_[l].dense_mlp;
  const size_t r = static_cast<size_t>(first);
  const size_t I = static_cast<size_t>(cfg_.intermediate_size), H = static_cast<size_t>(cfg_.hidden_size);
  const float* x = act_.x.get() + r * H;
  float* gate = act_.gate.get() + r * I;
  float* up = act_.up.get() + r * I;
  EXL3_RETURN_IF_ERROR(mlp.gate.Forward(x, n, gate, ctx_));
  EXL3_RETURN_IF_ERROR(mlp.up.Forward(x, n, up, ctx_));
  EXL3_RETURN_IF_ERROR(SiluMul(gate, up, static_cast<int64_t>(n) * cfg_.intermediate_size, stream_));
  EXL3_RETURN_IF_ERROR(mlp.down.Forward(gate, n, act_.d.get() + r * H, ctx_));
  return Mark(Phase::kDenseMlp);
}

absl::Status CudaModel::RunRemoteLayers(const int32_t* host_token_ids) {
  const int H = cfg_.hidden_size;
  const int M = static_cast<int>(step_micro_batches_.size());
  std::vector<int> rows(M);
  for (int i = 0; i < M; ++i) rows[i] = step_micro_batches_[i].num_tokens;
  EXL3_RETURN_IF_ERROR(exchange_->BeginStep(rows));
  // Micro-batch i's answer of its previous MoE layer into its rows of d (the compute stream waits
  // for the copy on the device).
  auto finish = [&](int i) -> absl::Status {
    if (!exchange_->in_flight(i)) return absl::OkStatus();
    const size_t first = static_cast<size_t>(step_micro_batches_[i].first_token);
    EXL3_RETURN_IF_ERROR(exchange_->Finish(i, act_.d.get() + first * H, stream_));
    return Mark(Phase::kMoe);  // the compute stream's wait for the experts
  };
  // Ping-pong (as the CPU model runs it): micro-batch i waits for its own previous MoE layer only,
  // queues its attention and sends its hidden states out once that attention is done; the other
  // micro-batch's call is out meanwhile, and its attention runs on the GPU while this one's call
  // is out. Alone, a micro-batch's layers run one after the other.
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int i = 0; i < M; ++i) {
      const MicroBatchRange& mb = step_micro_batches_[i];
      if (mb.num_tokens == 0) continue;
      EXL3_RETURN_IF_ERROR(finish(i));
      EXL3_RETURN_IF_ERROR(RunAttentionHalf(l, mb.first_token, mb.num_tokens));
      if (layers_[l].dense_mlp) {
        EXL3_RETURN_IF_ERROR(RunDenseMlp(l, mb.first_token, mb.num_tokens));
      } else {
        // The gate on this GPU: the workers get the micro-batch's top-k with its hidden states.
        const size_t first = static_cast<size_t>(mb.first_token);
        EXL3_RETURN_IF_ERROR(RouteRows(l, mb.first_token, mb.num_tokens));
        const MoeRouting routing = DeviceRouting(mb.first_token);
        EXL3_RETURN_IF_ERROR(exchange_->Send(i, l, act_.x.get() + first * H, &routing,
                                             host_token_ids != nullptr ? host_token_ids + first : nullptr, stream_));
      }
    }
  }
  for (int i = 0; i < M; ++i) EXL3_RETURN_IF_ERROR(finish(i));
  return absl::OkStatus();
}

absl::Status CudaModel::RunHyperConnectedLayers(int T, int R) {
  const int H = cfg_.hidden_size, N = streams_;
  const float eps = cfg_.rms_norm_eps;
  float* post = act_.hc_post.get();
  float* comb = act_.hc_comb.get();
  // Every stream starts as the token's embedding.
  EXL3_RETURN_IF_ERROR(EmbedRows(embedding_.get(), embedding_dtype_, meta_.ids, T, H, act_.x.get(), stream_));
  EXL3_RETURN_IF_ERROR(BroadcastStreams(act_.x.get(), T, N, H, act_.h.get(), stream_));
  EXL3_RETURN_IF_ERROR(Mark(Phase::kEmbed));
  for (int l = 0; l < cfg_.num_layers; ++l) {
    Layer& L = layers_[l];
    EXL3_RETURN_IF_ERROR(HyperCollapse(L.attn_hc->args, act_.h.get(), T, act_.d.get(), post, comb, stream_));
    EXL3_RETURN_IF_ERROR(RmsNorm(act_.d.get(), L.input_norm.get(), T, H, eps, act_.x.get(), stream_));
    const Dsv4CacheView cache{dsv4_cache_.get() + dsv4_layer_offset_[l], cache_shape_.block_size, cfg_.KvWidth(l),
                              dsv4_block_stride_[l]};
    EXL3_RETURN_IF_ERROR(L.dsv4->Forward(act_.x.get(), T, dsv4_step_, cache, dsv4_ws_, ctx_, act_.d.get()));
    EXL3_RETURN_IF_ERROR(HyperExpand(post, comb, act_.d.get(), T, N, H, act_.h.get(), stream_));
    EXL3_RETURN_IF_ERROR(HyperCollapse(L.ffn_hc->args, act_.h.get(), T, act_.d.get(), post, comb, stream_));
    EXL3_RETURN_IF_ERROR(RmsNorm(act_.d.get(), L.post_attention_norm.get(), T, H, eps, act_.x.get(), stream_));
    EXL3_RETURN_IF_ERROR(Mark(Phase::kAttention));
    if (L.dense_mlp) {
      EXL3_RETURN_IF_ERROR(RunDenseMlp(l, 0, T));
    } else {
      EXL3_RETURN_IF_ERROR(RunMoe(l, T));
      EXL3_RETURN_IF_ERROR(Mark(Phase::kMoe));
    }
    EXL3_RETURN_IF_ERROR(HyperExpand(post, comb, act_.d.get(), T, N, H, act_.h.get(), stream_));
  }
  // The head: each logit row's streams collapsed (model.hc_head), the final norm, the head.
  const Dsv4Config& d = *cfg_.dsv4;
  EXL3_RETURN_IF_ERROR(HyperHeadCollapse(hc_head_fn_.get(), hc_head_base_.get(), hc_head_scale_, N, H, d.hc_eps,
                                         eps, act_.h.get(), meta_.logit_rows, R, act_.head_pre.get(), stream_));
  EXL3_RETURN_IF_ERROR(RmsNorm(act_.head_pre.get(), final_norm_.get(), R, H, eps, act_.head_in.get(), stream_));
  return head_.Forward(act_.head_in.get(), R, act_.logits.get(), ctx_);
}

absl::Status CudaModel::RunLayers(int T, int R, const int32_t* host_token_ids) {
  if (cfg_.attention == AttentionKind::kDsv4) return RunHyperConnectedLayers(T, R);
  const int H = cfg_.hidden_size;
  const float eps = cfg_.rms_norm_eps;
  EXL3_RETURN_IF_ERROR(EmbedRows(embedding_.get(), embedding_dtype_, meta_.ids, T, H, act_.h.get(), stream_));
  EXL3_RETURN_IF_ERROR(Mark(Phase::kEmbed));
  if (exchange_ != nullptr) {
    EXL3_RETURN_IF_ERROR(RunRemoteLayers(host_token_ids));
  } else {
    for (int l = 0; l < cfg_.num_layers; ++l) {
      EXL3_RETURN_IF_ERROR(RunAttentionHalf(l, 0, T));
      if (layers_[l].dense_mlp) {
        EXL3_RETURN_IF_ERROR(RunDenseMlp(l, 0, T));
      } else {
        EXL3_RETURN_IF_ERROR(RunMoe(l, T));
        EXL3_RETURN_IF_ERROR(Mark(Phase::kMoe));
      }
    }
  }
  EXL3_RETURN_IF_ERROR(AddInPlace(act_.h.get(), act_.d.get(), static_cast<int64_t>(T) * H, stream_));
  EXL3_RETURN_IF_ERROR(GatherRmsNorm(act_.h.get(), meta_.logit_rows, R, final_norm_.get(), H, eps,
                                     act_.head_in.get(), stream_));
  return head_.Forward(act_.head_in.get(), R, act_.logits.get(), ctx_);
}

absl::Status CudaModel::FinishStep(int rows, const StepOutput& out) {
  if (out.logits != nullptr) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.logits, act_.logits.get(),
                                              static_cast<size_t>(rows) * cfg_.vocab_size * sizeof(float),
                                              cudaMemcpyDeviceToHost, Stream(stream_)));
    EXL3_RETURN_IF_ERROR(Mark(Phase::kHead));
  } else {
    // Only the tokens come back: the sampling's launches follow the head (after a decode graph's
    // replay, outside it).
    EXL3_RETURN_IF_ERROR(Mark(Phase::kHead));
    EXL3_RETURN_IF_ERROR(sampler_->Launch(act_.logits.get(), out.rows.first(rows), stream_));
    EXL3_RETURN_IF_ERROR(Mark(Phase::kSample));
  }
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(Stream(stream_)));
  if (out.logits == nullptr) sampler_->Collect(out.tokens.first(rows));
  return CollectPhaseTimes();
}

namespace {

// Batch sizes decode graphs are captured for; a step runs in the smallest that holds it.
constexpr int kGraphBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64};

bool IsDecodeStep(const StepBatch& batch) {
  for (const SequenceChunk& c : batch.chunks)
    if (c.tokens.size() != 1 || !c.wants_logits) return false;
  return true;
}

}  // namespace

void CudaModel::DropGraphs() {
  for (std::unique_ptr<DecodeGraph>& g : graphs_) {
    if (g != nullptr && g->exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g->exec));
    g.reset();
  }
}

absl::Status CudaModel::ForwardDecodeGraph(const StepTokens& tokens, const StepOutput& out) {
  const int B = tokens.num_tokens;
  size_t bucket_index = 0;
  while (kGraphBuckets[bucket_index] < B) ++bucket_index;
  const int Tp = kGraphBuckets[bucket_index];
  int stride = 16;
  for (const SequenceChunk& c : tokens.batch->chunks)
    while (stride < static_cast<int>(c.block_table.size())) stride *= 2;
  if (graphs_.size() <= bucket_index) graphs_.resize(bucket_index + 1);
  std::unique_ptr<DecodeGraph>& slot = graphs_[bucket_index];
  // A longer context than it was made for, or a step since its capture grew the kernels'
  // workspace (a long prompt's chunk): its launches would use the freed buffers.
  if (slot != nullptr &&
      (slot->table_stride < stride || slot->workspace_allocations != workspace_->allocations())) {
    if (slot->exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(slot->exec));
    slot.reset();
  }
  const int splits = DecodeAttentionSplits(Tp, AttentionBlocksPerToken(), sm_count_);
  EXL3_RETURN_IF_ERROR(Reserve(Tp, Tp, splits));  // may drop every graph
  if (slot == nullptr) {
    slot = std::make_unique<DecodeGraph>();
    slot->table_stride = stride;
  }
  DecodeGraph& g = *slot;
  EXL3_RETURN_IF_ERROR(PrepareStep(tokens, StepLayout{Tp, g.table_stride, splits}, &g.meta));
  if (g.exec == nullptr) {
    // Run the step eagerly first (it sizes every workspace, so capture allocates nothing, and its
    // phase times apportion the graph's), then capture the same launches for the next steps.
    marking_ = true;
    marks_.clear();
    EXL3_RETURN_IF_ERROR(Mark(Phase::kStart));
    EXL3_RETURN_IF_ERROR(RunLayers(Tp, Tp, nullptr));
    EXL3_RETURN_IF_ERROR(FinishStep(B, out));
    g.phases = times_;
    g.workspace_allocations = workspace_->allocations();  // as the eager run left it
    cudaStream_t stream = Stream(stream_);
    EXL3_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    marking_ = false;
    const absl::Status run = RunLayers(Tp, Tp, nullptr);
    marking_ = true;
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    cudaGraphExec_t exec = nullptr;
    cudaError_t inst = cudaErrorUnknown;
    if (run.ok() && end == cudaSuccess) inst = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();  // a failed capture leaves its error behind
    if (!run.ok() || end != cudaSuccess || inst != cudaSuccess) {
      std::fprintf(stderr, "W CUDA engine: decode graph capture for batch %d failed (%s); running without graphs\n",
                   Tp, !run.ok() ? std::string(run.message()).c_str()
                                 : cudaGetErrorString(end != cudaSuccess ? end : inst));
      graphs_enabled_ = false;
      return absl::OkStatus();
    }
    g.exec = exec;
    return absl::OkStatus();
  }
  marks_.clear();
  EXL3_RETURN_IF_ERROR(Mark(Phase::kStart));
  EXL3_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec), Stream(stream_)));
  EXL3_RETURN_IF_ERROR(FinishStep(B, out));
  // The graph's GPU time, apportioned as its eager run spent it (the sampling after it is timed
  // on its own).
  const double total = times_.head_s;
  const StepPhaseTimes& w = g.phases;
  const double eager = w.embed_s + w.attention_s + w.moe_s + w.dense_mlp_s + w.head_s;
  if (eager > 0) {
    const double f = total / eager;
    times_ = StepPhaseTimes{w.embed_s * f, w.attention_s * f, w.moe_s * f, w.dense_mlp_s * f, w.head_s * f,
                            times_.sample_s};
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Forward(const StepBatch& batch, float* logits) {
  return RunStep(batch, StepOutput{logits, {}, {}});
}

absl::Status CudaModel::ForwardSampled(const StepBatch& batch, std::span<const RowSampling> rows,
                                       std::span<SampledToken> tokens) {
  const size_t R = static_cast<size_t>(batch.NumLogitRows());
  if (rows.size() != R || tokens.size() != R)
    return absl::InvalidArgumentError(absl::StrCat("ForwardSampled: ", rows.size(), " sampling rows and ", tokens.size(),
                                                   " tokens for a step of ", R, " logit rows"));
  return RunStep(batch, StepOutput{nullptr, rows, tokens});
}

absl::Status CudaModel::RunStep(const StepBatch& batch, const StepOutput& out) {
  if (cache_.empty() && dsv4_cache_.empty()) return absl::FailedPreconditionError("KV cache not allocated");
  StepTokens tokens;
  EXL3_RETURN_IF_ERROR(FlattenStep(batch, cfg_.vocab_size, cache_shape_, cfg_.max_position_embeddings, &tokens));
  const int T = tokens.num_tokens;
  if (T == 0) return absl::OkStatus();
  // Recurrent layers read each chunk's state as the last successful step left it and write the
  // other copy; only the commit after the step's synchronisation makes those current, so a step
  // that fails leaves every state as it was (engine/model_runner.h).
  if (states_ != nullptr) EXL3_RETURN_IF_ERROR(states_->BeginStep(batch, stream_));
  // Decode graphs: the DeltaNet kernels read their chunks' state rows from the step's device
  // facts (rewritten before each replay), so graphs hold for recurrent layers too.
  const bool graph = graphs_enabled_ && remote_moe_ == nullptr &&
                     T <= kGraphBuckets[std::size(kGraphBuckets) - 1] && IsDecodeStep(batch);
  EXL3_RETURN_IF_ERROR(graph ? ForwardDecodeGraph(tokens, out) : RunEagerStep(batch, tokens, out));
  if (states_ != nullptr) states_->CommitStep(batch);
  return absl::OkStatus();
}

absl::Status CudaModel::RunEagerStep(const StepBatch& batch, const StepTokens& tokens, const StepOutput& out) {
  const int T = tokens.num_tokens, R = static_cast<int>(tokens.logit_tokens.size());
  marking_ = true;
  marks_.clear();
  EXL3_RETURN_IF_ERROR(Mark(Phase::kStart));
  EXL3_RETURN_IF_ERROR(PrepareStep(tokens, StepLayout{T, 0, 0}, &meta_.device));
  EXL3_RETURN_IF_ERROR(Reserve(T, R, step_splits_));
  if (exchange_ != nullptr) step_micro_batches_ = SplitIntoMicroBatches(batch, micro_batches_);
  if (dsv4_facts_ != nullptr)
    EXL3_RETURN_IF_ERROR(dsv4_facts_->Prepare(tokens,
                                              AttentionTokens{meta_.position, meta_.first_visible, meta_.table_offset,
                                                              meta_.tables, cache_shape_.block_size},
                                              sm_count_, stream_, &dsv4_step_));
  EXL3_RETURN_IF_ERROR(RunLayers(T, R, tokens.token_ids.data()));
  EXL3_RETURN_IF_ERROR(FinishStep(R, out));
  // The compressors' fold fails a step as the CPU engine's does (after the step: its error word).
  if (dsv4_facts_ != nullptr) EXL3_RETURN_IF_ERROR(dsv4_facts_->TakeError(stream_));
  if (exchange_ != nullptr) {
    EXL3_ASSIGN_OR_RETURN(exchange_times_, exchange_->StepTimes());
    times_.remote_moe_calls = exchange_times_.exchanges;
    times_.remote_moe_wait_s = exchange_times_.wait_s;
    times_.remote_moe_to_host_s = exchange_times_.to_host_s;
    times_.remote_moe_to_device_s = exchange_times_.to_device_s;
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda

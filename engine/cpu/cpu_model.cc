#include "engine/cpu/cpu_model.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/config/read_model_config.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/attention/load_attention.h"
#include "engine/cpu/mtp/load_mtp_drafter.h"
#include "engine/cpu/linear_attention/load_linear_attention.h"
#include "engine/cpu/local_moe.h"
#include "engine/core/micro_batches.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rms_norm.h"
#include "engine/core/step_tokens.h"
#include "kernels/fp16.h"
#include "kernels/moe_cpu.h"

namespace exl3::engine {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

void AddInPlace(float* h, const float* d, size_t n) {
  for (size_t i = 0; i < n; ++i) h[i] += d[i];
}

absl::Status CheckEmbedding(const TensorView& t, int vocab, int hidden) {
  if (t.info->shape != std::vector<int64_t>{vocab, hidden})
    return absl::InvalidArgumentError(absl::StrCat(t.info->name, ": expected shape [", vocab, ", ",
                                                   hidden, "]"));
  switch (t.info->dtype) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(t.info->name, ": embeddings of dtype ",
                                                     std::string(DTypeName(t.info->dtype)), " are not supported"));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuModel>> CpuModel::Open(const std::string& dir,
                                                         const CpuModelOptions& options,
                                                         std::unique_ptr<MoeExecutor> moe) {
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Read(dir + "/config.json"));
  return Open(dir, file, options, std::move(moe));
}

absl::StatusOr<std::unique_ptr<CpuModel>> CpuModel::Open(const std::string& dir, const ConfigFile& file,
                                                         const CpuModelOptions& options,
                                                         std::unique_ptr<MoeExecutor> moe) {
  // config.json read once: the model's configuration, and the experts' (and their fingerprint) when
  // they run here.
  EXL3_ASSIGN_OR_RETURN(ModelConfig cfg, LoadModelConfig(file, dir));
  if (options.micro_batches < 1 || options.micro_batches > 2)
    return absl::InvalidArgumentError("micro_batches must be 1 or 2");
  std::unique_ptr<CpuModel> m(new CpuModel(std::move(cfg), options.num_threads));
  m->micro_batches_ = options.micro_batches;
  EXL3_ASSIGN_OR_RETURN(m->src_, TensorSource::Open(dir, options.residency));
  EXL3_RETURN_IF_ERROR(m->LoadWeights(*m->src_));
  if (moe == nullptr) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<LocalMoe> local, LocalMoe::Open(dir, file, m->compute_, options.residency));
    moe = std::move(local);
  }
  m->moe_ = std::move(moe);

  m->info_ = ModelInfoFor(m->cfg_, dir, options.served_name);
  return m;
}

absl::Status CpuModel::LoadWeights(const TensorSource& src) {
  if (cfg_.qwen4exp != nullptr) return LoadQwen4ExpWeights(src);
  const int H = cfg_.hidden_size;
  // The language model's tensors: "model." (GLM-5.3-Flash: "model.language_model.", beside the
  // vision tower's "model.visual.*" and the MTP layer, which stay in the mapped files unread).
  const std::string text = TextModelPrefix(cfg_.moe);
  EXL3_ASSIGN_OR_RETURN(embedding_, src.Get(text + "embed_tokens.weight"));
  EXL3_RETURN_IF_ERROR(CheckEmbedding(embedding_, cfg_.vocab_size, H));
  layers_.resize(cfg_.num_layers);
  // DeepSeek-V4's checkpoints keep the original names: attn_norm / ffn_norm, head.
  const bool v4 = cfg_.attention == AttentionKind::kDsv4;
  const bool hyper_connected = v4 || cfg_.glm5next != nullptr;
  HyperConnectionShape hc;
  if (v4) {
    hc = {H, cfg_.dsv4->hc_mult, cfg_.dsv4->hc_sinkhorn_iters, cfg_.dsv4->hc_eps, cfg_.rms_norm_eps};
    EXL3_ASSIGN_OR_RETURN(hc_head_, HyperHead::Load(src, "model.hc_head.", hc));
  } else if (cfg_.glm5next != nullptr) {
    const Glm5NextConfig& g = *cfg_.glm5next;
    hc = {H, g.hc_mult, g.hc_sinkhorn_iters, g.hc_eps, cfg_.rms_norm_eps};
    hc_head_ = HyperHead::Mean(hc);
  }
  if (hyper_connected) streams_ = hc.streams;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = LayerPrefix(cfg_.moe, l);
    // Norm weights by the family's convention (Qwen3-Next: zero-centred; DeepSeek-V4 keeps
    // kScale under its original names).
    EXL3_ASSIGN_OR_RETURN(L.input_norm,
                          LoadNormWeight(src, p + (v4 ? "attn_norm.weight" : "input_layernorm.weight"), H,
                                         cfg_.norm_weights));
    EXL3_ASSIGN_OR_RETURN(L.post_attention_norm,
                          LoadNormWeight(src, p + (v4 ? "ffn_norm.weight" : "post_attention_layernorm.weight"),
                                         H, cfg_.norm_weights));
    if (hyper_connected) {
      EXL3_ASSIGN_OR_RETURN(L.attn_hc, HyperConnection::Load(src, p + "hc_attn_", hc));
      EXL3_ASSIGN_OR_RETURN(L.ffn_hc, HyperConnection::Load(src, p + "hc_ffn_", hc));
    }
    if (cfg_.IsLinearAttentionLayer(l)) {
      EXL3_ASSIGN_OR_RETURN(L.linear_attention, LoadLinearAttention(cfg_, src, l));
    } else {
      EXL3_ASSIGN_OR_RETURN(L.attention, LoadAttention(cfg_, src, l));
    }
    if (!cfg_.IsMoeLayer(l)) {
      const int I = cfg_.intermediate_size;
      DenseMlp mlp;
      EXL3_ASSIGN_OR_RETURN(mlp.gate, Linear::Load(src, p + "mlp.gate_proj", H, I));
      EXL3_ASSIGN_OR_RETURN(mlp.up, Linear::Load(src, p + "mlp.up_proj", H, I));
      EXL3_ASSIGN_OR_RETURN(mlp.down, Linear::Load(src, p + "mlp.down_proj", I, H));
      L.dense_mlp = std::move(mlp);
    }
  }
  EXL3_ASSIGN_OR_RETURN(final_norm_,
                        LoadNormWeight(src, text + "norm.weight", H, cfg_.norm_weights));
  const std::string head = v4 ? "head" : "lm_head";
  const bool has_head = src.Has(head + ".weight") || src.Has(head + ".trellis");
  if (has_head) {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::Load(src, head, H, cfg_.vocab_size));
  } else if (cfg_.tie_word_embeddings) {
    EXL3_ASSIGN_OR_RETURN(std::vector<float> w, ToFloat32(embedding_));
    head_ = Linear::FromDense(std::move(w), H, cfg_.vocab_size);
  } else {
    return absl::NotFoundError("lm_head: no lm_head.weight or lm_head.trellis, and the "
                               "embeddings are not tied (tie_word_embeddings false)");
  }
  return absl::OkStatus();
}

absl::Status CpuModel::LoadQwen4ExpWeights(const TensorSource& src) {
  const Qwen4ExpConfig& q = *cfg_.qwen4exp;
  const int H = cfg_.hidden_size;
  const std::string text = TextModelPrefix(cfg_.moe);
  EXL3_ASSIGN_OR_RETURN(embedding_, src.Get(text + "embed_tokens.weight"));
  EXL3_RETURN_IF_ERROR(CheckEmbedding(embedding_, cfg_.vocab_size, H));
  streams_ = q.hc_count;
  const GatedResidualShape shape{H, q.hc_count, q.hc_lowrank, cfg_.rms_norm_eps};
  layers_.resize(cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = LayerPrefix(cfg_.moe, l);
    EXL3_ASSIGN_OR_RETURN(L.attn_gr, GatedResidual::Load(src, p + "attn_hyper_connection.", shape, true));
    EXL3_ASSIGN_OR_RETURN(L.ffn_gr, GatedResidual::Load(src, p + "mlp_hyper_connection.", shape, true));
    if (q.ple.PleIndex(l) >= 0) {
      EXL3_ASSIGN_OR_RETURN(L.ple, PleLayer::Load(cfg_, src, l));
    }
    if (cfg_.IsLinearAttentionLayer(l)) {
      EXL3_ASSIGN_OR_RETURN(L.linear_attention, LoadLinearAttention(cfg_, src, l));
    } else {
      EXL3_ASSIGN_OR_RETURN(L.attention, LoadAttention(cfg_, src, l));
    }
    if (!cfg_.IsMoeLayer(l)) return absl::InternalError(absl::StrCat("Qwen4-Exp layer ", l, " is not MoE"));
  }
  EXL3_ASSIGN_OR_RETURN(final_mixer_, GatedResidual::Load(src, text + "hyper_connection_mixer.", shape, false));
  EXL3_ASSIGN_OR_RETURN(head_, Linear::Load(src, "lm_head", H, cfg_.vocab_size));
  // Beside the text model: the vision tower, loaded and not run (prompts holding image or video
  // placeholders are refused), and the MTP head, loaded by EnableMtpDrafting with mtp (and
  // otherwise not read).
  int visual = 0, mtp = 0;
  for (const std::string& name : src.Names()) {
    const bool is_visual = name.rfind("model.visual.", 0) == 0, is_mtp = name.rfind("mtp.", 0) == 0;
    if (!is_visual && !is_mtp) continue;
    EXL3_ASSIGN_OR_RETURN(TensorView v, src.Get(name));
    (void)v;
    if (is_visual) ++visual;
    if (is_mtp) ++mtp;
  }
  LogInfo("%s: %d vision tower tensors loaded and not run (text only), %d MTP head tensors "
          "(run with --speculative-method mtp)", cfg_.architecture().c_str(), visual, mtp);
  return absl::OkStatus();
}

absl::Status CpuModel::CheckDraftVerification() const {
  // Recurrent layers (gated DeltaNet, KDA) and PLE keep a verify chunk's state after each of its
  // positions (engine/cpu/sequence_state.h), and DeepSeek-V4's compressed layers their compressors'
  // accumulators (engine/cpu/attention/dsv4_kept_accumulators.h); the other attention kinds keep nothing per
  // sequence but each position's cache slot, and the pooled / block indexers of GLM-5.3-Flash and
  // Qwen4-Exp form their pool keys afresh each step from complete pools at or before the query,
  // so a rejected position's slot is overwritten before anything reads it.
  return absl::OkStatus();
}

absl::Status CpuModel::CheckMtpDrafting() const {
  EXL3_RETURN_IF_ERROR(CheckMtpDrafter(cfg_, *src_));  // the design and its tensors, by name
  return CheckDraftVerification();
}

absl::Status CpuModel::EnableMtpDrafting() {
  if (mtp_head_ != nullptr || dspark_ != nullptr) return absl::OkStatus();
  if (cache_ != nullptr) return absl::FailedPreconditionError("EnableMtpDrafting after AllocateKvCache");
  EXL3_RETURN_IF_ERROR(CheckMtpDrafting());
  if (cfg_.dsv4 != nullptr) {  // the DSPARK drafter: one main-kv row per block and position
    EXL3_ASSIGN_OR_RETURN(dspark_, DsparkDrafter::Load(cfg_, *src_, embedding_, head_));
    info_.kv_bytes_per_token +=
        static_cast<int64_t>(dspark_->num_blocks()) * dspark_->row_width() * static_cast<int64_t>(sizeof(float));
    return absl::OkStatus();
  }
  EXL3_ASSIGN_OR_RETURN(mtp_head_, LoadMtpDrafter(cfg_, *src_, head_));
  // The MTP layer's KV slots, its block area shared out over the block's slots (rounded up).
  const int bs = KvCacheShape{}.block_size;
  const KvLayerShape s = mtp_head_->CacheShape(bs);
  info_.kv_bytes_per_token +=
      (static_cast<int64_t>(s.token_floats) * bs + s.block_floats + bs - 1) / bs * static_cast<int64_t>(sizeof(float));
  return absl::OkStatus();
}

absl::Status CpuModel::MtpBatchOf(std::span<const MtpSpan> spans, bool every_position, StepBatch* batch,
                                  std::vector<float>* hidden) const {
  if (mtp_head_ == nullptr) return absl::FailedPreconditionError("MTP drafting is not enabled");
  EXL3_RETURN_IF_ERROR(kept_.chunks.CheckSpans(spans));
  const int W = mtp_head_->state_width();
  for (const MtpSpan& s : spans) {
    SequenceChunk& chunk = batch->chunks.emplace_back(MtpChunkOf(s));
    if (every_position) {
      chunk.wants_logits = true;
      chunk.num_logit_rows = s.num_positions;
    }
    const float* first = &kept_.rows[static_cast<size_t>(kept_.chunks.first_row(s.chunk_index)) * W];
    hidden->insert(hidden->end(), first, first + static_cast<size_t>(s.num_positions) * W);
  }
  return absl::OkStatus();
}

absl::Status CpuModel::RunMtp(const StepBatch& batch, const std::vector<float>& hidden, std::vector<float>* o,
                              std::vector<float>* logits) {
  const int H = cfg_.hidden_size, V = cfg_.vocab_size, W = mtp_head_->state_width();
  StepTokens tokens;
  EXL3_RETURN_IF_ERROR(FlattenStep(batch, V, cache_->shape(), cfg_.max_position_embeddings, &tokens));
  std::vector<float> embedded(static_cast<size_t>(tokens.num_tokens) * H), out(static_cast<size_t>(tokens.num_tokens) * W);
  Embed(tokens.token_ids, /*streams=*/1, embedded.data());  // one row per token, whatever streams_
  EXL3_RETURN_IF_ERROR(mtp_head_->Forward(hidden.data(), embedded.data(), tokens, *cache_, out.data(), compute_));
  const int rows = static_cast<int>(tokens.logit_tokens.size());
  o->resize(static_cast<size_t>(rows) * W);
  logits->resize(static_cast<size_t>(rows) * V);
  for (int r = 0; r < rows; ++r)
    std::copy_n(&out[static_cast<size_t>(tokens.logit_tokens[r]) * W], W, &(*o)[static_cast<size_t>(r) * W]);
  return mtp_head_->Logits(o->data(), rows, logits->data(), compute_);
}

absl::StatusOr<std::vector<float>> CpuModel::MtpLogits(std::span<const MtpSpan> spans) {
  if (dspark_ != nullptr) return absl::UnimplementedError("MtpLogits: the DSPARK drafter drafts blocks");
  StepBatch batch;
  std::vector<float> hidden, o, logits;
  EXL3_RETURN_IF_ERROR(MtpBatchOf(spans, /*every_position=*/true, &batch, &hidden));
  EXL3_RETURN_IF_ERROR(RunMtp(batch, hidden, &o, &logits));
  return logits;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> CpuModel::ProposeDsparkDrafts(std::span<const MtpSpan> spans) {
  EXL3_RETURN_IF_ERROR(kept_.chunks.CheckSpans(spans));
  const int TW = dspark_->tap_width(), D = dspark_->row_width(), N = dspark_->num_blocks();
  const int layer = cfg_.num_layers;  // the rows' cache layer
  std::vector<std::vector<int32_t>> drafts(spans.size());
  std::vector<std::vector<float>> rows(N);
  std::vector<float*> row_ptrs(N);
  std::vector<const float*> history_ptrs(N);
  for (size_t k = 0; k < spans.size(); ++k) {
    const MtpSpan& s = spans[k];
    // 1. The kept positions' main-kv rows, from their taps.
    const float* taps = &kept_.rows[static_cast<size_t>(kept_.chunks.first_row(s.chunk_index)) * TW];
    for (int i = 0; i < N; ++i) {
      rows[i].resize(static_cast<size_t>(s.num_positions) * D);
      row_ptrs[i] = rows[i].data();
    }
    EXL3_RETURN_IF_ERROR(dspark_->MainKvRows(taps, s.num_positions, s.start_position, row_ptrs, compute_));
    for (int j = 0; j < s.num_positions; ++j) {
      float* slot = cache_->Slot(layer, s.block_table, s.start_position + j);
      for (int i = 0; i < N; ++i) std::copy_n(&rows[i][static_cast<size_t>(j) * D], D, slot + static_cast<size_t>(i) * D);
    }
    if (s.num_drafts <= 0) continue;
    // 2. One block draft after the last kept position, over the rows of the window before it.
    const int p0 = s.start_position + s.num_positions;
    const int hist = std::min(dspark_->window(), p0);
    for (int i = 0; i < N; ++i) {
      rows[i].resize(static_cast<size_t>(hist) * D);
      for (int j = 0; j < hist; ++j)
        std::copy_n(cache_->Slot(layer, s.block_table, p0 - hist + j) + static_cast<size_t>(i) * D, D,
                    &rows[i][static_cast<size_t>(j) * D]);
      history_ptrs[i] = rows[i].data();
    }
    EXL3_ASSIGN_OR_RETURN(DsparkDraft d, dspark_->Draft(history_ptrs, hist, s.next_tokens.back(), p0, compute_));
    const int n = std::min(s.num_drafts, d.length);
    drafts[k].assign(d.drafts.begin(), d.drafts.begin() + n);
  }
  return drafts;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> CpuModel::ProposeMtpDrafts(std::span<const MtpSpan> spans) {
  if (dspark_ != nullptr) return ProposeDsparkDrafts(spans);
  if (mtp_head_ == nullptr) return absl::FailedPreconditionError("MTP drafting is not enabled");
  const int W = mtp_head_->state_width(), V = cfg_.vocab_size;
  std::vector<std::vector<int32_t>> drafts(spans.size());
  // 1. Every span's kept positions, from the model's hidden states; a decoding span's last
  // position gives its first draft. 2. Chained: each further draft from the head's own output
  // at the position before and the draft just made.
  StepBatch batch;
  std::vector<float> hidden, o, logits;
  EXL3_RETURN_IF_ERROR(MtpBatchOf(spans, /*every_position=*/false, &batch, &hidden));
  std::vector<int> owners;  // the span of each logit row, in order
  for (size_t i = 0; i < spans.size(); ++i)
    if (spans[i].num_drafts > 0) owners.push_back(static_cast<int>(i));
  while (!batch.chunks.empty()) {
    EXL3_RETURN_IF_ERROR(RunMtp(batch, hidden, &o, &logits));
    StepBatch next;
    std::vector<int> next_owners;
    hidden.clear();
    for (size_t r = 0; r < owners.size(); ++r) {
      const float* l = &logits[r * V];
      const int32_t token = static_cast<int32_t>(std::max_element(l, l + V) - l);  // lowest id on ties
      const int i = owners[r];
      drafts[i].push_back(token);
      const MtpSpan& s = spans[i];
      if (static_cast<int>(drafts[i].size()) >= s.num_drafts) continue;
      SequenceChunk& chunk = next.chunks.emplace_back();
      chunk.sequence_id = s.sequence_id;
      chunk.tokens = {token};
      // Draft d (1-based) sits at position p + 1 + d, p the last kept position; the head predicts
      // it at position p + d - 1 + 1 from the draft before.
      chunk.start_position = s.start_position + s.num_positions - 1 + static_cast<int>(drafts[i].size());
      chunk.block_table = s.block_table;
      chunk.wants_logits = true;
      chunk.state_slot = s.state_slot;
      next_owners.push_back(i);
      hidden.insert(hidden.end(), &o[r * W], &o[r * W] + W);
    }
    batch = std::move(next);
    owners = std::move(next_owners);
  }
  return drafts;
}

absl::Status CpuModel::AllocateKvCache(const KvCacheShape& shape) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", shape.num_blocks, " blocks of ",
                                                   shape.block_size, " tokens"));
  std::vector<KvLayerShape> layers(cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l)
    layers[l] = {cfg_.KvWidth(l), cfg_.KvBlockFloats(l, shape.block_size)};
  if (mtp_head_ != nullptr) layers.push_back(mtp_head_->CacheShape(shape.block_size));  // layer num_layers
  if (dspark_ != nullptr)  // layer num_layers: each position's main-kv row of every block
    layers.push_back({dspark_->num_blocks() * dspark_->row_width(), 0});
  cache_ = std::make_unique<PagedKvCache>(std::move(layers), shape);
  if (cfg_.HasRecurrentLayers()) {
    EXL3_ASSIGN_OR_RETURN(std::vector<int64_t> floats, StateFloatsPerLayer(cfg_, shape.num_sequence_slots));
    EXL3_ASSIGN_OR_RETURN(states_, SequenceStateStore::Create(std::move(floats), shape.num_sequence_slots,
                                                              shape.max_logit_rows_per_chunk));
  }
  return absl::OkStatus();
}

void CpuModel::Embed(const std::vector<int32_t>& ids, int streams, float* h) const {
  const int H = cfg_.hidden_size;
  for (size_t t = 0; t < ids.size(); ++t) {
    float* row = h + t * H * streams;
    const size_t base = static_cast<size_t>(ids[t]) * H;
    switch (embedding_.info->dtype) {
      case DType::kF32:
        std::memcpy(row, embedding_.as<float>() + base, H * sizeof(float));
        break;
      case DType::kF16:
        for (int i = 0; i < H; ++i) row[i] = HalfBitsToFloat(embedding_.as<uint16_t>()[base + i]);
        break;
      default:  // kBF16 (CheckEmbedding refused the rest)
        for (int i = 0; i < H; ++i) row[i] = BFloat16BitsToFloat(embedding_.as<uint16_t>()[base + i]);
        break;
    }
    for (int k = 1; k < streams; ++k) std::copy_n(row, H, row + static_cast<size_t>(k) * H);  // every stream
  }
}

absl::Status CpuModel::RunDenseMlp(const DenseMlp& mlp, const float* x, int T, float* y) {
  const size_t n = static_cast<size_t>(T) * cfg_.intermediate_size;
  std::vector<float> gate(n), up(n);
  EXL3_RETURN_IF_ERROR(mlp.gate.Forward(x, T, gate.data(), compute_));
  EXL3_RETURN_IF_ERROR(mlp.up.Forward(x, T, up.data(), compute_));
  SwiGlu(gate.data(), up.data(), n, cfg_.dense_swiglu_limit);
  return mlp.down.Forward(gate.data(), T, y, compute_);
}

absl::Status CpuModel::MixTokens(const Layer& L, MicroBatch& mb) {
  if (L.linear_attention != nullptr)
    return L.linear_attention->Forward(mb.x.data(), mb.tokens, *states_, mb.d.data(), compute_);
  return L.attention->Forward(mb.x.data(), mb.tokens, *cache_, mb.carry, mb.d.data(), compute_);
}

absl::Status CpuModel::RunHyperConnectedLayer(int l, MicroBatch& mb) {
  Layer& L = layers_[l];
  const int T = mb.tokens.num_tokens, H = cfg_.hidden_size;
  Clock::time_point t0 = Clock::now();
  L.attn_hc->Collapse(mb.h.data(), T, mb.d.data(), &mb.mix, compute_);
  RmsNormRows(mb.d.data(), L.input_norm.data(), T, H, cfg_.rms_norm_eps, mb.x.data());
  EXL3_RETURN_IF_ERROR(MixTokens(L, mb));
  L.attn_hc->Expand(mb.mix, mb.d.data(), T, mb.h.data(), compute_);
  L.ffn_hc->Collapse(mb.h.data(), T, mb.d.data(), &mb.mix, compute_);
  RmsNormRows(mb.d.data(), L.post_attention_norm.data(), T, H, cfg_.rms_norm_eps, mb.x.data());
  times_.attention_s += Seconds(t0);
  t0 = Clock::now();
  if (L.dense_mlp) {
    EXL3_RETURN_IF_ERROR(RunDenseMlp(*L.dense_mlp, mb.x.data(), T, mb.d.data()));
    L.ffn_hc->Expand(mb.mix, mb.d.data(), T, mb.h.data(), compute_);
    times_.dense_mlp_s += Seconds(t0);
    return absl::OkStatus();
  }
  mb.pending_layer = l;
  mb.pending = moe_->Start(l, mb.x.data(), T, mb.tokens.token_ids.data(), mb.d.data());
  times_.moe_s += Seconds(t0);
  return absl::OkStatus();
}

absl::Status CpuModel::RunGatedResidualLayer(int l, MicroBatch& mb) {
  Layer& L = layers_[l];
  const int T = mb.tokens.num_tokens;
  Clock::time_point t0 = Clock::now();
  if (L.ple != nullptr) EXL3_RETURN_IF_ERROR(L.ple->Forward(mb.h.data(), mb.tokens, *states_, compute_));
  EXL3_RETURN_IF_ERROR(L.attn_gr->Collapse(mb.h.data(), T, mb.x.data(), &mb.inject, compute_));
  EXL3_RETURN_IF_ERROR(MixTokens(L, mb));
  L.attn_gr->Expand(mb.inject, mb.d.data(), T, mb.h.data());
  EXL3_RETURN_IF_ERROR(L.ffn_gr->Collapse(mb.h.data(), T, mb.x.data(), &mb.inject, compute_));
  times_.attention_s += Seconds(t0);
  t0 = Clock::now();
  mb.pending_layer = l;
  mb.pending = moe_->Start(l, mb.x.data(), T, mb.tokens.token_ids.data(), mb.d.data());
  times_.moe_s += Seconds(t0);
  return absl::OkStatus();
}

absl::Status CpuModel::RunLayer(int l, MicroBatch& mb) {
  Layer& L = layers_[l];
  if (L.attn_hc) return RunHyperConnectedLayer(l, mb);
  if (L.attn_gr) return RunGatedResidualLayer(l, mb);
  const int T = mb.tokens.num_tokens, H = cfg_.hidden_size;
  const size_t n = static_cast<size_t>(T) * H;
  Clock::time_point t0 = Clock::now();
  RmsNormRows(mb.h.data(), L.input_norm.data(), T, H, cfg_.rms_norm_eps, mb.x.data());
  EXL3_RETURN_IF_ERROR(MixTokens(L, mb));
  AddInPlace(mb.h.data(), mb.d.data(), n);
  RmsNormRows(mb.h.data(), L.post_attention_norm.data(), T, H, cfg_.rms_norm_eps, mb.x.data());
  times_.attention_s += Seconds(t0);
  t0 = Clock::now();
  if (L.dense_mlp) {
    EXL3_RETURN_IF_ERROR(RunDenseMlp(*L.dense_mlp, mb.x.data(), T, mb.d.data()));
    AddInPlace(mb.h.data(), mb.d.data(), n);
    times_.dense_mlp_s += Seconds(t0);
    return absl::OkStatus();
  }
  mb.pending_layer = l;
  mb.pending = moe_->Start(l, mb.x.data(), T, mb.tokens.token_ids.data(), mb.d.data());
  times_.moe_s += Seconds(t0);
  return absl::OkStatus();
}

absl::Status CpuModel::FinishMoe(MicroBatch& mb) {
  if (mb.pending == nullptr) return absl::OkStatus();
  const Clock::time_point t0 = Clock::now();
  const absl::Status st = mb.pending->Wait();
  mb.pending.reset();
  const double waited = Seconds(t0);
  times_.moe_s += waited;
  if (moe_->remote()) {
    ++times_.remote_moe_calls;
    times_.remote_moe_wait_s += waited;
  }
  EXL3_RETURN_IF_ERROR(st);
  const int layer = mb.pending_layer;
  mb.pending_layer = -1;
  if (layer >= 0 && layers_[layer].ffn_hc) {
    layers_[layer].ffn_hc->Expand(mb.mix, mb.d.data(), mb.tokens.num_tokens, mb.h.data(), compute_);
  } else if (layer >= 0 && layers_[layer].ffn_gr) {
    layers_[layer].ffn_gr->Expand(mb.inject, mb.d.data(), mb.tokens.num_tokens, mb.h.data());
  } else {
    AddInPlace(mb.h.data(), mb.d.data(), mb.h.size());
  }
  return absl::OkStatus();
}

void CpuModel::TapLayer(int layer, MicroBatch& mb) const {
  const std::vector<int>& ids = cfg_.dsv4->dspark.target_layer_ids;
  const auto it = std::find(ids.begin(), ids.end(), layer);
  if (it == ids.end()) return;
  const int H = cfg_.hidden_size, T = mb.tokens.num_tokens, TW = dspark_->tap_width();
  const int slot = static_cast<int>(it - ids.begin());
  mb.taps.resize(static_cast<size_t>(T) * TW);
  for (int t = 0; t < T; ++t) {
    const float* x = &mb.h[static_cast<size_t>(t) * streams_ * H];
    float* y = &mb.taps[static_cast<size_t>(t) * TW + static_cast<size_t>(slot) * H];
    for (int d = 0; d < H; ++d) {
      float acc = 0.0f;
      for (int k = 0; k < streams_; ++k) acc += x[static_cast<size_t>(k) * H + d];
      y[d] = acc / static_cast<float>(streams_);
    }
  }
}

void CpuModel::KeepHiddenStates(const StepBatch& batch, const std::vector<MicroBatch>& mbs) {
  if (dspark_ != nullptr) {  // the taps, as TapLayer left them
    const size_t TW = dspark_->tap_width();
    kept_.rows.resize(static_cast<size_t>(batch.NumTokens()) * TW);
    float* row = kept_.rows.data();
    for (const MicroBatch& mb : mbs) {
      std::copy_n(mb.taps.data(), static_cast<size_t>(mb.tokens.num_tokens) * TW, row);
      row += static_cast<size_t>(mb.tokens.num_tokens) * TW;
    }
    kept_.chunks.Record(batch);
    return;
  }
  const int H = cfg_.hidden_size, W = mtp_head_->state_width();
  kept_.rows.resize(static_cast<size_t>(batch.NumTokens()) * W);
  float* row = kept_.rows.data();
  std::vector<float> collapsed;
  for (const MicroBatch& mb : mbs) {  // micro-batches are consecutive runs of the step's tokens
    const int T = mb.tokens.num_tokens;
    if (mtp_head_->input() == MtpInput::kStreams) {  // the streams as they are
      std::copy_n(mb.h.data(), static_cast<size_t>(T) * W, row);
      row += static_cast<size_t>(T) * W;
      continue;
    }
    const float* h = mb.h.data();
    if (hc_head_) {  // the streams collapsed as the head's rows are (GLM-5.3-Flash: their mean)
      std::vector<int> all(T);
      std::iota(all.begin(), all.end(), 0);
      collapsed.resize(static_cast<size_t>(T) * H);
      hc_head_->Collapse(mb.h.data(), all, collapsed.data());
      h = collapsed.data();
    }
    RmsNormRows(h, final_norm_.data(), T, H, cfg_.rms_norm_eps, row);
    row += static_cast<size_t>(T) * H;
  }
  kept_.chunks.Record(batch);
}

absl::Status CpuModel::Forward(const StepBatch& batch, float* logits) {
  if (cache_ == nullptr) return absl::FailedPreconditionError("KV cache not allocated");
  kept_.chunks.Clear();
  if (batch.keep_hidden_states && mtp_head_ == nullptr && dspark_ == nullptr)
    return absl::FailedPreconditionError("keep_hidden_states without MTP drafting enabled");
  times_ = StepPhaseTimes{};
  (void)moe_->TakeStageTimes();  // what a failed step before this one left
  // Recurrent layers read each chunk's state as the last successful step left it and write the
  // other copy; only the commit below, after every layer, makes those current.
  if (states_ != nullptr) EXL3_RETURN_IF_ERROR(states_->BeginStep(batch));
  const int H = cfg_.hidden_size;
  // One micro-batch reads the step as it is; two need their own chunk lists.
  std::vector<StepBatch> split;
  const std::vector<MicroBatchRange> ranges = SplitIntoMicroBatches(batch, micro_batches_);
  if (ranges.size() > 1)
    for (const MicroBatchRange& r : ranges) split.push_back(MicroBatchChunks(batch, r));
  std::vector<const StepBatch*> parts;
  if (split.empty()) {
    parts.push_back(&batch);
  } else {
    for (const StepBatch& b : split) parts.push_back(&b);
  }
  std::vector<MicroBatch> mbs(parts.size());
  Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < parts.size(); ++i) {
    MicroBatch& mb = mbs[i];
    EXL3_RETURN_IF_ERROR(FlattenStep(*parts[i], cfg_.vocab_size, cache_->shape(),
                                     cfg_.max_position_embeddings, &mb.tokens));
    const size_t n = static_cast<size_t>(mb.tokens.num_tokens) * H;
    mb.h.resize(n * streams_);
    mb.x.resize(n);
    mb.d.resize(n);
    Embed(mb.tokens.token_ids, streams_, mb.h.data());
  }
  times_.embed_s = Seconds(t0);

  // Ping-pong: micro-batch i's layer l waits for its own MoE call of layer l - 1 only.
  // DSPARK drafting taps a layer's output once its MoE has finished: at the next layer's start.
  const bool tap = batch.keep_hidden_states && dspark_ != nullptr;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (MicroBatch& mb : mbs) {
      EXL3_RETURN_IF_ERROR(FinishMoe(mb));
      if (tap && l > 0) TapLayer(l - 1, mb);
      EXL3_RETURN_IF_ERROR(RunLayer(l, mb));
    }
  }
  for (MicroBatch& mb : mbs) {
    EXL3_RETURN_IF_ERROR(FinishMoe(mb));
    if (tap) TapLayer(cfg_.num_layers - 1, mb);
  }

  if (batch.keep_hidden_states) KeepHiddenStates(batch, mbs);
  t0 = Clock::now();
  float* out = logits;
  for (MicroBatch& mb : mbs) {
    const int rows = static_cast<int>(mb.tokens.logit_tokens.size());
    std::vector<float> last(static_cast<size_t>(rows) * H);
    const float* final_h = mb.h.data();
    std::vector<int> row_tokens(mb.tokens.logit_tokens.begin(), mb.tokens.logit_tokens.end());
    std::vector<float> collapsed;
    if (final_mixer_) {  // Qwen4-Exp: the streams of each logit row mixed into the head's input, no norm
      const size_t wide = static_cast<size_t>(streams_) * H;
      std::vector<float> rows_h(static_cast<size_t>(rows) * wide);
      for (int r = 0; r < rows; ++r)
        std::copy_n(&mb.h[static_cast<size_t>(row_tokens[r]) * wide], wide, &rows_h[r * wide]);
      EXL3_RETURN_IF_ERROR(final_mixer_->Collapse(rows_h.data(), rows, last.data(), nullptr, compute_));
      EXL3_RETURN_IF_ERROR(head_.Forward(last.data(), rows, out, compute_));
      out += static_cast<size_t>(rows) * cfg_.vocab_size;
      continue;
    }
    if (hc_head_) {  // the streams of each logit row, collapsed
      collapsed.resize(static_cast<size_t>(rows) * H);
      hc_head_->Collapse(mb.h.data(), row_tokens, collapsed.data());
      final_h = collapsed.data();
      std::iota(row_tokens.begin(), row_tokens.end(), 0);
    }
    for (int r = 0; r < rows; ++r)
      RmsNorm(&final_h[static_cast<size_t>(row_tokens[r]) * H], final_norm_.data(), H,
              cfg_.rms_norm_eps, &last[static_cast<size_t>(r) * H]);
    EXL3_RETURN_IF_ERROR(head_.Forward(last.data(), rows, out, compute_));
    out += static_cast<size_t>(rows) * cfg_.vocab_size;
  }
  times_.head_s = Seconds(t0);
  const MoeStageTimes stages = moe_->TakeStageTimes();
  times_.moe_gate_s = stages.gate_s;
  times_.moe_experts_s = stages.experts_s;
  if (states_ != nullptr) states_->CommitStep(batch);
  return absl::OkStatus();
}

}  // namespace exl3::engine

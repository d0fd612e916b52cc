#include "engine/cuda/cuda_dspark_drafter.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/dsv4_config.h"
#include "engine/cpu/attention/dsv4_grouped_wo_a.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "engine/cuda/cublas_status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

template <typename T>
absl::Status Grow(DeviceArray<T>& a, size_t n) {
  return a.size() >= n ? absl::OkStatus() : a.Reserve(n);
}

void PushFloats(const std::vector<float>& v, std::vector<int32_t>* host) {
  const size_t at = host->size();
  host->resize(at + v.size());
  if (!v.empty()) std::memcpy(host->data() + at, v.data(), v.size() * sizeof(float));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDsparkDrafter>> CudaDsparkDrafter::Load(const ModelConfig& model_cfg,
                                                                           const TensorSource& src,
                                                                           const CudaMtpModelParts& parts) {
  EXL3_ASSIGN_OR_RETURN(const DsparkShape shape, DsparkShape::Of(model_cfg));
  if (parts.head == nullptr || parts.embedding == nullptr)
    return absl::InvalidArgumentError("the DSPARK drafter needs the model's embeddings and head");
  const Dsv4Config& v = *model_cfg.dsv4;
  const Dsv4DsparkConfig& ds = v.dspark;
  // Block i runs as layer num_hidden_layers + i (its MoE's routing reads the layer lists).
  ModelConfig cfg = model_cfg;
  for (int i = 0; i < ds.num_blocks; ++i) cfg = WithMtpLayer(cfg, /*moe=*/true);
  std::unique_ptr<CudaDsparkDrafter> d(new CudaDsparkDrafter(std::move(cfg), parts));
  const int H = model_cfg.hidden_size, NH = model_cfg.num_heads, D = v.head_dim;
  d->shape_ = shape;
  for (int l : ds.target_layer_ids)
    if (l < 0 || l >= model_cfg.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("dspark_target_layer_ids: layer ", l, " of ",
                                                     model_cfg.num_layers));
  d->tap_layers_ = ds.target_layer_ids;
  EXL3_ASSIGN_OR_RETURN(d->main_proj_, CudaLinear::Load(src, "mtp.0.main_proj", d->shape_.tap_width, H));
  EXL3_ASSIGN_OR_RETURN(d->main_norm_, UploadVector(src, "mtp.0.main_norm.weight", H));
  const HyperConnectionShape hc = {H, v.hc_mult, v.hc_sinkhorn_iters, v.hc_eps, model_cfg.rms_norm_eps};
  const int G = v.o_groups, R = v.o_lora_rank;
  for (int i = 0; i < ds.num_blocks; ++i) {
    const std::string p = absl::StrCat("mtp.", i, ".");
    Block& b = d->blocks_.emplace_back();
    EXL3_ASSIGN_OR_RETURN(b.attn_norm, UploadVector(src, p + "attn_norm.weight", H));
    EXL3_ASSIGN_OR_RETURN(b.ffn_norm, UploadVector(src, p + "ffn_norm.weight", H));
    EXL3_ASSIGN_OR_RETURN(b.wq_a, CudaLinear::Load(src, p + "attn.wq_a", H, v.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(b.q_norm, UploadVector(src, p + "attn.q_norm.weight", v.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(b.wq_b, CudaLinear::Load(src, p + "attn.wq_b", v.q_lora_rank, NH * D));
    EXL3_ASSIGN_OR_RETURN(b.wkv, CudaLinear::Load(src, p + "attn.wkv", H, D));
    EXL3_ASSIGN_OR_RETURN(b.kv_norm, UploadVector(src, p + "attn.kv_norm.weight", D));
    EXL3_ASSIGN_OR_RETURN(b.sinks, UploadVector(src, p + "attn.attn_sink", NH));
    EXL3_ASSIGN_OR_RETURN(b.wo_b, CudaLinear::Load(src, p + "attn.wo_b", G * R, H));
    {
      EXL3_ASSIGN_OR_RETURN(const std::vector<float> wo_a, LoadGroupedWoA(src, p + "attn.wo_a", G, R, NH * D / G));
      EXL3_RETURN_IF_ERROR(b.wo_a.Upload(wo_a));
    }
    EXL3_ASSIGN_OR_RETURN(b.hc_attn, UploadHyperConnection(src, p + "hc_attn_", hc));
    EXL3_ASSIGN_OR_RETURN(b.hc_ffn, UploadHyperConnection(src, p + "hc_ffn_", hc));
    EXL3_ASSIGN_OR_RETURN(CudaMtpMoe moe, CudaMtpMoe::Load(d->cfg_, src, model_cfg.num_layers + i, p,
                                                           parts.max_moe_tokens, parts.linear));
    b.moe.emplace(std::move(moe));
  }
  const std::string l = absl::StrCat("mtp.", ds.num_blocks - 1, ".");
  const int n = v.hc_mult, r = ds.markov_rank, V = model_cfg.vocab_size;
  EXL3_ASSIGN_OR_RETURN(d->head_fn_, UploadMatrix(src, l + "hc_head_fn", n, static_cast<int64_t>(n) * H));
  EXL3_ASSIGN_OR_RETURN(d->head_base_, UploadVector(src, l + "hc_head_base", n));
  EXL3_ASSIGN_OR_RETURN(const std::vector<float> scale, LoadVector(src, l + "hc_head_scale", 1));
  d->head_scale_ = scale[0];
  EXL3_ASSIGN_OR_RETURN(d->norm_, UploadVector(src, l + "norm.weight", H));
  EXL3_ASSIGN_OR_RETURN(d->markov_w1_, UploadMatrix(src, l + "markov_head.markov_w1.weight", V, r));
  EXL3_ASSIGN_OR_RETURN(d->markov_w2_, UploadMatrix(src, l + "markov_head.markov_w2.weight", V, r));
  if (src.Has(l + "markov_head.markov_w2.bias")) {
    EXL3_ASSIGN_OR_RETURN(d->markov_b2_, UploadVector(src, l + "markov_head.markov_w2.bias", V));
  }
  EXL3_ASSIGN_OR_RETURN(d->conf_w_, UploadMatrix(src, l + "confidence_head.proj.weight", 1, H + r));
  DsparkHeads& h = d->heads_args_;
  if (src.Has(l + "confidence_head.proj.bias")) {
    EXL3_ASSIGN_OR_RETURN(const std::vector<float> cb, LoadVector(src, l + "confidence_head.proj.bias", 1));
    h.conf_b = cb[0];
  }
  h.markov_w1 = d->markov_w1_.get();
  h.markov_w2 = d->markov_w2_.get();
  h.markov_b2 = d->markov_b2_.empty() ? nullptr : d->markov_b2_.get();
  h.conf_w = d->conf_w_.get();
  h.vocab = V;
  h.rank = r;
  h.hidden = H;
  // The uploads ran on the legacy stream, which the model's non-blocking stream does not wait for.
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return d;
}

absl::Status CudaDsparkDrafter::AllocateCache(const KvCacheShape& shape, StreamHandle stream) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("DSPARK row cache of ", shape.num_blocks, " blocks of ",
                                                   shape.block_size));
  cache_blocks_ = shape.num_blocks + 1;  // one spare, as the model's layers have
  cache_block_size_ = shape.block_size;
  const size_t n = static_cast<size_t>(num_blocks()) * cache_blocks_ * cache_block_size_ * shape_.head_dim;
  EXL3_RETURN_IF_ERROR(rows_.Reserve(n));
  // Zero rows where no position was written yet (none is read before it is written).
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(rows_.get(), 0, n * sizeof(float), static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

Dsv4CacheView CudaDsparkDrafter::RowsView(int block) const {
  Dsv4CacheView v;
  v.layer = rows_.get() + static_cast<size_t>(block) * cache_blocks_ * cache_block_size_ * shape_.head_dim;
  v.block_size = cache_block_size_;
  v.token_floats = shape_.head_dim;
  v.block_stride = cache_block_size_ * shape_.head_dim;
  return v;
}

void CudaDsparkDrafter::Angles(int position, std::vector<float>* cos, std::vector<float>* sin) const {
  for (double f : shape_.inv_freq) {
    const double a = static_cast<double>(position) * f;
    cos->push_back(static_cast<float>(std::cos(a)));
    sin->push_back(static_cast<float>(std::sin(a)));
  }
}

absl::StatusOr<CudaDsparkDrafter::Layout> CudaDsparkDrafter::Upload(std::span<const DsparkRowWrite> writes,
                                                                    std::span<const DsparkDraftCall> calls,
                                                                    int* key_rows) {
  const int B = shape_.block_size, bs = cache_block_size_;
  host_.clear();
  Layout at;
  // Every block table first (offsets into the whole array are the tables' offsets).
  auto put_table = [&](const std::vector<int32_t>* table, int last_position, const char* what) -> absl::StatusOr<int> {
    if (table == nullptr) return absl::InvalidArgumentError(absl::StrCat("DSPARK ", what, ": no block table"));
    if (last_position >= 0 && static_cast<size_t>(last_position / bs) >= table->size())
      return absl::InvalidArgumentError(absl::StrCat("DSPARK ", what, ": a block table of ", table->size(),
                                                     " blocks for position ", last_position));
    for (int32_t b : *table)
      if (b < 0 || b >= cache_blocks_ - 1)
        return absl::InvalidArgumentError(absl::StrCat("DSPARK ", what, ": cache block ", b, " of ",
                                                       cache_blocks_ - 1));
    const int offset = static_cast<int>(host_.size());
    host_.insert(host_.end(), table->begin(), table->end());
    return offset;
  };
  std::vector<int> write_table, call_table, hist;
  for (const DsparkRowWrite& w : writes) {
    if (w.taps == nullptr || w.num_positions < 0 || w.start_position < 0)
      return absl::InvalidArgumentError(absl::StrCat("DSPARK rows: ", w.num_positions, " positions from ",
                                                     w.start_position));
    EXL3_ASSIGN_OR_RETURN(const int t, put_table(w.block_table, w.start_position + w.num_positions - 1, "rows"));
    write_table.push_back(t);
  }
  *key_rows = B;
  for (const DsparkDraftCall& c : calls) {
    if (c.seed < 0 || c.seed >= shape_.vocab) return absl::InvalidArgumentError(absl::StrCat("DSPARK seed token ", c.seed));
    if (c.p0 < 0) return absl::InvalidArgumentError(absl::StrCat("DSPARK draft at ", c.p0));
    EXL3_ASSIGN_OR_RETURN(const int t, put_table(c.block_table, c.p0 - 1, "draft"));
    call_table.push_back(t);
    hist.push_back(std::min(shape_.window, c.p0));
    *key_rows = std::max(*key_rows, hist.back() + B);
  }
  auto ints = [&](const std::vector<int32_t>& v) {
    const size_t offset = host_.size();
    host_.insert(host_.end(), v.begin(), v.end());
    return offset;
  };
  auto floats = [&](const std::vector<float>& v) {
    const size_t offset = host_.size();
    PushFloats(v, &host_);
    return offset;
  };
  // The written positions, their tables, their angles.
  std::vector<int32_t> position, first, table;
  std::vector<float> cos, sin;
  for (size_t k = 0; k < writes.size(); ++k)
    for (int j = 0; j < writes[k].num_positions; ++j) {
      position.push_back(writes[k].start_position + j);
      table.push_back(write_table[k]);
      Angles(position.back(), &cos, &sin);
    }
  first.assign(position.size(), 0);
  at.write_position = ints(position);
  at.write_first = ints(first);
  at.write_table = ints(table);
  at.write_cos = floats(cos);
  at.write_sin = floats(sin);
  // The blocks: ids, angles at p0 + j; each call's table, p0 and history; the keys' one-block view
  // (query row s * B + j sees key rows 0 .. hist + B - 1 of run s); the Markov loop's tokens.
  const int S = static_cast<int>(calls.size());
  std::vector<int32_t> ids, p0s, key_position, key_first, key_table, key_tables, tokens(static_cast<size_t>(S) * (B + 1), 0);
  cos.clear();
  sin.clear();
  for (int s = 0; s < S; ++s) {
    for (int j = 0; j < B; ++j) {
      ids.push_back(j == 0 ? calls[s].seed : shape_.noise_token);
      Angles(calls[s].p0 + j, &cos, &sin);
      key_position.push_back(hist[s] + B - 1);
      key_first.push_back(0);
      key_table.push_back(s);
    }
    p0s.push_back(calls[s].p0);
    key_tables.push_back(s);
    tokens[static_cast<size_t>(s) * (B + 1)] = calls[s].seed;
  }
  at.ids = ints(ids);
  at.block_cos = floats(cos);
  at.block_sin = floats(sin);
  at.call_table = ints(call_table);
  at.call_p0 = ints(p0s);
  at.call_hist = ints(hist);
  at.key_position = ints(key_position);
  at.key_first = ints(key_first);
  at.key_table = ints(key_table);
  at.key_tables = ints(key_tables);
  at.tokens = ints(tokens);
  EXL3_RETURN_IF_ERROR(Grow(facts_, std::max<size_t>(host_.size(), 1)));
  // On the model's stream, before the Run's launches (a pageable source is staged before the call returns).
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(facts_.get(), host_.data(), host_.size() * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, static_cast<cudaStream_t>(parts_.linear.stream)));
  return at;
}

absl::Status CudaDsparkDrafter::Reserve(int written, int S, int key_rows) {
  const size_t w = static_cast<size_t>(written), s = static_cast<size_t>(S), m = s * shape_.block_size;
  const size_t H = shape_.hidden, N = shape_.streams, D = shape_.head_dim;
  const std::pair<DeviceArray<float>*, size_t> needs[] = {
      {&taps_, w * shape_.tap_width},
      {&main_x_, w * H},
      {&kv_, std::max(w, m) * D},
      {&x_, m * H},
      {&d_, m * H},
      {&a_, m * H},
      {&streams_buf_, m * N * H},
      {&post_, m * N},
      {&comb_, m * N * N},
      {&q_resid_, m * shape_.q_lora_rank},
      {&q_, m * shape_.heads * D},
      {&keys_, s * key_rows * D},
      {&attn_, m * shape_.heads * D},
      {&low_rank_, m * shape_.o_groups * shape_.o_lora_rank},
      {&pre_, m * H},
      {&hn_, m * H},
      {&logits_, m * shape_.vocab},
      {&confidence_, m},
      {&partial_max_, s * DsparkMarkovPartials(shape_.vocab)}};
  for (const auto& [array, n] : needs) EXL3_RETURN_IF_ERROR(Grow(*array, n));
  EXL3_RETURN_IF_ERROR(Grow(drafts_, m));
  EXL3_RETURN_IF_ERROR(Grow(partial_arg_, s * DsparkMarkovPartials(shape_.vocab)));
  if (S > 0) {
    EXL3_RETURN_IF_ERROR(
        Grow(collapse_scratch_, HyperCollapseScratchDoubles(blocks_.front().hc_attn.args, static_cast<int>(m))));
    for (Block& b : blocks_) EXL3_RETURN_IF_ERROR(b.moe->Reserve(static_cast<int>(m)));
  }
  return absl::OkStatus();
}

absl::Status CudaDsparkDrafter::KvRows(const Block& b, const float* h, int n, const float* cos, const float* sin,
                                       float* rows) const {
  const StreamHandle stream = parts_.linear.stream;
  EXL3_RETURN_IF_ERROR(b.wkv.Forward(h, n, rows, parts_.linear));
  EXL3_RETURN_IF_ERROR(RmsNorm(rows, b.kv_norm.get(), n, shape_.head_dim, shape_.eps, rows, stream));
  return Dsv4RotateTail(rows, n, 1, shape_.head_dim, shape_.rope_dim, cos, sin, 1.0f, /*normalize=*/false, shape_.eps, stream);
}

absl::Status CudaDsparkDrafter::Attend(int block, const Layout& at, int S, int key_rows) {
  const Block& b = blocks_[block];
  const int M = S * shape_.block_size, NH = shape_.heads, D = shape_.head_dim, RD = shape_.rope_dim;
  const StreamHandle stream = parts_.linear.stream;
  const CudaLinearContext& ctx = parts_.linear;
  const int32_t* f = facts_.get();
  const float* cos = reinterpret_cast<const float*>(f + at.block_cos);
  const float* sin = reinterpret_cast<const float*>(f + at.block_sin);
  // Queries [M, NH, D]: wq_b · q_norm(wq_a · h), each head RMS-normalised, rotated at p0 + j.
  EXL3_RETURN_IF_ERROR(b.wq_a.Forward(x_.get(), M, q_resid_.get(), ctx));
  EXL3_RETURN_IF_ERROR(RmsNorm(q_resid_.get(), b.q_norm.get(), M, shape_.q_lora_rank, shape_.eps, q_resid_.get(), stream));
  EXL3_RETURN_IF_ERROR(b.wq_b.Forward(q_resid_.get(), M, q_.get(), ctx));
  EXL3_RETURN_IF_ERROR(Dsv4RotateTail(q_.get(), M, NH, D, RD, cos, sin, 1.0f, /*normalize=*/true, shape_.eps, stream));
  // Keys = values: each draft's history rows, then its block's own (never stored).
  EXL3_RETURN_IF_ERROR(KvRows(b, x_.get(), M, cos, sin, kv_.get()));
  DsparkDraftFacts facts;
  facts.table_offset = f + at.call_table;
  facts.p0 = f + at.call_p0;
  facts.hist = f + at.call_hist;
  facts.tables = f;
  EXL3_RETURN_IF_ERROR(DsparkGatherKeys(RowsView(block), facts, kv_.get(), S, shape_.block_size, key_rows, keys_.get(), stream));
  // Each draft's run is a cache of one block whose every query sees all of it (non-causal), with the sink.
  Dsv4CacheView keys;
  keys.layer = keys_.get();
  keys.block_size = key_rows;
  keys.token_floats = D;
  keys.block_stride = key_rows * D;
  const AttentionTokens tokens{f + at.key_position, f + at.key_first, f + at.key_table, f + at.key_tables, key_rows};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  EXL3_RETURN_IF_ERROR(Dsv4Attend(q_.get(), b.sinks.get(), keys, tokens, Dsv4Entries{}, M, NH, D, RD, scale, cos, sin,
                                  attn_.get(), stream));
  // The grouped output projection as the trunk's (engine/cuda/dsv4_attention.cc): one batched
  // product over the groups (cuBLAS is column-major: C^T = op(A) · B^T in place), then wo_b.
  const int G = shape_.o_groups, R = shape_.o_lora_rank, in_per_group = NH * D / G;
  const float one = 1.0f, zero = 0.0f;
  EXL3_RETURN_IF_ERROR(CublasStatus(
      cublasSgemmStridedBatched(static_cast<cublasHandle_t>(ctx.cublas), CUBLAS_OP_T, CUBLAS_OP_N, R, M, in_per_group,
                                &one, b.wo_a.get(), in_per_group, static_cast<long long>(R) * in_per_group,
                                attn_.get(), NH * D, in_per_group, &zero, low_rank_.get(), G * R, R, G),
      "DSPARK attention: the grouped wo_a"));
  return b.wo_b.Forward(low_rank_.get(), M, a_.get(), ctx);
}

absl::StatusOr<std::vector<DsparkDraft>> CudaDsparkDrafter::Run(std::span<const DsparkRowWrite> writes,
                                                                std::span<const DsparkDraftCall> calls,
                                                                bool want_logits) {
  if (rows_.empty()) return absl::FailedPreconditionError("DSPARK drafter: no row cache (AllocateCache)");
  const int B = shape_.block_size, H = shape_.hidden, N = shape_.streams, V = shape_.vocab, TW = shape_.tap_width;
  const int S = static_cast<int>(calls.size()), M = S * B;
  int written = 0;
  for (const DsparkRowWrite& w : writes) written += w.num_positions;
  int key_rows = B;
  EXL3_ASSIGN_OR_RETURN(const Layout at, Upload(writes, calls, &key_rows));
  EXL3_RETURN_IF_ERROR(Reserve(written, S, key_rows));
  const CudaLinearContext& ctx = parts_.linear;
  const StreamHandle stream = ctx.stream;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* f = facts_.get();

  // 1. The written positions' main-kv rows, from their taps.
  if (written > 0) {
    size_t row = 0;
    for (const DsparkRowWrite& w : writes) {
      EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(taps_.get() + row * TW, w.taps,
                                                static_cast<size_t>(w.num_positions) * TW * sizeof(float),
                                                cudaMemcpyDeviceToDevice, s));
      row += static_cast<size_t>(w.num_positions);
    }
    EXL3_RETURN_IF_ERROR(main_proj_.Forward(taps_.get(), written, main_x_.get(), ctx));
    EXL3_RETURN_IF_ERROR(RmsNorm(main_x_.get(), main_norm_.get(), written, H, shape_.eps, main_x_.get(), stream));
    const AttentionTokens where{f + at.write_position, f + at.write_first, f + at.write_table, f, cache_block_size_};
    const float* cos = reinterpret_cast<const float*>(f + at.write_cos);
    const float* sin = reinterpret_cast<const float*>(f + at.write_sin);
    for (int i = 0; i < num_blocks(); ++i) {
      EXL3_RETURN_IF_ERROR(KvRows(blocks_[i], main_x_.get(), written, cos, sin, kv_.get()));
      EXL3_RETURN_IF_ERROR(Dsv4WriteSlots(kv_.get(), written, where, RowsView(i), stream));
    }
  }
  if (S == 0) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return std::vector<DsparkDraft>{};
  }

  // 2. Every call's block [seed, noise, ...] in hc_mult streams, through the blocks.
  EXL3_RETURN_IF_ERROR(EmbedRows(parts_.embedding, parts_.embedding_dtype, f + at.ids, M, H, x_.get(), stream));
  EXL3_RETURN_IF_ERROR(BroadcastStreams(x_.get(), M, N, H, streams_buf_.get(), stream));
  CudaStep step;  // what the MoE reads of a step: its rows' token ids (hash routing only)
  step.rows = M;
  step.ids = f + at.ids;
  step.sm_count = parts_.sm_count;
  HyperCollapseOutput out;
  out.block_input = d_.get();
  out.post = post_.get();
  out.comb = comb_.get();
  out.norm_eps = shape_.eps;
  out.normed = x_.get();
  HyperExpandInput expand;
  expand.post = post_.get();
  expand.comb = comb_.get();
  expand.block_output = a_.get();
  for (int i = 0; i < num_blocks(); ++i) {
    Block& b = blocks_[i];
    out.norm_weight = b.attn_norm.get();
    EXL3_RETURN_IF_ERROR(HyperCollapse(b.hc_attn.args, nullptr, streams_buf_.get(), M, out, collapse_scratch_.get(),
                                       stream, nullptr));
    EXL3_RETURN_IF_ERROR(Attend(i, at, S, key_rows));
    // The attention's output joins the streams, then the FFN site's collapse.
    out.norm_weight = b.ffn_norm.get();
    EXL3_RETURN_IF_ERROR(HyperCollapse(b.hc_ffn.args, &expand, streams_buf_.get(), M, out, collapse_scratch_.get(),
                                       stream, nullptr));
    EXL3_RETURN_IF_ERROR(b.moe->Forward(step, x_.get(), M, a_.get()));
    EXL3_RETURN_IF_ERROR(HyperExpand(post_.get(), comb_.get(), a_.get(), M, N, H, streams_buf_.get(), stream));
  }
  // hc_head: the pre-norm state; the final norm and the model's head.
  EXL3_RETURN_IF_ERROR(HyperHeadCollapse(head_fn_.get(), head_base_.get(), head_scale_, N, H, shape_.hc_eps, shape_.eps,
                                         streams_buf_.get(), /*rows=*/nullptr, M, pre_.get(), stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(pre_.get(), norm_.get(), M, H, shape_.eps, hn_.get(), stream));
  EXL3_RETURN_IF_ERROR(parts_.head->Forward(hn_.get(), M, logits_.get(), ctx));

  // 3. The Markov loop and the confidence head, one block position after the other.
  int32_t* tokens = facts_.get() + at.tokens;
  for (int j = 0; j < B; ++j)
    EXL3_RETURN_IF_ERROR(DsparkMarkovStep(heads_args_, S, B, j, pre_.get(), logits_.get(), tokens, drafts_.get(),
                                          confidence_.get(), partial_max_.get(), partial_arg_.get(), stream));
  std::vector<int32_t> drafts(static_cast<size_t>(M));
  std::vector<float> confidence(static_cast<size_t>(M)), logits(want_logits ? static_cast<size_t>(M) * V : 0);
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(drafts.data(), drafts_.get(), drafts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(confidence.data(), confidence_.get(), confidence.size() * sizeof(float),
                                            cudaMemcpyDeviceToHost, s));
  if (want_logits)
    EXL3_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(logits.data(), logits_.get(), logits.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  std::vector<DsparkDraft> result(static_cast<size_t>(S));
  for (int c = 0; c < S; ++c) {
    DsparkDraft& r = result[c];
    const size_t first = static_cast<size_t>(c) * B;
    r.drafts.assign(drafts.begin() + first, drafts.begin() + first + B);
    r.confidence.assign(confidence.begin() + first, confidence.begin() + first + B);
    if (want_logits) r.logits.assign(logits.begin() + first * V, logits.begin() + (first + B) * V);
    while (r.length < B && r.confidence[r.length] >= 0.0f) ++r.length;
  }
  return result;
}

absl::StatusOr<std::vector<float>> CudaDsparkDrafter::ReadRows(int block, const std::vector<int32_t>& block_table,
                                                               int first, int n) {
  if (block < 0 || block >= num_blocks() || first < 0 || n < 0 ||
      (n > 0 && static_cast<size_t>((first + n - 1) / cache_block_size_) >= block_table.size()))
    return absl::InvalidArgumentError(absl::StrCat("DSPARK rows of block ", block, ", positions ", first, " + ", n));
  const Dsv4CacheView v = RowsView(block);
  const cudaStream_t s = static_cast<cudaStream_t>(parts_.linear.stream);
  std::vector<float> out(static_cast<size_t>(n) * shape_.head_dim);
  for (int j = 0; j < n; ++j) {
    const int p = first + j;
    const int32_t b = block_table[p / cache_block_size_];
    if (b < 0 || b >= cache_blocks_) return absl::InvalidArgumentError(absl::StrCat("DSPARK rows: cache block ", b));
    const float* src = v.layer + static_cast<size_t>(b) * v.block_stride + static_cast<size_t>(p % v.block_size) * shape_.head_dim;
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&out[static_cast<size_t>(j) * shape_.head_dim], src, shape_.head_dim * sizeof(float),
                                              cudaMemcpyDeviceToHost, s));
  }
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return out;
}

}  // namespace exl3::engine::cuda

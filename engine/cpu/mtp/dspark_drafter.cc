#include "engine/cpu/mtp/dspark_drafter.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/dsv4_config.h"
#include "engine/cpu/attention/dsv4_grouped_wo_a.h"
#include "engine/cpu/rms_norm.h"
#include "kernels/fp16.h"

namespace exl3::engine {
namespace {

absl::StatusOr<std::vector<float>> LoadShaped(const TensorSource& src, const std::string& name,
                                              const std::vector<int64_t>& shape) {
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
  if (t.info->shape != shape) {
    std::string want;
    for (int64_t d : shape) absl::StrAppend(&want, want.empty() ? "" : ", ", d);
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected shape [", want, "]"));
  }
  return ToFloat32(t);
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// RMS norm without weight of each row of `n` values, in place.
void UnweightedRmsNorm(float* x, int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    float* v = x + static_cast<size_t>(r) * n;
    double ss = 0.0;
    for (int i = 0; i < n; ++i) ss += static_cast<double>(v[i]) * v[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
    for (int i = 0; i < n; ++i) v[i] *= inv;
  }
}

}  // namespace

absl::StatusOr<DsparkShape> DsparkShape::Of(const ModelConfig& cfg) {
  if (cfg.dsv4 == nullptr || !cfg.dsv4->dspark.enabled())
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), ": no DSPARK drafter configured (compress_ratios past num_hidden_layers, "
        "dspark_block_size, dspark_target_layer_ids)"));
  const Dsv4Config& v = *cfg.dsv4;
  const Dsv4DsparkConfig& ds = v.dspark;
  DsparkShape s;
  s.hidden = cfg.hidden_size;
  s.heads = cfg.num_heads;
  s.head_dim = v.head_dim;
  s.rope_dim = v.rope_dim;
  s.q_lora_rank = v.q_lora_rank;
  s.o_groups = v.o_groups;
  s.o_lora_rank = v.o_lora_rank;
  s.window = v.sliding_window;
  s.streams = v.hc_mult;
  s.vocab = cfg.vocab_size;
  s.block_size = ds.block_size;
  s.noise_token = ds.noise_token_id;
  s.markov_rank = ds.markov_rank;
  s.tap_width = ds.num_taps() * cfg.hidden_size;
  s.eps = cfg.rms_norm_eps;
  s.hc_eps = v.hc_eps;
  if (s.noise_token < 0 || s.noise_token >= s.vocab)
    return absl::InvalidArgumentError(absl::StrCat("dspark_noise_token_id ", s.noise_token, " outside the vocabulary"));
  for (int j = 0; j < v.rope_dim / 2; ++j)
    s.inv_freq.push_back(1.0 / std::pow(v.main_rope.theta, static_cast<double>(2 * j) / v.rope_dim));
  return s;
}

absl::StatusOr<std::unique_ptr<DsparkDrafter>> DsparkDrafter::Load(const ModelConfig& cfg, const TensorSource& src,
                                                                   TensorView embedding, const Linear& model_head) {
  EXL3_ASSIGN_OR_RETURN(const DsparkShape shape, DsparkShape::Of(cfg));
  const Dsv4Config& v = *cfg.dsv4;
  const Dsv4DsparkConfig& ds = v.dspark;
  std::unique_ptr<DsparkDrafter> d(new DsparkDrafter());
  const int H = cfg.hidden_size, NH = cfg.num_heads, D = v.head_dim;
  d->shape_ = shape;
  d->embedding_ = embedding;
  d->head_ = &model_head;
  EXL3_ASSIGN_OR_RETURN(d->main_proj_, Linear::Load(src, "mtp.0.main_proj", d->shape_.tap_width, H));
  EXL3_ASSIGN_OR_RETURN(d->main_norm_, LoadVector(src, "mtp.0.main_norm.weight", H));
  const HyperConnectionShape hc = {H, v.hc_mult, v.hc_sinkhorn_iters, v.hc_eps, cfg.rms_norm_eps};
  const int G = v.o_groups, R = v.o_lora_rank, in_per_group = NH * D / G;
  for (int i = 0; i < ds.num_blocks; ++i) {
    const std::string p = absl::StrCat("mtp.", i, ".");
    Block b;
    EXL3_ASSIGN_OR_RETURN(b.attn_norm, LoadVector(src, p + "attn_norm.weight", H));
    EXL3_ASSIGN_OR_RETURN(b.ffn_norm, LoadVector(src, p + "ffn_norm.weight", H));
    EXL3_ASSIGN_OR_RETURN(b.wq_a, Linear::Load(src, p + "attn.wq_a", H, v.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(b.q_norm, LoadVector(src, p + "attn.q_norm.weight", v.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(b.wq_b, Linear::Load(src, p + "attn.wq_b", v.q_lora_rank, NH * D));
    EXL3_ASSIGN_OR_RETURN(b.wkv, Linear::Load(src, p + "attn.wkv", H, D));
    EXL3_ASSIGN_OR_RETURN(b.kv_norm, LoadVector(src, p + "attn.kv_norm.weight", D));
    EXL3_ASSIGN_OR_RETURN(b.sinks, LoadVector(src, p + "attn.attn_sink", NH));
    EXL3_ASSIGN_OR_RETURN(b.wo_b, Linear::Load(src, p + "attn.wo_b", G * R, H));
    EXL3_ASSIGN_OR_RETURN(const std::vector<float> w, LoadGroupedWoA(src, p + "attn.wo_a", G, R, in_per_group));
    for (int g = 0; g < G; ++g) {
      std::vector<float> rows(w.begin() + static_cast<size_t>(g) * R * in_per_group,
                              w.begin() + static_cast<size_t>(g + 1) * R * in_per_group);
      b.wo_a.push_back(Linear::FromDense(std::move(rows), in_per_group, R));
    }
    EXL3_ASSIGN_OR_RETURN(HyperConnection ha, HyperConnection::Load(src, p + "hc_attn_", hc));
    EXL3_ASSIGN_OR_RETURN(HyperConnection hf, HyperConnection::Load(src, p + "hc_ffn_", hc));
    b.hc_attn.emplace(std::move(ha));
    b.hc_ffn.emplace(std::move(hf));
    EXL3_ASSIGN_OR_RETURN(MtpMoe moe, MtpMoe::Load(cfg, src, cfg.num_layers + i, p));
    b.moe.emplace(std::move(moe));
    d->blocks_.push_back(std::move(b));
  }
  const std::string l = absl::StrCat("mtp.", ds.num_blocks - 1, ".");
  const int n = v.hc_mult, r = ds.markov_rank, V = cfg.vocab_size;
  EXL3_ASSIGN_OR_RETURN(d->head_fn_, LoadShaped(src, l + "hc_head_fn", {n, static_cast<int64_t>(n) * H}));
  EXL3_ASSIGN_OR_RETURN(d->head_base_, LoadVector(src, l + "hc_head_base", n));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> scale, LoadVector(src, l + "hc_head_scale", 1));
  d->head_scale_ = scale[0];
  EXL3_ASSIGN_OR_RETURN(d->norm_, LoadVector(src, l + "norm.weight", H));
  EXL3_ASSIGN_OR_RETURN(d->markov_w1_, LoadShaped(src, l + "markov_head.markov_w1.weight", {V, r}));
  EXL3_ASSIGN_OR_RETURN(d->markov_w2_, LoadShaped(src, l + "markov_head.markov_w2.weight", {V, r}));
  if (src.Has(l + "markov_head.markov_w2.bias")) {
    EXL3_ASSIGN_OR_RETURN(d->markov_b2_, LoadVector(src, l + "markov_head.markov_w2.bias", V));
  }
  EXL3_ASSIGN_OR_RETURN(d->conf_w_, LoadShaped(src, l + "confidence_head.proj.weight", {1, H + r}));
  if (src.Has(l + "confidence_head.proj.bias")) {
    EXL3_ASSIGN_OR_RETURN(std::vector<float> cb, LoadVector(src, l + "confidence_head.proj.bias", 1));
    d->conf_b_ = cb[0];
  }
  return d;
}

void DsparkDrafter::Rope(float* x, int n, int heads, int first, double sign) const {
  const int D = shape_.head_dim, rd = shape_.rope_dim, off = D - rd;
  for (int t = 0; t < n; ++t) {
    const double pos = static_cast<double>(first + t);
    for (int j = 0; j < rd / 2; ++j) {
      const double a = sign * pos * shape_.inv_freq[j];
      const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
      for (int h = 0; h < heads; ++h) {
        float* v = x + (static_cast<size_t>(t) * heads + h) * D + off + 2 * j;
        const float e = v[0], o = v[1];
        v[0] = e * c - o * s;
        v[1] = o * c + e * s;
      }
    }
  }
}

absl::Status DsparkDrafter::KvRows(const Block& b, const float* h, int n, int first, float* out,
                                   CpuCompute& compute) const {
  EXL3_RETURN_IF_ERROR(b.wkv.Forward(h, n, out, compute));
  RmsNormRows(out, b.kv_norm.data(), n, shape_.head_dim, shape_.eps, out);
  Rope(out, n, 1, first, 1.0);
  return absl::OkStatus();
}

absl::Status DsparkDrafter::MainKvRows(const float* taps, int n, int first_position, const std::vector<float*>& rows,
                                       CpuCompute& compute) const {
  if (static_cast<int>(rows.size()) != num_blocks())
    return absl::InvalidArgumentError(absl::StrCat("DSPARK main-kv rows: ", rows.size(), " outputs for ",
                                                   num_blocks(), " blocks"));
  std::vector<float> x(static_cast<size_t>(n) * shape_.hidden);
  EXL3_RETURN_IF_ERROR(main_proj_.Forward(taps, n, x.data(), compute));
  RmsNormRows(x.data(), main_norm_.data(), n, shape_.hidden, shape_.eps, x.data());
  for (int i = 0; i < num_blocks(); ++i) {
    EXL3_RETURN_IF_ERROR(KvRows(blocks_[i], x.data(), n, first_position, rows[i], compute));
  }
  return absl::OkStatus();
}

absl::Status DsparkDrafter::Attend(const Block& b, const float* h, const float* history, int hist, int p0,
                                   float* out, CpuCompute& compute) const {
  const int B = shape_.block_size, D = shape_.head_dim, NH = shape_.heads;
  // Queries [B, NH, D].
  std::vector<float> qa(static_cast<size_t>(B) * shape_.q_lora_rank), q(static_cast<size_t>(B) * NH * D);
  EXL3_RETURN_IF_ERROR(b.wq_a.Forward(h, B, qa.data(), compute));
  RmsNormRows(qa.data(), b.q_norm.data(), B, shape_.q_lora_rank, shape_.eps, qa.data());
  EXL3_RETURN_IF_ERROR(b.wq_b.Forward(qa.data(), B, q.data(), compute));
  UnweightedRmsNorm(q.data(), B * NH, D, shape_.eps);
  Rope(q.data(), B, NH, p0, 1.0);
  // Keys = values: the history rows, then the block's own.
  const int m = hist + B;
  std::vector<float> keys(static_cast<size_t>(m) * D);
  if (hist > 0) std::memcpy(keys.data(), history, static_cast<size_t>(hist) * D * sizeof(float));
  EXL3_RETURN_IF_ERROR(KvRows(b, h, B, p0, keys.data() + static_cast<size_t>(hist) * D, compute));
  // Every query sees every key (non-causal), one softmax with the head's sink.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<float> o(static_cast<size_t>(B) * NH * D, 0.0f);
  std::vector<double> s(m);
  for (int t = 0; t < B; ++t) {
    for (int hd = 0; hd < NH; ++hd) {
      const float* qv = &q[(static_cast<size_t>(t) * NH + hd) * D];
      double mx = b.sinks[hd];
      for (int k = 0; k < m; ++k) {
        double dot = 0.0;
        const float* kv = &keys[static_cast<size_t>(k) * D];
        for (int i = 0; i < D; ++i) dot += static_cast<double>(qv[i]) * kv[i];
        s[k] = dot * scale;
        mx = std::max(mx, s[k]);
      }
      double den = std::exp(b.sinks[hd] - mx);
      for (int k = 0; k < m; ++k) {
        s[k] = std::exp(s[k] - mx);
        den += s[k];
      }
      float* ov = &o[(static_cast<size_t>(t) * NH + hd) * D];
      for (int k = 0; k < m; ++k) {
        const float p = static_cast<float>(s[k] / den);
        const float* kv = &keys[static_cast<size_t>(k) * D];
        for (int i = 0; i < D; ++i) ov[i] += p * kv[i];
      }
    }
  }
  Rope(o.data(), B, NH, p0, -1.0);
  // Grouped output: group g's (NH / G) * D values through wo_a's group g, then wo_b.
  const int G = shape_.o_groups, R = shape_.o_lora_rank, in_per_group = NH * D / G;
  std::vector<float> grouped(static_cast<size_t>(B) * G * R), gin(static_cast<size_t>(B) * in_per_group),
      gout(static_cast<size_t>(B) * R);
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < B; ++t)
      std::memcpy(&gin[static_cast<size_t>(t) * in_per_group], &o[static_cast<size_t>(t) * NH * D + g * in_per_group],
                  in_per_group * sizeof(float));
    EXL3_RETURN_IF_ERROR(b.wo_a[g].Forward(gin.data(), B, gout.data(), compute));
    for (int t = 0; t < B; ++t)
      std::memcpy(&grouped[(static_cast<size_t>(t) * G + g) * R], &gout[static_cast<size_t>(t) * R], R * sizeof(float));
  }
  return b.wo_b.Forward(grouped.data(), B, out, compute);
}

absl::StatusOr<DsparkDraft> DsparkDrafter::Draft(const std::vector<const float*>& history, int hist, int seed, int p0,
                                                 CpuCompute& compute) const {
  if (static_cast<int>(history.size()) != num_blocks() || hist < 0 || hist > p0 || hist > shape_.window)
    return absl::InvalidArgumentError(absl::StrCat("DSPARK draft at ", p0, ": ", history.size(), " histories of ",
                                                   hist, " rows (", num_blocks(), " blocks, window ", shape_.window, ")"));
  if (seed < 0 || seed >= shape_.vocab) return absl::InvalidArgumentError(absl::StrCat("DSPARK seed token ", seed));
  const int B = shape_.block_size, H = shape_.hidden, N = shape_.streams, V = shape_.vocab, r = shape_.markov_rank;
  // The block [seed, noise, ...] embedded, every stream alike.
  std::vector<float> x(static_cast<size_t>(B) * N * H);
  for (int t = 0; t < B; ++t) {
    const size_t base = static_cast<size_t>(t == 0 ? seed : shape_.noise_token) * H;
    float* row = &x[static_cast<size_t>(t) * N * H];
    for (int i = 0; i < H; ++i) {
      switch (embedding_.info->dtype) {
        case DType::kF32: row[i] = embedding_.as<float>()[base + i]; break;
        case DType::kF16: row[i] = HalfBitsToFloat(embedding_.as<uint16_t>()[base + i]); break;
        default: row[i] = BFloat16BitsToFloat(embedding_.as<uint16_t>()[base + i]); break;
      }
    }
    for (int k = 1; k < N; ++k) std::copy_n(row, H, row + static_cast<size_t>(k) * H);
  }
  std::vector<float> y(static_cast<size_t>(B) * H), hn(static_cast<size_t>(B) * H), a(static_cast<size_t>(B) * H);
  HyperConnectionMix mix;
  for (int i = 0; i < num_blocks(); ++i) {
    const Block& b = blocks_[i];
    b.hc_attn->Collapse(x.data(), B, y.data(), &mix, compute);
    RmsNormRows(y.data(), b.attn_norm.data(), B, H, shape_.eps, hn.data());
    EXL3_RETURN_IF_ERROR(Attend(b, hn.data(), history[i], hist, p0, a.data(), compute));
    b.hc_attn->Expand(mix, a.data(), B, x.data(), compute);
    b.hc_ffn->Collapse(x.data(), B, y.data(), &mix, compute);
    RmsNormRows(y.data(), b.ffn_norm.data(), B, H, shape_.eps, hn.data());
    EXL3_RETURN_IF_ERROR(b.moe->Forward(hn.data(), B, a.data(), compute));
    b.hc_ffn->Expand(mix, a.data(), B, x.data(), compute);
  }
  // hc_head: the pre-norm state, then the final norm and the trunk's head.
  std::vector<float> pre(static_cast<size_t>(B) * H, 0.0f), flat(static_cast<size_t>(N) * H);
  for (int t = 0; t < B; ++t) {
    const float* s = &x[static_cast<size_t>(t) * N * H];
    std::copy_n(s, N * H, flat.data());
    UnweightedRmsNorm(flat.data(), 1, N * H, shape_.eps);
    float* p = &pre[static_cast<size_t>(t) * H];
    for (int k = 0; k < N; ++k) {
      double mixk = 0.0;
      const float* f = &head_fn_[static_cast<size_t>(k) * N * H];
      for (int i = 0; i < N * H; ++i) mixk += static_cast<double>(f[i]) * flat[i];
      const float w = Sigmoid(static_cast<float>(mixk) * head_scale_ + head_base_[k]) + shape_.hc_eps;
      for (int i = 0; i < H; ++i) p[i] += w * s[static_cast<size_t>(k) * H + i];
    }
  }
  RmsNormRows(pre.data(), norm_.data(), B, H, shape_.eps, hn.data());
  DsparkDraft out;
  out.logits.resize(static_cast<size_t>(B) * V);
  EXL3_RETURN_IF_ERROR(head_->Forward(hn.data(), B, out.logits.data(), compute));
  // The Markov loop (greedy), the confidence head, the length.
  int token = seed;
  bool keep = true;
  for (int j = 0; j < B; ++j) {
    const float* e = &markov_w1_[static_cast<size_t>(token) * r];
    float* lj = &out.logits[static_cast<size_t>(j) * V];
    int best = 0;
    for (int t = 0; t < V; ++t) {
      const float* w2 = &markov_w2_[static_cast<size_t>(t) * r];
      double dot = 0.0;
      for (int k = 0; k < r; ++k) dot += static_cast<double>(w2[k]) * e[k];
      lj[t] += static_cast<float>(dot) + (markov_b2_.empty() ? 0.0f : markov_b2_[t]);
      if (lj[t] > lj[best]) best = t;
    }
    double c = conf_b_;
    const float* p = &pre[static_cast<size_t>(j) * H];
    for (int i = 0; i < H; ++i) c += static_cast<double>(conf_w_[i]) * p[i];
    for (int k = 0; k < r; ++k) c += static_cast<double>(conf_w_[H + k]) * e[k];
    out.confidence.push_back(static_cast<float>(c));
    keep = keep && c >= 0.0;
    if (keep) ++out.length;
    out.drafts.push_back(best);
    token = best;
  }
  return out;
}

}  // namespace exl3::engine

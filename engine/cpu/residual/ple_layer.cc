#include "engine/cpu/residual/ple_layer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rms_norm.h"
#include "kernels/fp16.h"
#include "model/exl3_ngram_rows.h"

namespace exl3::engine {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float Silu(float x) { return x * Sigmoid(x); }

// Each of the streams' hidden-sized groups of x [streams * hidden] normalised with its slice of w.
void GroupedRmsNorm(const float* x, const float* w, int streams, int hidden, float eps, float* y) {
  for (int k = 0; k < streams; ++k)
    RmsNorm(x + static_cast<size_t>(k) * hidden, w + static_cast<size_t>(k) * hidden, hidden, eps,
            y + static_cast<size_t>(k) * hidden);
}

}  // namespace

absl::Status PleLayer::OpenTable(const TensorSource& src, const std::string& prefix) {
  const PleConfig& ple = cfg_.qwen4exp->ple;
  const int64_t D = ple.head_dim();
  // exllamav3 writes its quantized table beside the source's and reads that one when both are
  // there (model/exl3_ngram_rows.h); so does this.
  const std::string table = prefix + "ngram_embedding.";
  table_format_ = src.Has(table + "trellis") || src.Has(table + "shard_0.trellis") ? TableFormat::kExl3Trellis
                                                                                     : TableFormat::kValues;
  const char* suffix = table_format_ == TableFormat::kExl3Trellis ? "trellis" : "weight";
  const std::string whole = table + suffix;
  std::vector<std::string> names;
  if (src.Has(whole)) {
    names.push_back(whole);
  } else if (table_format_ == TableFormat::kExl3Trellis) {
    // As many pieces as exllamav3 cut: the source's piece length, the last one shorter.
    for (int i = 0; src.Has(absl::StrCat(table, "shard_", i, ".trellis")); ++i)
      names.push_back(absl::StrCat(table, "shard_", i, ".trellis"));
  } else {
    for (int i = 0; i < ple.split_parts; ++i) {
      const std::string name = absl::StrCat(table, "shard_", i, ".weight");
      if (!src.Has(name))
        return absl::NotFoundError(absl::StrCat(
            name, " is missing: the n-gram table of PLE layer ", layer_, " is stored whole as ", whole,
            " or in split_ngram_parts (", ple.split_parts, ") pieces, and neither is complete"));
      names.push_back(name);
    }
  }
  int64_t rows = 0;
  for (const std::string& name : names) {
    EXL3_ASSIGN_OR_RETURN(TensorLocation v, src.Locate(name));
    const std::vector<int64_t>& s = v.info->shape;
    if (table_format_ == TableFormat::kExl3Trellis) {
      const int bits = s.size() == 2 ? Exl3NgramBits(static_cast<int>(D), static_cast<int>(s[1])) : 0;
      if (bits == 0 || (v.info->dtype != DType::kI16 && v.info->dtype != DType::kU16))
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": expected int16 [rows, 1 + ", D, " * K / 16] (exllamav3's quantized n-gram rows of ", D,
            " values, K in 1..8)"));
      if (table_bits_ != 0 && bits != table_bits_)
        return absl::InvalidArgumentError(absl::StrCat(name, ": ", bits, " bits per value, the pieces before it ",
                                                       table_bits_));
      table_bits_ = bits;
    } else {
      if (s.size() != 2 || s[1] != D)
        return absl::InvalidArgumentError(absl::StrCat(name, ": expected [rows, ", D, "] (ple_embed_dim / n-gram heads)"));
      if (v.info->dtype != DType::kBF16 && v.info->dtype != DType::kF16 && v.info->dtype != DType::kF32)
        return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", std::string(DTypeName(v.info->dtype)),
                                                       " (bf16, f16 or f32)"));
    }
    const int fd = ::open(v.file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", v.file, ": ", std::strerror(errno)));
    pieces_.push_back({v.file, v.offset, v.info->dtype, fd, rows, s[0]});
    rows += s[0];
    table_bytes_ += static_cast<int64_t>(v.info->size_bytes());
  }
  if (names.empty())
    return absl::NotFoundError(absl::StrCat(whole, " is missing (the n-gram table of PLE layer ", layer_, ")"));
  if (rows != hash_.table_rows())
    return absl::InvalidArgumentError(absl::StrCat(
        names.front(), (names.size() > 1 ? absl::StrCat(" .. ", names.back()) : std::string()), ": the n-gram table holds ",
        rows, " rows; the config's hashing (ngram_vocab_size_base, heads, divisor) needs ", hash_.table_rows(),
        " (a truncated or different table)"));
  int64_t first = 0;
  for (int64_t size : hash_.head_sizes()) {
    head_first_row_.push_back(first);
    first += size;
  }
  if (table_format_ == TableFormat::kExl3Trellis) {
    const std::string bias = table + "head_bias";
    EXL3_ASSIGN_OR_RETURN(TensorView b, src.Get(bias));
    if (b.info->dtype != DType::kF16 || b.info->shape != std::vector<int64_t>{hash_.num_heads(), D})
      return absl::InvalidArgumentError(absl::StrCat(bias, ": expected fp16 [", hash_.num_heads(), ", ", D, "]"));
    head_bias_.assign(b.as<uint16_t>(), b.as<uint16_t>() + b.info->num_elements());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PleLayer>> PleLayer::Load(const ModelConfig& cfg, const TensorSource& src, int layer) {
  const Qwen4ExpConfig& q = *cfg.qwen4exp;
  const PleConfig& ple = q.ple;
  const int ple_index = ple.PleIndex(layer);
  if (ple_index < 0) return absl::InternalError(absl::StrCat("layer ", layer, " has no PLE"));
  std::unique_ptr<PleLayer> p(new PleLayer(cfg, layer, NgramHash::Build(ple, cfg.vocab_size, ple_index)));
  const std::string prefix = LayerPrefix(cfg.moe, layer) + "ple.";
  EXL3_RETURN_IF_ERROR(p->OpenTable(src, prefix + "ple_embedding."));
  EXL3_RETURN_IF_ERROR(p->CheckStoredHashing(src, prefix + "ple_embedding."));
  const int H = cfg.hidden_size, wide = q.hc_count * H, E = ple.embed_dim;
  EXL3_ASSIGN_OR_RETURN(p->key_, Linear::Load(src, prefix + "key_proj", E, wide));
  EXL3_ASSIGN_OR_RETURN(p->value_, Linear::Load(src, prefix + "value_proj", E, H));
  for (auto [name, dst] : {std::pair<const char*, std::vector<float>*>{"norm_key", &p->norm_key_},
                           {"norm_query", &p->norm_query_}, {"norm_conv", &p->norm_conv_}}) {
    EXL3_ASSIGN_OR_RETURN(*dst, LoadNormWeight(src, absl::StrCat(prefix, name, ".weight"), wide,
                                               NormWeightConvention::kOffsetFromOne));
  }
  const std::string conv = prefix + "conv1d.weight";
  EXL3_ASSIGN_OR_RETURN(TensorView cw, src.Get(conv));
  if (cw.info->shape != std::vector<int64_t>{wide, 1, ple.conv_kernel})
    return absl::InvalidArgumentError(absl::StrCat(conv, ": expected shape [", wide, ", 1, ", ple.conv_kernel, "]"));
  EXL3_ASSIGN_OR_RETURN(p->conv_weight_, ToFloat32(cw));
  if (src.Has(prefix + "conv1d.bias"))
    return absl::InvalidArgumentError(absl::StrCat(prefix, "conv1d.bias: Qwen4-Exp's PLE convolution has no bias"));
  p->state_offset_ = cfg.linear_attention.ConvStateFloats() + cfg.linear_attention.RecurrentStateFloats();
  LogInfo("PLE layer %d: n-gram table of %lld rows x %d (%.2f GiB in %zu piece(s)), rows read from the files",
          layer, static_cast<long long>(p->hash_.table_rows()), ple.head_dim(),
          static_cast<double>(p->table_bytes_) / (1024.0 * 1024.0 * 1024.0), p->pieces_.size());
  return p;
}

// transformers saves the hashing constants it derived as buffers; where a checkpoint has them
// they must be what the config gives (else its table was built for other hashing).
absl::Status PleLayer::CheckStoredHashing(const TensorSource& src, const std::string& prefix) const {
  auto check = [&](const std::string& name, const std::vector<int64_t>& want) -> absl::Status {
    if (!src.Has(name)) return absl::OkStatus();
    EXL3_ASSIGN_OR_RETURN(TensorView v, src.Get(name));
    if (v.info->dtype != DType::kI64 || v.info->num_elements() != static_cast<int64_t>(want.size()))
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", want.size(), " int64 values"));
    for (size_t i = 0; i < want.size(); ++i)
      if (v.as<int64_t>()[i] != want[i])
        return absl::InvalidArgumentError(absl::StrCat(
            name, "[", i, "] is ", v.as<int64_t>()[i], "; the config's hashing (seed, vocab_size, PLE layer) gives ",
            want[i]));
    return absl::OkStatus();
  };
  const std::vector<int64_t> multipliers(hash_.multipliers().begin(), hash_.multipliers().end());
  EXL3_RETURN_IF_ERROR(check(prefix + "layer_multipliers", multipliers));
  EXL3_RETURN_IF_ERROR(check(prefix + "ngram_heads_vocab_sizes", hash_.head_sizes()));
  // exllamav3's quantized table carries its own copies (head_offsets: the row each head starts at).
  const std::string table = prefix + "ngram_embedding.";
  EXL3_RETURN_IF_ERROR(check(table + "layer_multipliers", multipliers));
  EXL3_RETURN_IF_ERROR(check(table + "head_vocab_sizes", hash_.head_sizes()));
  return check(table + "head_offsets", head_first_row_);
}

PleLayer::~PleLayer() {
  for (const TablePiece& p : pieces_) ::close(p.fd);
}

absl::Status PleLayer::PreadRow(const TablePiece& piece, int64_t row, size_t bytes, void* dst) const {
  const off_t at = static_cast<off_t>(piece.offset + static_cast<uint64_t>(row - piece.first_row) * bytes);
  const ssize_t got = ::pread(piece.fd, dst, bytes, at);
  if (got != static_cast<ssize_t>(bytes)) {
    return absl::DataLossError(absl::StrCat(
        "n-gram table row ", row, " of PLE layer ", layer_, ": read ", got < 0 ? 0 : got, " of ", bytes,
        " bytes at offset ", at, " of ", piece.file, " (the file changed after the load?)"));
  }
  return absl::OkStatus();
}

absl::Status PleLayer::ReadRow(int64_t row, float* out) const {
  // The piece holding `row`: the last whose first row is <= row.
  auto it = std::upper_bound(pieces_.begin(), pieces_.end(), row,
                             [](int64_t r, const TablePiece& p) { return r < p.first_row; });
  const TablePiece& piece = *(it - 1);
  const int D = cfg_.qwen4exp->ple.head_dim();
  if (table_format_ == TableFormat::kExl3Trellis) return ReadTrellisRow(piece, row, out);
  const size_t width = DTypeSize(piece.dtype);
  const size_t bytes = width * D;
  uint16_t half[1024];  // a row of 16-bit values; ple_embed_dim / heads is far below this
  void* dst = width == sizeof(float) ? static_cast<void*>(out) : static_cast<void*>(half);
  if (width != sizeof(float) && static_cast<size_t>(D) > std::size(half))
    return absl::InvalidArgumentError(absl::StrCat("n-gram rows of ", D, " values are not supported"));
  EXL3_RETURN_IF_ERROR(PreadRow(piece, row, bytes, dst));
  switch (piece.dtype) {
    case DType::kF32:
      break;
    case DType::kF16:
      for (int i = 0; i < D; ++i) out[i] = HalfBitsToFloat(half[i]);
      break;
    default:  // kBF16 (OpenTable refused the rest)
      for (int i = 0; i < D; ++i) out[i] = BFloat16BitsToFloat(half[i]);
      break;
  }
  return absl::OkStatus();
}

absl::Status PleLayer::Embed(const int32_t* windows, int T, float* e) const {
  const PleConfig& ple = cfg_.qwen4exp->ple;
  const int E = ple.embed_dim, D = ple.head_dim(), heads = ple.num_heads(), n = ple.ngram_size;
  std::vector<int64_t> rows(heads);
  for (int t = 0; t < T; ++t) {
    hash_.Rows(windows + static_cast<size_t>(t) * n, rows.data());
    for (int k = 0; k < heads; ++k)
      EXL3_RETURN_IF_ERROR(ReadRow(rows[k], e + static_cast<size_t>(t) * E + static_cast<size_t>(k) * D));
  }
  return absl::OkStatus();
}

absl::Status PleLayer::ReadTrellisRow(const TablePiece& piece, int64_t row, float* out) const {
  const int D = cfg_.qwen4exp->ple.head_dim();
  const int words = Exl3NgramWordsPerRow(D, table_bits_);
  uint16_t ring[1 + 8 * 1024 / 16];  // K <= 8 bits per value
  if (words > static_cast<int>(std::size(ring)))
    return absl::InvalidArgumentError(absl::StrCat("n-gram rows of ", D, " values are not supported"));
  const size_t bytes = static_cast<size_t>(words) * 2;
  EXL3_RETURN_IF_ERROR(PreadRow(piece, row, bytes, ring));
  // The head whose rows hold `row`: the last that starts at or before it (the padding rows
  // after the last head count as its, as exllamav3 counts them).
  const int head = static_cast<int>(
      std::upper_bound(head_first_row_.begin(), head_first_row_.end(), row) - head_first_row_.begin() - 1);
  DecodeExl3NgramRow(ring, D, table_bits_, &head_bias_[static_cast<size_t>(std::max(head, 0)) * D], out);
  return absl::OkStatus();
}

absl::Status PleLayer::Forward(float* h, const StepTokens& tokens, SequenceStateStore& states,
                               CpuCompute& compute) const {
  const Qwen4ExpConfig& q = *cfg_.qwen4exp;
  const PleConfig& ple = q.ple;
  const int T = tokens.num_tokens, H = cfg_.hidden_size, S = q.hc_count, wide = S * H;
  const int E = ple.embed_dim, n = ple.ngram_size;
  const int ctx = ple.context_tokens(), K = ple.conv_kernel, past = ple.conv_state_positions();
  const float eps = cfg_.rms_norm_eps;

  // The n-gram embedding of every token: its window is the chunk's tokens before it, then the
  // sequence's carried context (eos at position 0).
  std::vector<int32_t> windows(static_cast<size_t>(T) * n);
  for (int t = 0; t < T; ++t) {
    const SequenceChunk& chunk = tokens.batch->chunks[tokens.chunk_of[t]];
    const int j = tokens.positions[t] - chunk.start_position;  // index in the chunk
    const float* carried = states.Current(layer_, chunk.state_slot) + state_offset_;
    int32_t* window = &windows[static_cast<size_t>(t) * n];
    for (int i = 0; i < n; ++i) {
      const int back = n - 1 - i;  // tokens before t
      if (j - back >= 0) {
        window[i] = chunk.tokens[j - back];
      } else if (chunk.start_position == 0) {
        window[i] = ple.eos_token_id;  // before the sequence
      } else {
        window[i] = static_cast<int32_t>(carried[ctx + (j - back)]);  // the carried context, oldest first
      }
    }
  }
  std::vector<float> e(static_cast<size_t>(T) * E);
  EXL3_RETURN_IF_ERROR(Embed(windows.data(), T, e.data()));

  std::vector<float> key(static_cast<size_t>(T) * wide), value(static_cast<size_t>(T) * H);
  EXL3_RETURN_IF_ERROR(key_.Forward(e.data(), T, key.data(), compute));
  EXL3_RETURN_IF_ERROR(value_.Forward(e.data(), T, value.data(), compute));
  std::vector<float> v(static_cast<size_t>(T) * wide), normed(v.size()), query(wide);
  const float inv_sqrt_h = 1.0f / std::sqrt(static_cast<float>(H));
  for (int t = 0; t < T; ++t) {
    float* kt = &key[static_cast<size_t>(t) * wide];
    GroupedRmsNorm(kt, norm_key_.data(), S, H, eps, kt);
    GroupedRmsNorm(h + static_cast<size_t>(t) * wide, norm_query_.data(), S, H, eps, query.data());
    float* vt = &v[static_cast<size_t>(t) * wide];
    for (int s = 0; s < S; ++s) {
      double dot = 0.0;
      for (int i = 0; i < H; ++i) dot += static_cast<double>(kt[s * H + i]) * query[s * H + i];
      float g = static_cast<float>(dot) * inv_sqrt_h;
      g = std::copysign(std::sqrt(std::max(std::fabs(g), 1e-6f)), g) * (g == 0.0f ? 0.0f : 1.0f);
      const float gate = Sigmoid(g);
      for (int i = 0; i < H; ++i) vt[s * H + i] = gate * value[static_cast<size_t>(t) * H + i];
    }
    GroupedRmsNorm(vt, norm_conv_.data(), S, H, eps, &normed[static_cast<size_t>(t) * wide]);
  }

  // The dilated causal conv per chunk over [carried past inputs, the chunk's normed values].
  std::vector<int> firsts;  // first token of each chunk run
  for (int t = 0; t < T; ++t)
    if (t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) firsts.push_back(t);
  firsts.push_back(T);
  for (size_t r = 0; r + 1 < firsts.size(); ++r) {
    const int t0 = firsts[r], count = firsts[r + 1] - t0;
    const SequenceChunk& chunk = tokens.batch->chunks[tokens.chunk_of[t0]];
    const bool fresh = chunk.start_position == 0;
    const float* prev = states.Current(layer_, chunk.state_slot) + state_offset_;
    // Window input u: u < past the carried inputs (zero for a fresh sequence), else token u - past.
    auto input = [&](int u, int c) -> float {
      if (u >= past) return normed[static_cast<size_t>(t0 + u - past) * wide + c];
      return fresh ? 0.0f : prev[ctx + static_cast<size_t>(u) * wide + c];
    };
    compute.ParallelFor((wide + 63) / 64, [&](int item) {
      const int c0 = item * 64, c1 = std::min(wide, c0 + 64);
      for (int c = c0; c < c1; ++c) {
        const float* w = &conv_weight_[static_cast<size_t>(c) * K];
        for (int j = 0; j < count; ++j) {
          float acc = 0.0f;
          for (int i = 0; i < K; ++i) acc += w[i] * input(j + i * n, c);
          h[static_cast<size_t>(t0 + j) * wide + c] += v[static_cast<size_t>(t0 + j) * wide + c] + Silu(acc);
        }
      }
    });
    // The state after the chunk's first `folded` tokens: the last ctx tokens of the sequence then,
    // and the last `past` conv inputs; one per state the chunk keeps (the last: after all of it).
    const int kept = states.NumKeptStates(chunk.state_slot);
    std::vector<float> context(ctx), conv_state(static_cast<size_t>(past) * wide);
    for (int k = 0; k < kept; ++k) {
      const int folded = count - kept + 1 + k;
      for (int u = 0; u < past; ++u)
        for (int c = 0; c < wide; ++c) conv_state[static_cast<size_t>(u) * wide + c] = input(folded + u, c);
      for (int i = 0; i < ctx; ++i) {
        const int j = folded - ctx + i;  // index in the chunk
        context[i] = j >= 0 ? static_cast<float>(chunk.tokens[j])
                            : fresh ? static_cast<float>(ple.eos_token_id) : prev[ctx + j];
      }
      float* next = states.KeptState(layer_, chunk.state_slot, k) + state_offset_;
      std::copy(context.begin(), context.end(), next);
      std::copy(conv_state.begin(), conv_state.end(), next + ctx);
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine

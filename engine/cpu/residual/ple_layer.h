// Qwen4-Exp's PLE layer (`layers.N.ple.*`, docs/engine.md "Qwen4-Exp"): hashed n-gram embeddings
// added to every residual stream ahead of a linear-attention layer's hyper-connection. Per token,
// with h [streams, hidden] its residual:
//
//   e = the rows engine/cpu/residual/ngram_hash.h picks from `ple_embedding.ngram_embedding`, concatenated
//   key_k = norm_key(key_proj(e))_k, query_k = norm_query(h)_k   (per-stream zero-centred norms)
//   g_k = Σ key_k ⊙ query_k / √hidden;  g_k ← sign(g_k) · √max(|g_k|, 1e-6)
//   v_k = sigmoid(g_k) · value_proj(e)
//   h_k += v_k + silu(conv_k(norm_conv(v)))   conv: depthwise, causal, ple_conv_kernel_size taps
//                                             dilated by ngram_size, no bias
//
// The n-gram table (billions of rows in the released model) is read from the safetensors files
// with pread, one row per (token, head), never copied nor mapped (a file truncated under the
// server fails the step that reads past its end, naming the file, instead of SIGBUS); checkpoints store it whole
// (`ngram_embedding.weight`) or in split_ngram_parts pieces (`ngram_embedding.shard_{i}.weight`,
// rows in order of i), or as exllamav3 quantizes it (`ngram_embedding.shard_{i}.trellis` with
// `head_bias`, decoded per row: model/exl3_ngram_rows.h). A missing piece or a table of the wrong
// size is refused by name.
//
// Per sequence it carries, after the DeltaNet's state in the layer's slot of
// engine/cpu/sequence_state.h: the last ngram_size - 1 tokens (as floats; eos before position 0),
// then the conv's last (kernel - 1) · ngram_size inputs [positions, streams * hidden].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/config/model_config.h"
#include "engine/cpu/residual/ngram_hash.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

class PleLayer {
 public:
  static absl::StatusOr<std::unique_ptr<PleLayer>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                        int layer);
  // h [T, streams, hidden] += the PLE output. Reads each chunk's state at `state_offset` floats
  // into the layer's slot from states.Current, writes each state it keeps (KeptState; last: Next).
  absl::Status Forward(float* h, const StepTokens& tokens, SequenceStateStore& states, CpuCompute& compute) const;

  ~PleLayer();
  PleLayer(const PleLayer&) = delete;
  PleLayer& operator=(const PleLayer&) = delete;

  // e [T, embed_dim] = the n-gram rows of each token's window, windows [T, ngram_size] (the token
  // last, the tokens before it oldest first; eos before the sequence), read from the table's files.
  absl::Status Embed(const int32_t* windows, int num_tokens, float* e) const;

  int64_t table_rows() const { return hash_.table_rows(); }
  int64_t table_bytes() const { return table_bytes_; }

 private:
  // One piece of the table: rows [first_row, first_row + rows) of the whole.
  // What a row read needs, copied at load: the layer outlives the TensorSource it was loaded from
  // (the GPU engine drops its source once the weights are on the device).
  struct TablePiece {
    std::string file;
    uint64_t offset = 0;  // of the piece's first byte in `file`
    DType dtype = DType::kBF16;
    int fd = -1;  // of `file`, opened by OpenTable, closed by the destructor
    int64_t first_row = 0;
    int64_t rows = 0;
  };
  PleLayer(const ModelConfig& cfg, int layer, NgramHash hash)
      : cfg_(cfg), layer_(layer), hash_(std::move(hash)) {}
  // How the table's rows are stored: their values (bf16, f16 or f32), or exllamav3's trellis rings.
  enum class TableFormat { kValues, kExl3Trellis };

  absl::Status OpenTable(const TensorSource& src, const std::string& prefix);
  // The `bytes` of `row` (rows of that size from the piece's start) into dst; DATA_LOSS naming the
  // file on a short read.
  absl::Status PreadRow(const TablePiece& piece, int64_t row, size_t bytes, void* dst) const;
  absl::Status ReadTrellisRow(const TablePiece& piece, int64_t row, float* out) const;
  absl::Status CheckStoredHashing(const TensorSource& src, const std::string& prefix) const;
  // Row `row` of the table as fp32 into out[head_dim]; DATA_LOSS on a short read.
  absl::Status ReadRow(int64_t row, float* out) const;

  const ModelConfig& cfg_;
  int layer_;
  NgramHash hash_;
  std::vector<TablePiece> pieces_;
  int64_t table_bytes_ = 0;
  TableFormat table_format_ = TableFormat::kValues;
  int table_bits_ = 0;                   // kExl3Trellis: K
  std::vector<uint16_t> head_bias_;      // kExl3Trellis: fp16 [heads, head_dim]
  std::vector<int64_t> head_first_row_;  // the first row of each n-gram head
  int64_t state_offset_ = 0;  // floats of the DeltaNet state before the PLE state
  Linear key_, value_;
  std::vector<float> norm_key_, norm_query_, norm_conv_;  // 1 + w [streams * hidden]
  std::vector<float> conv_weight_;                        // [streams * hidden, kernel]
};

}  // namespace exl3::engine

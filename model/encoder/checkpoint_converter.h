// Converts a Hugging Face MoE checkpoint (safetensors, bf16/fp16/fp32) into an EXL3 model
// directory: every routed expert's gate/up/down projection (and the shared experts') becomes an
// EXL3 layer (model/encoder/layer_quantizer.h: plain, data-free trellis quantization, no
// Hessian/LDLQ calibration). As exllamav3 does, by default the other linear layers are quantized
// too: the attention projections (every 2-D `self_attn.*.weight` / `linear_attn.*.weight` of the
// decoder layers) and the dense layers' `mlp.{gate,up,down}_proj` at `bits`, the head
// (model/moe_config.h HeadWeightKey: `lm_head.weight`, DeepSeek-V4 `head.weight`) at
// `head_bits` (DeepSeek-V4 names its attention `attn.*`: projections, compressors and indexer
// quantized alike); a linear whose dimensions are not both multiples of 128
// (or whose dtype is not BF16/F16/F32) stays as stored and is listed in
// ConvertStats::kept_linears. Biases, embeddings, norms, routers, the indexers' head weights
// (`self_attn.indexer.weights_proj`, DeepSeek-V4's `attn.indexer.weights_proj`: router-like
// projections exllamav3 keeps unquantized), DSA's indexer `wk`, MLA's `kv_b_proj` (exllamav3 reads
// only its weight) and GLM-5.3's KDA gates are copied unchanged. Where exllamav3 stores a layer in
// another layout, the output takes it: GLM-5.3's KDA q/k/v_proj quantized as one `qkv_proj` with
// its convs as one `conv1d`, DeepSeek-V4's `wo_a` as per-group layers `wo_a.slice.G`. A tied head
// (tie_word_embeddings, no lm_head tensor) stays the embedding. config.json gains
// "quantization_config" (what was quantized, with which K); other files (tokenizer, generation
// config, ...) are copied.
//
// Output shards mirror the input shards (same file names) and are listed in
// model.safetensors.index.json. Each shard is written atomically and records the conversion
// options in its metadata, so an interrupted conversion restarted with the same options skips
// the shards already complete.
//
// The architecture comes from config.json through model/moe_config.h (GLM-4.x/5 MoE,
// DeepSeek-V3, Qwen3-MoE, Qwen3-Next, Mixtral, ...: its key naming); anything else, a missing
// or mis-shaped expert tensor, an unreadable shard or a non-finite weight is a clear error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codebook.h"

namespace exl3 {

struct ConvertOptions {
  int bits = 4;                // K of every quantized tensor, unless overridden below
  int expert_bits = 0;         // routed experts' K (0: bits)
  int down_bits = 0;           // down projections' K, routed and shared (0: no override)
  Codebook codebook = Codebook::k3Inst;
  uint64_t seed = 0;           // sign vectors; per tensor via TensorSeed(seed, name)
  int threads = 0;             // 0: all cores
  bool quantize_shared = true; // shared experts quantized (else copied)
  bool quantize_attention = true;  // attention projections at `bits` (else copied)
  bool quantize_dense_mlp = true;  // dense layers' MLP at `bits`, down at `down_bits` (else copied)
  int head_bits = 6;               // lm_head's K; 0: copied
  // DeepSeek-V4's DSPARK drafter (mtp.*, docs/dspark.md): its linears EXL3 as exllamav3's
  // converter quantizes them (qbits_key "mtp_bits") at mtp_bits (0: bits), else copied.
  bool quantize_mtp = true;
  int mtp_bits = 0;
  bool scale_search = true;    // per-tensor global scale search (see layer_quantizer.h)
  bool progress = true;        // progress bar on stderr
};

struct ConvertStats {
  int shards_total = 0;
  int shards_skipped = 0;       // already complete from an earlier run
  int tensors_quantized = 0;    // in the shards written by this run
  int tensors_copied = 0;
  double mean_relative_mse = 0; // over tensors quantized by this run (W_inner domain)
  uint64_t output_bytes = 0;    // all shards' data
  // Linears that were asked for but stay as stored: "NAME [out, in] dtype: why" (EXL3 needs both
  // dimensions to be multiples of 128), and a note for a tied head.
  std::vector<std::string> kept_linears;
};

// Reads `input_dir`, writes `output_dir` (created; must differ from input_dir).
absl::StatusOr<ConvertStats> ConvertCheckpoint(const std::string& input_dir,
                                               const std::string& output_dir,
                                               const ConvertOptions& options);

// The bit width a tensor gets under `options` (routed: a routed expert's projection).
int BitsFor(const ConvertOptions& options, bool routed, bool down);

}  // namespace exl3

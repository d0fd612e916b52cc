// exl3-tool quantize: a Hugging Face MoE checkpoint -> an EXL3 model directory.
#include <cstdio>
#include <string>

#include "absl/strings/str_join.h"
#include "kernels/codebook.h"
#include "model/config/architecture.h"
#include "model/encoder/checkpoint_converter.h"
#include "model/moe_config.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool quantize --input HF_DIR --output DIR --bits K [--codebook 3inst|mcg|mul1]\n"
    "                          [--expert-bits K] [--down-bits K] [--head-bits K] [--seed S]\n"
    "                          [--threads N] [--no-quantize-attention] [--no-quantize-dense-mlp]\n"
    "                          [--no-quantize-head] [--mtp-bits K] [--no-quantize-mtp] [--no-shared]\n"
    "                          [--no-scale-search] [--quiet]\n"
    "\n"
    "Converts a Hugging Face MoE checkpoint (safetensors shards, BF16/F16/F32) into an EXL3\n"
    "model directory. Like exllamav3, it quantizes every linear layer: the routed experts'\n"
    "gate/up/down projections, the shared experts', the attention projections (2-D\n"
    "self_attn.* / linear_attn.* weights) and the dense layers' MLP at --bits, lm_head at\n"
    "--head-bits (default 6; DeepSeek-V4: head.weight, its attention attn.*). They become\n"
    "EXL3 layers (.trellis/.suh/.svh/.mcg|.mul1). A linear\n"
    "whose dimensions are not both multiples of 128 stays as stored (one log line each, and\n"
    "quantization_config.unquantized_linears); biases, embeddings, norms, routers,\n"
    "correction biases, MLA's kv_b_proj, DSA's indexer wk and weights_proj and GLM-5.3's KDA\n"
    "gates are copied unchanged (exllamav3 reads them unquantized); a tied head\n"
    "(tie_word_embeddings, no lm_head) stays the embedding. Layouts are exllamav3's: GLM-5.3's\n"
    "KDA q/k/v_proj become one layer qkv_proj and its convs one conv1d, DeepSeek-V4's wo_a one\n"
    "layer per output group (wo_a.slice.G). DeepSeek-V4's DSPARK drafter (mtp.*, docs/dspark.md):\n"
    "the linears exllamav3 quantizes (main_proj, attention, routed and shared experts) at\n"
    "--mtp-bits, the rest as stored; other families' MTP tensors are copied. config.json gains quantization_config {quant_method: exl3, version, bits,\n"
    "codebook, expert_bits, quantized_modules, attention_bits, dense_mlp_bits, head_bits, ...};\n"
    "other files are copied. Output shards mirror the input shards and are indexed in\n"
    "model.safetensors.index.json.\n"
    "\n"
    "This is plain, data-free trellis quantization (random signs and channel scales, Hadamard\n"
    "rotation, global scale search, Viterbi encoding); there is no Hessian-aware (LDLQ)\n"
    "calibration, so quality at low K is below exllamav3's calibrated conversions.\n"
    "\n"
    "Restartable: every shard is written atomically and records the options; running the same\n"
    "command again skips the shards already complete. Architectures: those of\n"
    "model/config/architecture.cc, listed at the end; any other is refused.\n"
    "\n"
    "  --input        the Hugging Face checkpoint directory\n"
    "  --output       the EXL3 model directory to write (created)\n"
    "  --bits         K (1..8) of every quantized tensor unless overridden\n"
    "  --expert-bits  K of the routed experts (default: --bits); shared experts keep --bits\n"
    "  --down-bits    K of all down projections, routed, shared and dense (default: no override)\n"
    "  --head-bits    K of lm_head (default 6; 0: copy it unquantized)\n"
    "  --codebook     3inst (default), mcg or mul1\n"
    "  --seed         seed of the random sign vectors (default 0)\n"
    "  --threads      encoder threads (default: all cores)\n"
    "  --quantize-attention / --no-quantize-attention  quantize (default) or copy the\n"
    "                 attention projections\n"
    "  --quantize-dense-mlp / --no-quantize-dense-mlp  quantize (default) or copy the dense\n"
    "                 (non-MoE) layers' MLPs\n"
    "  --no-quantize-head       copy lm_head unquantized (same as --head-bits 0)\n"
    "  --mtp-bits     K of DeepSeek-V4's mtp.* linears (default: --bits)\n"
    "  --no-quantize-mtp        copy DeepSeek-V4's mtp.* unquantized\n"
    "                 (all three: the experts-only conversion of earlier versions)\n"
    "  --no-shared    copy shared experts unquantized\n"
    "  --no-scale-search  use the default global scale (faster, slightly worse)\n"
    "  --quiet        no progress bar\n";

int Run(int argc, char** argv) {
  const char* kName = "quantize";
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv,
                  {"input", "output", "bits", "codebook", "expert-bits", "down-bits", "head-bits",
                   "seed", "threads", "mtp-bits"},
                  {"no-shared", "no-scale-search", "quiet", "quantize-attention",
                   "no-quantize-attention", "quantize-dense-mlp", "no-quantize-dense-mlp",
                   "no-quantize-head", "no-quantize-mtp"},
                  &err)) {
    return Fail(kName, err);
  }
  if (args.help) {
    std::printf("%s\narchitectures: %s\n", kUsage, absl::StrJoin(SupportedArchitectures(), ", ").c_str());
    return 0;
  }
  if (!args.Require({"input", "output", "bits"}, &err)) return Fail(kName, err);
  ConvertOptions o;
  if (!args.GetInt("bits", &o.bits, &err)) return Fail(kName, err);
  if (args.Has("expert-bits") && !args.GetInt("expert-bits", &o.expert_bits, &err)) return Fail(kName, err);
  if (args.Has("down-bits") && !args.GetInt("down-bits", &o.down_bits, &err)) return Fail(kName, err);
  if (args.Has("head-bits") && !args.GetInt("head-bits", &o.head_bits, &err)) return Fail(kName, err);
  if (args.Has("mtp-bits") && !args.GetInt("mtp-bits", &o.mtp_bits, &err)) return Fail(kName, err);
  if (args.Bool("no-quantize-mtp") && args.Has("mtp-bits"))
    return Fail(kName, "--no-quantize-mtp contradicts --mtp-bits " + args.Get("mtp-bits"));
  o.quantize_mtp = !args.Bool("no-quantize-mtp");
  if (args.Bool("no-quantize-head")) {
    if (args.Has("head-bits") && o.head_bits != 0) {
      return Fail(kName, "--no-quantize-head contradicts --head-bits " + args.Get("head-bits"));
    }
    o.head_bits = 0;
  }
  for (int k : {o.bits, o.expert_bits, o.down_bits, o.head_bits, o.mtp_bits}) {
    if (k != 0 && (k < 1 || k > 8)) return Fail(kName, "bit widths must be in 1..8");
  }
  if (o.bits < 1) return Fail(kName, "--bits must be in 1..8");
  if (!ParseCodebook(args.Get("codebook", "3inst"), &o.codebook)) {
    return Fail(kName, "--codebook must be 3inst, mcg or mul1, got '" + args.Get("codebook") + "'");
  }
  if (args.Has("seed") && !absl::SimpleAtoi(args.Get("seed"), &o.seed)) {
    return Fail(kName, "--seed must be a non-negative integer");
  }
  if (args.Has("threads") && (!args.GetInt("threads", &o.threads, &err) || o.threads < 0)) {
    return Fail(kName, err.empty() ? "--threads must be >= 0" : err);
  }
  o.quantize_shared = !args.Bool("no-shared");
  for (const char* m : {"attention", "dense-mlp"}) {
    if (args.Bool(std::string("quantize-") + m) && args.Bool(std::string("no-quantize-") + m)) {
      return Fail(kName, std::string("--quantize-") + m + " contradicts --no-quantize-" + m);
    }
  }
  o.quantize_attention = !args.Bool("no-quantize-attention");
  o.quantize_dense_mlp = !args.Bool("no-quantize-dense-mlp");
  o.scale_search = !args.Bool("no-scale-search");
  o.progress = !args.Bool("quiet");
  absl::StatusOr<ConvertStats> st = ConvertCheckpoint(args.Get("input"), args.Get("output"), o);
  if (!st.ok()) return Fail(kName, std::string(st.status().message()));
  for (const std::string& k : st->kept_linears) std::fprintf(stderr, "exl3-tool quantize: %s\n", k.c_str());
  std::fprintf(stderr,
               "exl3-tool quantize: %s: %d shards (%d already complete), %d tensors quantized "
               "(mean relative error %.3e), %d copied, %.1f MB\n",
               args.Get("output").c_str(), st->shards_total, st->shards_skipped,
               st->tensors_quantized, st->mean_relative_mse, st->tensors_copied,
               st->output_bytes / 1e6);
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kQuantizeRegistered, "quantize",
                     "convert a Hugging Face MoE checkpoint to EXL3 (data-free)", exl3::tool::Run);

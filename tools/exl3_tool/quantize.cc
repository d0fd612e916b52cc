// exl3-tool quantize: a Hugging Face MoE checkpoint -> an EXL3 model directory.
#include <cstdio>
#include <string>

#include "kernels/codebook.h"
#include "model/encoder/checkpoint_converter.h"
#include "model/moe_config.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool quantize --input HF_DIR --output DIR --bits K [--codebook 3inst|mcg|mul1]\n"
    "                          [--expert-bits K] [--down-bits K] [--seed S] [--threads N]\n"
    "                          [--no-shared] [--no-scale-search] [--quiet]\n"
    "\n"
    "Converts a Hugging Face MoE checkpoint (safetensors shards, BF16/F16/F32) into an EXL3\n"
    "model directory. The routed experts' gate/up/down projections and the shared experts'\n"
    "become EXL3 layers (.trellis/.suh/.svh/.mcg|.mul1); every other tensor (attention, norms,\n"
    "embeddings, routers, correction biases) is copied unchanged; config.json gains\n"
    "quantization_config {quant_method: exl3, version, bits, codebook, ...}; other files are\n"
    "copied. Output shards mirror the input shards and are indexed in\n"
    "model.safetensors.index.json.\n"
    "\n"
    "This is plain, data-free trellis quantization (random signs and channel scales, Hadamard\n"
    "rotation, global scale search, Viterbi encoding); there is no Hessian-aware (LDLQ)\n"
    "calibration, so quality at low K is below exllamav3's calibrated conversions.\n"
    "\n"
    "Restartable: every shard is written atomically and records the options; running the same\n"
    "command again skips the shards already complete. Architectures: those of\n"
    "model/moe_config.h (Glm4MoeForCausalLM, GlmMoeDsaForCausalLM, DeepseekV3ForCausalLM,\n"
    "DeepseekV4ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, MixtralForCausalLM);\n"
    "any other is refused.\n"
    "\n"
    "  --input        the Hugging Face checkpoint directory\n"
    "  --output       the EXL3 model directory to write (created)\n"
    "  --bits         K (1..8) of every quantized tensor unless overridden\n"
    "  --expert-bits  K of the routed experts (default: --bits); shared experts keep --bits\n"
    "  --down-bits    K of all down projections, routed and shared (default: no override)\n"
    "  --codebook     3inst (default), mcg or mul1\n"
    "  --seed         seed of the random sign vectors (default 0)\n"
    "  --threads      encoder threads (default: all cores)\n"
    "  --no-shared    copy shared experts unquantized\n"
    "  --no-scale-search  use the default global scale (faster, slightly worse)\n"
    "  --quiet        no progress bar\n";

int Run(int argc, char** argv) {
  const char* kName = "quantize";
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv,
                  {"input", "output", "bits", "codebook", "expert-bits", "down-bits", "seed", "threads"},
                  {"no-shared", "no-scale-search", "quiet"}, &err)) {
    return Fail(kName, err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"input", "output", "bits"}, &err)) return Fail(kName, err);
  ConvertOptions o;
  if (!args.GetInt("bits", &o.bits, &err)) return Fail(kName, err);
  if (args.Has("expert-bits") && !args.GetInt("expert-bits", &o.expert_bits, &err)) return Fail(kName, err);
  if (args.Has("down-bits") && !args.GetInt("down-bits", &o.down_bits, &err)) return Fail(kName, err);
  for (int k : {o.bits, o.expert_bits, o.down_bits}) {
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
  o.scale_search = !args.Bool("no-scale-search");
  o.progress = !args.Bool("quiet");
  absl::StatusOr<ConvertStats> st = ConvertCheckpoint(args.Get("input"), args.Get("output"), o);
  if (!st.ok()) return Fail(kName, std::string(st.status().message()));
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

// exl3-tool quantize-tensor: one 2-D weight -> one EXL3 layer in a safetensors file.
#include <cstdio>
#include <string>

#include "kernels/codebook.h"
#include "model/encoder/layer_quantizer.h"
#include "model/safetensors.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool quantize-tensor --input FILE --tensor NAME --output OUT.safetensors\n"
    "                                 --prefix KEY --bits K [--codebook 3inst|mcg|mul1]\n"
    "                                 [--seed S] [--threads N] [--no-scale-search]\n"
    "\n"
    "Quantizes tensor NAME of FILE (or of a model directory), a 2-D F16/BF16/F32 weight in\n"
    "Hugging Face nn.Linear orientation [out, in] (both multiples of 128), to one EXL3 layer\n"
    "and writes KEY.trellis, KEY.suh, KEY.svh (and KEY.mcg or KEY.mul1) to OUT, so that\n"
    "W = diag(suh) H W_inner H diag(svh) ([in, out]) approximates the transpose of NAME.\n"
    "Plain, data-free trellis quantization: random signs and channel scales, Hadamard on both\n"
    "sides, a global scale, Viterbi tile encoding; no Hessian/LDLQ calibration.\n"
    "Prints the relative error (tile MSE / energy) on stdout.\n"
    "\n"
    "  --input     safetensors file or model directory holding NAME\n"
    "  --tensor    the weight's name\n"
    "  --output    safetensors file to write (replaced)\n"
    "  --prefix    key prefix of the EXL3 tensors written\n"
    "  --bits      K, bits per weight, 1..8\n"
    "  --codebook  3inst (default), mcg or mul1\n"
    "  --seed      seed of the random sign vectors (default 0)\n"
    "  --threads   encoder threads (default: all cores)\n"
    "  --no-scale-search  use the default global scale for K and codebook\n";

int Run(int argc, char** argv) {
  const char* kName = "quantize-tensor";
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"input", "tensor", "output", "prefix", "bits", "codebook", "seed", "threads"},
                  {"no-scale-search"}, &err)) {
    return Fail(kName, err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"input", "tensor", "output", "prefix", "bits"}, &err)) return Fail(kName, err);
  LayerQuantOptions opts;
  if (!args.GetInt("bits", &opts.bits, &err)) return Fail(kName, err);
  if (opts.bits < 1 || opts.bits > 8) return Fail(kName, "--bits must be in 1..8");
  if (!ParseCodebook(args.Get("codebook", "3inst"), &opts.codebook)) {
    return Fail(kName, "--codebook must be 3inst, mcg or mul1, got '" + args.Get("codebook") + "'");
  }
  if (args.Has("seed") && !absl::SimpleAtoi(args.Get("seed"), &opts.seed)) {
    return Fail(kName, "--seed must be a non-negative integer");
  }
  if (args.Has("threads") && (!args.GetInt("threads", &opts.threads, &err) || opts.threads < 0)) {
    return Fail(kName, err.empty() ? "--threads must be >= 0" : err);
  }
  opts.scale_search = !args.Bool("no-scale-search");

  absl::StatusOr<std::unique_ptr<TensorSource>> src = TensorSource::Open(args.Get("input"));
  if (!src.ok()) return Fail(kName, std::string(src.status().message()));
  absl::StatusOr<TensorView> t = (*src)->Get(args.Get("tensor"));
  if (!t.ok()) return Fail(kName, std::string(t.status().message()));
  absl::StatusOr<QuantizedLayer> q = QuantizeLinearTensor(*t, opts);
  if (!q.ok()) return Fail(kName, std::string(q.status().message()));
  SafetensorsWriter w;
  AddQuantizedLayer(*q, args.Get("prefix"), &w);
  absl::Status s = w.Write(args.Get("output"));
  if (!s.ok()) return Fail(kName, std::string(s.message()));
  std::printf("%s: [%d, %d] -> EXL3 K=%d %s, global scale %.4f, relative error %.4e\n",
              args.Get("prefix").c_str(), q->out_features, q->in_features, q->bits,
              std::string(CodebookName(q->codebook)).c_str(), q->global_scale, q->relative_mse);
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kQuantizeTensorRegistered, "quantize-tensor",
                     "quantize one 2-D weight to an EXL3 layer", exl3::tool::Run);

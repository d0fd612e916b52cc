// exl3-tool dequant: the dense weight of one EXL3 linear layer.
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/exl3_linear.h"
#include "model/exl3_linear_loader.h"
#include "model/safetensors.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool dequant --input FILE_OR_DIR --prefix KEY --output OUT.safetensors [--inner]\n"
    "\n"
    "Decodes the EXL3 linear layer whose tensors are KEY.trellis, KEY.suh/su, KEY.svh/sv\n"
    "(+ KEY.mcg or KEY.mul1) and writes its dense weight W = diag(suh)·H·W_inner·H·diag(svh)\n"
    "as fp32 tensor `weight` [in, out]; with --inner, the fp16 `weight_inner` [in, out] exactly as\n"
    "the trellis encodes it.\n"
    "\n"
    "  --input   a .safetensors file or a model directory (sharded models included)\n"
    "  --prefix  the layer's key prefix, e.g. model.layers.3.mlp.experts.0.gate_proj\n"
    "  --output  the safetensors file to write\n"
    "  --inner   write weight_inner (fp16) instead of weight (fp32)\n";

int Run(int argc, char** argv) {
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"input", "prefix", "output"}, {"inner"}, &err)) {
    return Fail("dequant", err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"input", "prefix", "output"}, &err)) return Fail("dequant", err);
  absl::StatusOr<std::unique_ptr<TensorSource>> src = TensorSource::Open(args.Get("input"));
  if (!src.ok()) return Fail("dequant", std::string(src.status().message()));
  absl::StatusOr<std::unique_ptr<Exl3Linear>> lin = LoadExl3Linear(**src, args.Get("prefix"));
  if (!lin.ok()) return Fail("dequant", std::string(lin.status().message()));
  const Exl3LinearView& w = (*lin)->view;
  const size_t kn = static_cast<size_t>(w.in_features) * w.out_features;
  SafetensorsWriter out;
  if (args.Bool("inner")) {
    std::vector<uint16_t> inner(kn);
    DequantizeInner(w, inner.data());
    out.Add("weight_inner", DType::kF16, {w.in_features, w.out_features}, inner.data(), kn * 2);
  } else {
    std::vector<float> dense(kn);
    DequantizeDense(w, dense.data());
    out.AddF32("weight", {w.in_features, w.out_features}, dense.data());
  }
  absl::Status s = out.Write(args.Get("output"));
  if (!s.ok()) return Fail("dequant", std::string(s.message()));
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kDequantRegistered, "dequant",
                     "dense weight (fp32) or W_inner (fp16) of one EXL3 linear layer",
                     exl3::tool::Run);

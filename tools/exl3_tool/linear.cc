// exl3-tool linear: y = x · W through an EXL3 linear layer on the chosen backend.
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#ifdef EXL3_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif
#include "model/exl3_linear_loader.h"
#include "model/safetensors.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool linear --input FILE_OR_DIR --prefix KEY --x X.safetensors\n"
    "                        --output OUT.safetensors [--backend cpu|cuda|auto] [--threads N]\n"
    "\n"
    "Reads tensor `x` [T, in] (F16, BF16 or F32) from X.safetensors, runs the EXL3 linear layer at\n"
    "KEY and writes fp32 tensor `y` [T, out] (bias included when the layer has one).\n"
    "\n"
    "  --input    a .safetensors file or a model directory\n"
    "  --prefix   the layer's key prefix\n"
    "  --x        safetensors file holding `x`\n"
    "  --output   the safetensors file to write\n"
    "  --backend  cpu (the fast multithreaded CPU backend), cuda, or auto (cuda when this build\n"
    "             has it, else cpu); default auto\n"
    "  --threads  CPU threads (default: all)\n";

// The one place that picks the implementation; the CUDA path is added here when it exists.
absl::Status RunLinear(ToolBackend backend, int threads, const Exl3LinearView& w, const float* x,
                       int T, float* y) {
  switch (backend) {
    case ToolBackend::kCpu: {
      cpu::CpuBackend cpu(threads);
      return cpu.Linear(w, x, T, y);
    }
    case ToolBackend::kCuda:
#ifdef EXL3_HAVE_CUDA
      return cuda::LinearForwardHost(w, x, T, y);
#else
      break;
#endif
  }
  return absl::UnimplementedError("this build has no CUDA backend");
}

int Run(int argc, char** argv) {
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"input", "prefix", "x", "output", "backend", "threads"}, {}, &err)) {
    return Fail("linear", err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"input", "prefix", "x", "output"}, &err)) return Fail("linear", err);
  ToolBackend backend = ToolBackend::kCpu;  // ParseBackend sets it
  if (!ParseBackend(args.Get("backend", "auto"), &backend, &err)) return Fail("linear", err);
  int threads = 0;
  if (args.Has("threads") && (!args.GetInt("threads", &threads, &err) || threads < 0)) {
    return Fail("linear", err.empty() ? "--threads must be >= 0" : err);
  }
  absl::StatusOr<std::unique_ptr<TensorSource>> src = TensorSource::Open(args.Get("input"));
  if (!src.ok()) return Fail("linear", std::string(src.status().message()));
  absl::StatusOr<std::unique_ptr<Exl3Linear>> lin = LoadExl3Linear(**src, args.Get("prefix"));
  if (!lin.ok()) return Fail("linear", std::string(lin.status().message()));
  const Exl3LinearView& w = (*lin)->view;
  std::vector<int64_t> shape;
  absl::StatusOr<std::vector<float>> x = ReadFloatTensor(args.Get("x"), "x", &shape);
  if (!x.ok()) return Fail("linear", std::string(x.status().message()));
  if (shape.size() != 2 || shape[1] != w.in_features) {
    return Fail("linear", "tensor `x` must be [T, " + std::to_string(w.in_features) +
                              "] for this layer");
  }
  const int T = static_cast<int>(shape[0]);
  std::vector<float> y(static_cast<size_t>(T) * w.out_features);
  absl::Status s = RunLinear(backend, threads, w, x->data(), T, y.data());
  if (!s.ok()) return Fail("linear", std::string(s.message()));
  SafetensorsWriter out;
  out.AddF32("y", {T, w.out_features}, y.data());
  s = out.Write(args.Get("output"));
  if (!s.ok()) return Fail("linear", std::string(s.message()));
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kLinearRegistered, "linear", "run one EXL3 linear layer on x [T, in]",
                     exl3::tool::Run);

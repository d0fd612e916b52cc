// exl3-tool moe: one MoE layer of an EXL3 model on hidden states x [T, hidden].
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#ifdef EXL3_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif
#include "kernels/moe_cpu.h"
#include "model/config/read_moe_config.h"
#include "model/exl3_model.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool moe --model DIR --layer L --x X.safetensors --output OUT.safetensors\n"
    "                     [--backend cpu|cuda|auto] [--threads N] [--no-shared]\n"
    "\n"
    "Runs MoE layer L of the EXL3 model in DIR on tensor `x` [T, hidden] (F16, BF16 or F32):\n"
    "the model's router (its routing function, in fp32), every chosen expert's\n"
    "down(silu(gate(x)) * up(x)) (with swiglu_limit where configured), the weighted sum, and the\n"
    "shared expert. Writes fp32 `y` [T, hidden], int32 `topk_ids` [T, k], fp32 `topk_weights`\n"
    "[T, k]. Hash-routed layers (DeepSeek-V4) also need tensor `token_ids` [T] (I32/I64) in X.\n"
    "\n"
    "  --model      the model directory (config.json + safetensors)\n"
    "  --layer      the MoE layer index\n"
    "  --x          safetensors file holding `x`\n"
    "  --output     the safetensors file to write\n"
    "  --backend    cpu, cuda, or auto (cuda when this build has it, else cpu); default auto\n"
    "  --threads    CPU threads (default: all)\n"
    "  --no-shared  leave the shared expert out of y\n";

absl::Status RunMoe(ToolBackend backend, int threads, const MoeLayerView& layer, const float* x,
                    const MoeAssignments& a, bool include_shared, float* y) {
  switch (backend) {
    case ToolBackend::kCpu: {
      cpu::CpuBackend cpu(threads);
      return cpu.Moe(layer, x, a, include_shared, y);
    }
    case ToolBackend::kCuda:
#ifdef EXL3_HAVE_CUDA
      return cuda::MoeForwardHost(layer, x, a, include_shared, y);
#else
      break;
#endif
  }
  return absl::UnimplementedError("this build has no CUDA backend");
}

absl::StatusOr<std::vector<int64_t>> ReadTokenIds(const std::string& path, int T) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  if (!f.ok()) return f.status();
  absl::StatusOr<TensorView> t = (*f)->Get("token_ids");
  if (!t.ok()) return t.status();
  if (t->info->num_elements() != T ||
      (t->info->dtype != DType::kI32 && t->info->dtype != DType::kI64)) {
    return absl::InvalidArgumentError("tensor `token_ids` must be I32 or I64 with T elements");
  }
  std::vector<int64_t> ids(T);
  for (int i = 0; i < T; ++i) {
    ids[i] = t->info->dtype == DType::kI32 ? t->as<int32_t>()[i] : t->as<int64_t>()[i];
  }
  return ids;
}

int Run(int argc, char** argv) {
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"model", "layer", "x", "output", "backend", "threads"},
                  {"no-shared"}, &err)) {
    return Fail("moe", err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"model", "layer", "x", "output"}, &err)) return Fail("moe", err);
  ToolBackend backend = ToolBackend::kCpu;  // ParseBackend sets it
  if (!ParseBackend(args.Get("backend", "auto"), &backend, &err)) return Fail("moe", err);
  int layer = 0, threads = 0;
  if (!args.GetInt("layer", &layer, &err)) return Fail("moe", err);
  if (args.Has("threads") && (!args.GetInt("threads", &threads, &err) || threads < 0)) {
    return Fail("moe", err.empty() ? "--threads must be >= 0" : err);
  }
  absl::StatusOr<MoeConfig> cfg = LoadMoeConfig(args.Get("model"));
  if (!cfg.ok()) return Fail("moe", std::string(cfg.status().message()));
  if (!cfg->IsMoeLayer(layer)) {
    return Fail("moe", "layer " + std::to_string(layer) + " is not a MoE layer of this " +
                           cfg->architecture + " model");
  }
  Exl3ModelOptions opt;
  std::vector<int> all(cfg->num_experts);
  std::iota(all.begin(), all.end(), 0);
  opt.experts = std::map<int, std::vector<int>>{{layer, all}};
  absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(args.Get("model"), opt);
  if (!model.ok()) return Fail("moe", std::string(model.status().message()));
  const MoeConfig& c = (*model)->config();

  std::vector<int64_t> shape;
  absl::StatusOr<std::vector<float>> x = ReadFloatTensor(args.Get("x"), "x", &shape);
  if (!x.ok()) return Fail("moe", std::string(x.status().message()));
  if (shape.size() != 2 || shape[1] != c.hidden_size) {
    return Fail("moe", "tensor `x` must be [T, " + std::to_string(c.hidden_size) + "] (hidden_size)");
  }
  const int T = static_cast<int>(shape[0]);
  const int k = c.top_k;
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<float> weights(static_cast<size_t>(T) * k);
  absl::Status s;
  if (c.IsHashRoutedLayer(layer)) {
    int64_t vocab = 0;
    const int32_t* table = (*model)->HashTable(layer, &vocab);
    if (table == nullptr) {
      return Fail("moe", "layer " + std::to_string(layer) + " is hash-routed but the model has no " +
                             HashTableKey(c, layer));
    }
    absl::StatusOr<std::vector<int64_t>> tok = ReadTokenIds(args.Get("x"), T);
    if (!tok.ok()) {
      return Fail("moe", "layer " + std::to_string(layer) +
                             " is hash-routed and needs token ids: " +
                             std::string(tok.status().message()));
    }
    std::vector<float> logits(static_cast<size_t>(T) * c.num_experts);
    ComputeRouterLogits((*model)->RouterWeight(layer), x->data(), T, c.num_experts, c.hidden_size,
                        logits.data());
    s = RouteHashed(c, layer, logits.data(), table, vocab, tok->data(), T, ids.data(),
                    weights.data());
  } else {
    s = RouteTokens(c, layer, (*model)->RouterWeight(layer), (*model)->CorrectionBias(layer),
                    x->data(), T, ids.data(), weights.data());
  }
  if (!s.ok()) return Fail("moe", std::string(s.message()));
  absl::StatusOr<MoeLayerView> view = (*model)->LayerView(layer);
  if (!view.ok()) return Fail("moe", std::string(view.status().message()));
  std::vector<float> y(static_cast<size_t>(T) * c.hidden_size);
  s = RunMoe(backend, threads, *view, x->data(),
             MoeAssignments::Fixed(T, k, ids.data(), weights.data()), !args.Bool("no-shared"),
             y.data());
  if (!s.ok()) return Fail("moe", std::string(s.message()));
  SafetensorsWriter out;
  out.AddF32("y", {T, c.hidden_size}, y.data());
  out.Add("topk_ids", DType::kI32, {T, k}, ids.data(), ids.size() * sizeof(int32_t));
  out.AddF32("topk_weights", {T, k}, weights.data());
  s = out.Write(args.Get("output"));
  if (!s.ok()) return Fail("moe", std::string(s.message()));
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kMoeRegistered, "moe", "run one MoE layer (routing, experts, shared expert)",
                     exl3::tool::Run);

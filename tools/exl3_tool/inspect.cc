// exl3-tool inspect: what an EXL3 MoE model directory holds.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/exl3_model.h"
#include "model/index_ranges.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool inspect --model DIR\n"
    "\n"
    "Prints the architecture, the layers and which are MoE, experts, top-k, routing, the K and\n"
    "codebook of every expert projection (summarised as counts), and bytes, after validating every\n"
    "expert tensor against config.json.\n"
    "\n"
    "  --model  the model directory (config.json + safetensors)\n";

std::string Bytes(uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / double(1ull << 30));
  } else if (b >= (1ull << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", b / double(1ull << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / 1024.0);
  }
  return absl::StrCat(b, " bytes (", buf, ")");
}

int Run(int argc, char** argv) {
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"model"}, {}, &err)) return Fail("inspect", err);
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"model"}, &err)) return Fail("inspect", err);
  Exl3ModelOptions opt;
  opt.load_routers = false;  // only tensors are checked here; routers are validated by `moe`
  absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(args.Get("model"), opt);
  if (!model.ok()) return Fail("inspect", std::string(model.status().message()));
  const Exl3Model& m = **model;
  const MoeConfig& c = m.config();
  const std::vector<int> moe = c.MoeLayers();
  std::printf("model:            %s\n", m.dir().c_str());
  std::printf("architecture:     %s (family %s)\n", c.architecture.c_str(),
              std::string(MoeFamilyName(c.family)).c_str());
  std::printf("fingerprint:      %s\n", m.fingerprint().c_str());
  std::printf("quantization:     %s, bits %g, head_bits %g\n", c.quant_method.c_str(), c.bits,
              c.head_bits);
  std::printf("hidden_size:      %d\n", c.hidden_size);
  std::printf("layers:           %d, MoE: %zu (%s)\n", c.num_hidden_layers, moe.size(),
              FormatIndexRanges(std::vector<int32_t>(moe.begin(), moe.end())).c_str());
  std::vector<int32_t> hashed;
  for (int L : moe) {
    if (c.IsHashRoutedLayer(L)) hashed.push_back(L);
  }
  if (!hashed.empty()) {
    std::printf("hash-routed:      %s (token ids required)\n", FormatIndexRanges(hashed).c_str());
  }
  std::printf("routed experts:   %d per layer, top-k %d, intermediate %d\n", c.num_experts, c.top_k,
              c.moe_intermediate_size);
  if (c.has_shared_expert()) {
    std::printf("shared expert:    %d (intermediate %d)%s\n", c.num_shared_experts,
                c.shared_intermediate_size, c.shared_expert_gated ? ", sigmoid-gated" : "");
  } else {
    std::printf("shared expert:    none\n");
  }
  std::printf("routing:          %s, norm_topk_prob %s, scale %g, groups %d (keep %d), "
              "correction bias %s, swiglu_limit %g\n",
              std::string(ScoringFuncName(c.scoring)).c_str(), c.norm_topk_prob ? "true" : "false",
              c.routed_scaling_factor, c.n_group, c.topk_group,
              c.has_correction_bias ? "yes" : "no", c.swiglu_limit);

  // K and codebook per projection, counted over every expert of every layer.
  const Projection projs[3] = {Projection::kGate, Projection::kUp, Projection::kDown};
  for (int shared = 0; shared < 2; ++shared) {
    if (shared && !c.has_shared_expert()) continue;
    for (Projection p : projs) {
      std::map<std::string, int> counts;
      for (int L : moe) {
        if (shared) {
          if (const Exl3Linear* lin = m.Linear(L, -1, p)) {
            ++counts[absl::StrCat("K", lin->view.bits, " ",
                                  std::string(CodebookName(lin->view.codebook)))];
          }
          continue;
        }
        for (int e : m.HeldExperts(L)) {
          const Exl3Linear* lin = m.Linear(L, e, p);
          ++counts[absl::StrCat("K", lin->view.bits, " ",
                                std::string(CodebookName(lin->view.codebook)))];
        }
      }
      std::vector<std::string> parts;
      for (const auto& [key, n] : counts) parts.push_back(absl::StrCat(key, " x", n));
      std::printf("%-17s %s\n",
                  absl::StrCat(shared ? "shared " : "routed ", std::string(ProjectionName(p)), ":")
                      .c_str(),
                  absl::StrJoin(parts, ", ").c_str());
    }
  }
  uint64_t routed = 0, shared_bytes = 0;
  for (int L : moe) {
    shared_bytes += m.SharedExpertBytes(L);
    for (int e : m.HeldExperts(L)) routed += m.ExpertBytes(L, e);
  }
  std::printf("bytes, routed:    %s", Bytes(routed).c_str());
  if (!moe.empty() && c.num_experts > 0) {
    std::printf(", per layer %s, per expert %s",
                Bytes(routed / moe.size()).c_str(),
                Bytes(routed / (moe.size() * c.num_experts)).c_str());
  }
  std::printf("\nbytes, shared:    %s\n", Bytes(shared_bytes).c_str());
  std::printf("bytes, total:     %s\n", Bytes(m.TotalBytes()).c_str());

  // Alignment of every held expert tensor in its file (mappings are page-aligned, so an address's
  // alignment is its file offset's): the GPU reads 16-byte aligned tensors in place.
  size_t by_align[5] = {0, 0, 0, 0, 0};  // 16, 8, 4, 2, 1 bytes
  size_t tensors = 0;
  uint64_t aligned_bytes = 0;
  for (int L : moe) {
    std::vector<int> experts = m.HeldExperts(L);
    if (m.SharedExpert(L) != nullptr) experts.push_back(-1);
    for (int e : experts) {
      for (Projection p : projs) {
        const Exl3Linear* lin = m.Linear(L, e, p);
        if (lin == nullptr) continue;
        for (const TensorView& t : lin->tensors) {
          const uintptr_t a = reinterpret_cast<uintptr_t>(t.data);
          int k = 0;
          while (k < 4 && a % (uintptr_t{16} >> k) != 0) ++k;
          ++by_align[k];
          ++tensors;
          if (k == 0) aligned_bytes += t.size_bytes();
        }
      }
    }
  }
  std::printf("alignment:        %zu of %zu expert tensors 16-byte aligned in the files (%s); "
              "8-byte only %zu, 4-byte only %zu, less %zu (--weights-residency host reads the "
              "16-byte aligned in place and realigns the rest)\n",
              by_align[0], tensors, Bytes(aligned_bytes).c_str(), by_align[1], by_align[2],
              by_align[3] + by_align[4]);
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kInspectRegistered, "inspect",
                     "architecture, MoE layers, experts, K/codebook per projection, bytes",
                     exl3::tool::Run);

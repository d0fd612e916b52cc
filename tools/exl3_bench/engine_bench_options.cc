#include "tools/exl3_bench/engine_bench_options.h"

#include <cerrno>
#include <climits>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "engine/speculative/speculative_options.h"
#include "model/config/read_moe_config.h"
#include "model/expert_map.h"
#include "model/moe_config.h"

namespace exl3::bench {

const char kEngineBenchUsage[] =
    "usage: exl3-engine-bench --model DIR [--context 1024,8192] [--batch 1,8,32,64] [--steps 16]\n"
    "                         [--prefill-chunk 2048] [--no-graphs] [--verify-graphs] [--max-moe-tokens N] [--json FILE]\n"
    "                         [--expert-map FILE [--micro-batches 1,2] [--shared-expert local|worker:NAME|none]\n"
    "                          [--worker-shm-mb 8] [--ready-timeout-s 120] [--moe-timeout-ms 30000]]\n"
    "                         [--speculative-acceptance 0,0.5,0.7,0.9,1 [--num-speculative-tokens 1,2,3,4]\n"
    "                          [--speculative-draft-length fixed|adaptive|goodput]]\n"
    "                         [--constrained-tokenizer FILE]\n"
    "       exl3-engine-bench --attention-only [--attention-shape 96,8,128] [--context 1024,8192]\n"
    "                         [--batch 1,8,64] [--prefill-chunk 2048] [--runs 30] [--json FILE]\n"
    "       exl3-engine-bench --sampling-only [--vocab 151552] [--batch 1,8,64] [--runs 30] [--json FILE]\n"
    "\n"
    "Runs the GPU engine directly on DIR (an EXL3 model of a GQA family, experts on this GPU):\n"
    "time to first token and prefill tokens/s of one prompt of each --context length, then decode\n"
    "tokens/s at each --batch size continuing it, each against its floor (per part, the slower of\n"
    "its bytes over the copy bandwidth and its EXL3 weights over the decode ceiling, both measured\n"
    "in the same run). --no-graphs: decode steps launch eagerly instead of\n"
    "replaying CUDA graphs; --verify-graphs: speculative decoding's verify steps replay them too\n"
    "(CudaModelOptions::verify_graphs). --max-moe-tokens: the MoE workspace's token rows (CudaModelOptions).\n"
    "--json appends one JSON object per result.\n"
    "\n"
    "--expert-map FILE: the routed experts on the map's exl3-worker processes instead, reached as\n"
    "exl3-router reaches them (its router core in this process: gate, dispatch, combine; a\n"
    "shared-memory channel to workers on this host, --worker-shm-mb MiB per direction, 0: gRPC\n"
    "only), the shared expert where --shared-expert says (local: this host's CPU). The same tables\n"
    "for each --micro-batches count (1: one exchange per MoE layer; 2: ping-pong, one micro-batch's\n"
    "exchange while the other's attention runs), against the same floor, with the exchange's time\n"
    "per MoE layer (copy to the host, the call, copy back). Waits up to --ready-timeout-s for\n"
    "every expert to have a serving worker.\n"
    "\n"
    "--speculative-acceptance P,...: instead of the tables, speculative decoding through the\n"
    "engine (scheduler, verify chunks, rollback, sampling as exl3-router runs them) with a drafter\n"
    "made to match the target with probability P: each --batch of random prompts of each --context\n"
    "length decodes --steps greedy tokens, first without drafts (recording the continuations),\n"
    "then for each P and each draft cap of --num-speculative-tokens with the recorded\n"
    "continuation as drafts, each draft token right with probability P (else another token);\n"
    "decode tokens/s, mean step and verify step time, drafts accepted, and how many requests'\n"
    "tokens differ from the plain run's (speculation must change none).\n"
    "--speculative-draft-length adaptive: each sequence's own K (engine/speculative/draft_length.h);\n"
    "goodput: each step's drafts chosen for the most expected tokens per second under the step\n"
    "times measured so far (engine/speculative/goodput_draft_choice.h).\n"
    "With --expert-map, the experts on the workers as above.\n"
    "\n"
    "--constrained-tokenizer FILE: instead of the tables, what constrained decoding costs per step\n"
    "through the engine (bench/results/structured-output.md): at each --batch, that many random\n"
    "prompts of each --context length decode together (temperature 1, ignore_eos), first every\n"
    "sequence unconstrained (sampled on the device), then every one constrained by the JSON schema\n"
    "of exl3-constraint-bench, compiled as exl3-router compiles response_format against FILE (a\n"
    "tokenizer.json; masks of the model's vocab_size, ids past FILE's never allowed), those rows\n"
    "sampled on the host. Median step time (the engine's whole step) and decode tokens/s over the\n"
    "steps where the whole batch decodes (no prompt chunk): about --steps of them unconstrained;\n"
    "a request its grammar ends early is replaced by a new one to keep the batch full (its prefill\n"
    "steps not measured); requests, tokens per request and the steps measured are reported, and\n"
    "the difference as a share of the unconstrained step. With --expert-map, as above. Issue 30's\n"
    "measure: --context 1024 --batch 1,64 --steps 32.\n"
    "\n"
    "--attention-only: no model; the attention kernels alone on random inputs of --attention-shape\n"
    "(query heads, KV heads, head dim): decode at each --batch and --context against the KV-read\n"
    "floor, prefill of each --context prompt in --prefill-chunk chunks against the FLOP floor.\n"
    "\n"
    "--sampling-only: no model; sampling --batch rows of random logits of --vocab tokens per step,\n"
    "greedy and top-k 50 + top-p 0.9 + penalties: on the device (device-event time, and wall time\n"
    "with the host's packing and unpacking) beside the old path (the rows' device-to-host copy and\n"
    "the CPU sampler on one thread).\n";

namespace {

absl::StatusOr<int> PositiveInt(const std::string& flag, const std::string& text, bool zero_allowed = false) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end == nullptr || *end != '\0' || errno != 0 || v > INT_MAX || v < (zero_allowed ? 0 : 1))
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", text, "' is not a ",
                                                   zero_allowed ? "non-negative" : "positive", " integer"));
  return static_cast<int>(v);
}

absl::StatusOr<std::vector<double>> FractionList(const std::string& flag, const std::string& text) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::string s(part);
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || end == nullptr || *end != '\0' || errno != 0 || !(v >= 0 && v <= 1))
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", s, "' is not a number in [0, 1]"));
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<int>> PositiveIntList(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    EXL3_ASSIGN_OR_RETURN(const int v, PositiveInt(flag, std::string(part)));
    out.push_back(v);
  }
  return out;
}

}  // namespace

absl::StatusOr<EngineBenchOptions> ParseEngineBenchArgs(const std::vector<std::string>& args) {
  EngineBenchOptions o;
  bool ks_given = false, draft_length_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> absl::StatusOr<std::string> {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat(a, " needs a value"));
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      o.help = true;
    } else if (a == "--model") {
      EXL3_ASSIGN_OR_RETURN(o.model, value());
    } else if (a == "--json") {
      EXL3_ASSIGN_OR_RETURN(o.json, value());
    } else if (a == "--context") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.contexts, PositiveIntList(a, v));
    } else if (a == "--batch") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.batches, PositiveIntList(a, v));
      o.batches_given = true;
    } else if (a == "--attention-only") {
      o.attention_only = true;
    } else if (a == "--sampling-only") {
      o.sampling_only = true;
    } else if (a == "--vocab") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.sampling_vocab, PositiveInt(a, v));
    } else if (a == "--attention-shape") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.attention_shape, PositiveIntList(a, v));
      if (o.attention_shape.size() != 3)
        return absl::InvalidArgumentError("--attention-shape: three numbers, query heads,KV heads,head dim");
    } else if (a == "--runs") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.runs, PositiveInt(a, v));
    } else if (a == "--steps") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.steps, PositiveInt(a, v));
    } else if (a == "--prefill-chunk") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.prefill_chunk, PositiveInt(a, v));
    } else if (a == "--no-graphs") {
      o.graphs = false;
    } else if (a == "--verify-graphs") {
      o.verify_graphs = true;
    } else if (a == "--max-moe-tokens") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.max_moe_tokens, PositiveInt(a, v));
    } else if (a == "--expert-map") {
      EXL3_ASSIGN_OR_RETURN(o.expert_map, value());
      if (o.expert_map.empty()) return absl::InvalidArgumentError("--expert-map: empty file name");
    } else if (a == "--micro-batches") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.micro_batches, PositiveIntList(a, v));
      for (int mb : o.micro_batches)
        if (mb > 2) return absl::InvalidArgumentError(absl::StrCat("--micro-batches: ", mb, " (1 or 2)"));
    } else if (a == "--shared-expert") {
      EXL3_ASSIGN_OR_RETURN(o.shared_expert, value());
      const bool worker = o.shared_expert.rfind("worker:", 0) == 0 && o.shared_expert.size() > 7;
      if (o.shared_expert != "local" && o.shared_expert != "none" && !worker)
        return absl::InvalidArgumentError(
            absl::StrCat("--shared-expert: '", o.shared_expert, "' (local, worker:NAME or none)"));
    } else if (a == "--worker-shm-mb") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.worker_shm_mb, PositiveInt(a, v, /*zero_allowed=*/true));
    } else if (a == "--ready-timeout-s") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.ready_timeout_s, PositiveInt(a, v));
    } else if (a == "--speculative-acceptance") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.speculative_acceptances, FractionList(a, v));
    } else if (a == "--num-speculative-tokens") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.speculative_ks, PositiveIntList(a, v));
      ks_given = true;
    } else if (a == "--speculative-draft-length") {
      EXL3_ASSIGN_OR_RETURN(o.speculative_draft_length, value());
      if (const absl::Status known = engine::ParseDraftLengthPolicy(o.speculative_draft_length).status(); !known.ok())
        return absl::InvalidArgumentError(absl::StrCat("--speculative-draft-length: ", known.message()));
      draft_length_given = true;
    } else if (a == "--constrained-tokenizer") {
      EXL3_ASSIGN_OR_RETURN(o.constrained_tokenizer, value());
      if (o.constrained_tokenizer.empty()) return absl::InvalidArgumentError("--constrained-tokenizer: empty file name");
    } else if (a == "--moe-timeout-ms") {
      EXL3_ASSIGN_OR_RETURN(const std::string v, value());
      EXL3_ASSIGN_OR_RETURN(o.moe_timeout_ms, PositiveInt(a, v));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument ", a));
    }
  }
  if (o.help) return o;
  if ((ks_given || draft_length_given) && !o.speculative())
    return absl::InvalidArgumentError(
        "--num-speculative-tokens and --speculative-draft-length need --speculative-acceptance");
  if (o.attention_only || o.sampling_only) {
    if (o.speculative())
      return absl::InvalidArgumentError("--attention-only / --sampling-only run no model: no --speculative-acceptance");
    if (o.constrained())
      return absl::InvalidArgumentError("--attention-only / --sampling-only run no model: no --constrained-tokenizer");
    if (o.attention_only && o.sampling_only)
      return absl::InvalidArgumentError("--attention-only and --sampling-only: one at a time");
    if (o.remote()) return absl::InvalidArgumentError("--attention-only / --sampling-only run no model: no --expert-map");
    return o;
  }
  if (o.model.empty()) return absl::InvalidArgumentError("--model DIR is required (or --attention-only / --sampling-only)");
  // Both replace the tables with runs through the engine; constrained sequences get no drafts anyway.
  if (o.constrained() && o.speculative())
    return absl::InvalidArgumentError("--constrained-tokenizer and --speculative-acceptance: one at a time");
  const bool remote_flags = o.micro_batches != std::vector<int>{1} || o.shared_expert != "local";
  if (!o.remote() && remote_flags)
    return absl::InvalidArgumentError("--micro-batches and --shared-expert need --expert-map (remote experts)");
  return o;
}

absl::Status CheckBenchExpertMap(const EngineBenchOptions& o) {
  if (!o.remote()) return absl::OkStatus();
  EXL3_ASSIGN_OR_RETURN(const MoeConfig cfg, LoadMoeConfig(o.model));
  EXL3_ASSIGN_OR_RETURN(const ExpertMap map, LoadExpertMap(o.expert_map, cfg));
  EXL3_RETURN_IF_ERROR(CheckCoverage(map, cfg));
  if (o.shared_expert.rfind("worker:", 0) == 0) {
    const std::string name = o.shared_expert.substr(7);
    const ExpertMapWorker* w = map.Find(name);
    if (w == nullptr)
      return absl::InvalidArgumentError(
          absl::StrCat("--shared-expert ", o.shared_expert, ": expert map ", o.expert_map, " has no worker ", name));
    const ExpertMapWorker* holder = w->replica_of.empty() ? w : map.Find(w->replica_of);
    if (holder == nullptr || !holder->shared_expert)
      return absl::InvalidArgumentError(absl::StrCat("--shared-expert ", o.shared_expert, ": worker ", name, " of ",
                                                     o.expert_map, " is not marked shared_expert: true"));
  }
  return absl::OkStatus();
}

}  // namespace exl3::bench

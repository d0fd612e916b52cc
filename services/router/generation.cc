#include "services/router/generation.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_model.h"
#include "base/logging.h"
#include "services/router/router_moe_executor.h"

#if EXL3_HAVE_CUDA
#include "engine/cuda/cuda_model.h"
#endif

namespace exl3::router {
namespace {

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> OpenModel(const GenerationOptions& o, const ConfigFile& config,
                                                               std::unique_ptr<engine::MoeExecutor> moe) {
  if (o.device == EngineDevice::kCuda) {
#if EXL3_HAVE_CUDA
    engine::cuda::CudaModelOptions co;
    co.served_name = o.served_model_name;
    // With the experts on workers: two micro-batches overlap one's exchange with the other's
    // attention (engine/cuda/cuda_model.h); 1 unless asked until scripts/gpu/engine_remote.sh's
    // measurements on an H200 say otherwise.
    co.micro_batches = o.micro_batches > 0 ? o.micro_batches : 1;
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<engine::cuda::CudaModel> m,
                          engine::cuda::CudaModel::Open(o.model_dir, config, co, std::move(moe)));
    return std::unique_ptr<engine::ModelRunner>(std::move(m));
#else
    return absl::FailedPreconditionError(
        "--engine-device cuda: this build has no CUDA backend (configure with a CUDA toolkit)");
#endif
  }
  engine::CpuModelOptions mo;
  mo.num_threads = o.threads;
  mo.served_name = o.served_model_name;
  mo.residency = o.residency;
  // The CPU model shares its cores with the router's threads (and, on one host, the workers):
  // measured on 2 cores, two micro-batches did not pay (bench/results/engine-cpu.md), so 1
  // unless asked.
  mo.micro_batches = o.micro_batches > 0 ? o.micro_batches : 1;
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<engine::CpuModel> m, engine::CpuModel::Open(o.model_dir, config, mo, std::move(moe)));
  return std::unique_ptr<engine::ModelRunner>(std::move(m));
}

// The compiler of requests' constraints from the model directory's tokenizer.json; without that
// file, none, and the reason constrained requests are refused.
void LoadGrammarCompiler(const std::string& model_dir, const engine::ModelInfo& info,
                         GeneratorOptions& go) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "tokenizer.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    go.constraints_unavailable = absl::StrCat("the model directory has no ", path.string(),
                                              " (the vocabulary a constraint is compiled against)");
    exl3::LogInfo("engine: structured output off: %s", go.constraints_unavailable.c_str());
    return;
  }
  std::stringstream text;
  text << in.rdbuf();
  auto compiler = engine::TokenGrammarCompiler::FromTokenizerJson(text.str(), info.vocab_size,
                                                                  info.eos_token_ids);
  if (!compiler.ok()) {
    go.constraints_unavailable = absl::StrCat(path.string(), ": ", compiler.status().message());
    exl3::LogInfo("engine: structured output off: %s", go.constraints_unavailable.c_str());
    return;
  }
  go.grammar_compiler = *std::move(compiler);
  exl3::LogInfo("engine: structured output on (vocabulary of %s)", path.string().c_str());
}

}  // namespace

absl::StatusOr<EngineDevice> ParseEngineDevice(std::string_view name) {
  if (name == "cpu") return EngineDevice::kCpu;
  if (name == "cuda") return EngineDevice::kCuda;
  return absl::InvalidArgumentError(absl::StrCat("engine device '", std::string(name), "': expected cpu or cuda"));
}

absl::StatusOr<std::unique_ptr<Generation>> Generation::Start(const GenerationOptions& o,
                                                              const ConfigFile& config,
                                                              MoeRouterService* router,
                                                              prometheus::Registry& registry) {
  std::unique_ptr<engine::MoeExecutor> moe;
  if (router != nullptr) {
    EXL3_ASSIGN_OR_RETURN(engine::ModelConfig cfg, engine::ReadModelConfig(config));
    moe = std::make_unique<RouterMoeExecutor>(*router, o.inline_max_tokens, cfg.hidden_size,
                                              o.moe_timeout);
  }
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<engine::ModelRunner> model, OpenModel(o, config, std::move(moe)));
  std::unique_ptr<Generation> g(new Generation());
  g->writer_ = std::make_unique<svc::TaskQueue>(std::max(1, o.writer_threads));
  g->metrics_ = std::make_unique<EngineMetrics>(registry);
  GeneratorOptions go;
  go.default_timeout = o.default_timeout;
  go.experts = router != nullptr ? "workers" : "local";
  go.max_num_seqs = o.engine.scheduler.max_num_seqs;
  go.first_write_started = &g->metrics_->first_write_started();
  go.first_write_done = &g->metrics_->first_write_done();
  LoadGrammarCompiler(o.model_dir, model->info(), go);
  g->streams_ = std::make_unique<GenerateStreams>(go);
  engine::EngineOptions eo = o.engine;
  eo.observer = g->metrics_.get();
  eo.after_events = [writer = g->writer_.get(), streams = g->streams_.get()] {
    writer->Wake();
    streams->Flush();
  };
  g->engine_ = std::make_unique<engine::Engine>(eo, std::move(model));
  EXL3_RETURN_IF_ERROR(g->engine_->Start());
  g->service_ = std::make_unique<GeneratorService>(*g->engine_, go, *g->writer_, *g->streams_);
  g->refresh_ = std::thread([gp = g.get()] {
    while (!gp->stop_refresh_) {
      gp->metrics_->Refresh(gp->engine_->Stats());
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  });
  const engine::KvCacheShape shape = g->engine_->kv_cache_shape();
  exl3::LogInfo("engine: %s (%s) on the %s, KV cache %d blocks x %d tokens, experts %s",
               g->engine_->model_info().name.c_str(), g->engine_->model_info().architecture.c_str(),
               o.device == EngineDevice::kCuda ? "GPU" : "CPU", shape.num_blocks, shape.block_size,
               go.experts.c_str());
  const engine::SpeculativeOptions& spec = o.engine.scheduler.speculative;
  if (spec.method == engine::SpeculativeMethod::kNgram) {
    const engine::NgramDrafterOptions ngram = *engine::NgramOptionsOf(spec);  // checked by Start
    exl3::LogInfo("engine: speculative decoding ngram, %d draft tokens per step, n-grams of %d to %d, "
                 "draft length %s", spec.num_speculative_tokens, ngram.min_n, ngram.max_n,
                 engine::DraftLengthPolicyName(spec.draft_length));
  } else if (spec.method == engine::SpeculativeMethod::kMtp) {
    exl3::LogInfo("engine: speculative decoding mtp, %d draft tokens per step from the model's MTP head "
                 "(its MoE block runs in this process; no prefix caching), draft length %s",
                 spec.num_speculative_tokens, engine::DraftLengthPolicyName(spec.draft_length));
  }
  const engine::ModelInfo& info = g->engine_->model_info();
  if (info.state_bytes_per_sequence > 0) {
    exl3::LogInfo("engine: %s keeps a recurrent state per sequence (%.1f MiB each, %d slots)%s",
                 info.architecture.c_str(), info.state_bytes_per_sequence / 1048576.0,
                 shape.num_sequence_slots,
                 o.engine.scheduler.enable_prefix_caching && !engine::PrefixCachingUsable(info)
                     ? "; prefix caching is off: a cached prefix cannot restore that state"
                     : "");
  }
  return g;
}

int Generation::Drain(std::chrono::milliseconds grace) {
  service_->SetDraining();
  std::thread drain([this] { engine_->Drain(); });
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    const engine::EngineStats s = engine_->Stats();
    if (s.running == 0 && s.waiting == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int cut = engine_->Stop();  // ends what is left UNAVAILABLE; Drain then returns
  drain.join();
  return cut;
}

void Generation::Stop() {
  if (engine_) engine_->Stop();
  stop_refresh_ = true;
  if (refresh_.joinable()) refresh_.join();
}

Generation::~Generation() { Stop(); }

}  // namespace exl3::router

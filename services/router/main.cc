// exl3-router: the attention/router service. It runs the whole model (Generator: token ids in,
// tokens out) with its experts held in this process, or, with an expert map, on the expert workers
// through the router core, which it also serves to engines that run their own attention
// (MoeRouter).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/config/config_file.h"
#include "model/exl3_model.h"
#include "model/expert_map.h"
#include "model/model_file_watch.h"
#include "model/safetensors.h"
#include "services/common/flags.h"
#include "base/logging.h"
#include "services/common/memory_return.h"
#include "services/common/metrics.h"
#include "services/common/server.h"
#include "services/common/signals.h"
#include "services/router/generation.h"
#include "services/router/router_core.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json, router weights, shared experts)");
ABSL_FLAG(std::string, expert_map, "", "expert map YAML (docs/expert-map.md); SIGHUP reloads it");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "HOST:PORT of the MoeRouter gRPC service");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9451",
          "HOST:PORT of the Prometheus /metrics endpoint (empty: none)");
ABSL_FLAG(std::string, shared_expert, "local",
          "where the shared expert runs: local (the router's CPU), worker:NAME (that worker of "
          "the expert map, marked shared_expert: true, and its replicas) or none");
ABSL_FLAG(int64_t, default_deadline_ms, 10000,
          "deadline of a layer request that sets no timeout_us (0: none)");
ABSL_FLAG(int32_t, max_in_flight, 1024,
          "layer requests in flight across all streams; beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, shared_expert_threads, 2, "CPU threads running the local shared expert");
ABSL_FLAG(int32_t, gate_threads, 4,
          "CPU threads computing router logits (the gate reads the layer's whole router weight)");
ABSL_FLAG(int32_t, inline_max_tokens, 64,
          "requests of at most this many tokens are handled (gate, dispatch, local shared expert) "
          "on the gRPC thread that read them; larger ones on the handler threads");
ABSL_FLAG(int32_t, handler_threads, 2, "threads handling requests above --inline-max-tokens");
ABSL_FLAG(int64_t, max_tokens, 65536, "most tokens accepted in one layer request");
ABSL_FLAG(int32_t, max_message_bytes, 64 << 20,
          "largest request or answer, engine and worker side (above: RESOURCE_EXHAUSTED in-band; "
          "gRPC's own limit on the engine stream is twice this)");
ABSL_FLAG(int32_t, drain_grace_ms, 10000,
          "on SIGTERM: how long in-flight requests may take before the server stops");
ABSL_FLAG(int32_t, reconnect_backoff_max_ms, 2000, "longest wait between worker reconnects");
ABSL_FLAG(bool, worker_tls, false,
          "TLS to the workers (implied by --worker-tls-ca/--worker-tls-cert)");
ABSL_FLAG(std::string, worker_tls_ca, "", "PEM CA bundle that signed the workers' certificates");
ABSL_FLAG(std::string, worker_tls_cert, "", "PEM client certificate for mutual TLS to workers");
ABSL_FLAG(std::string, worker_tls_key, "", "PEM private key of --worker-tls-cert");
ABSL_FLAG(int, worker_shm_mb, 8,
          "workers on this host (same boot id, same user, same /dev/shm): carry the Forward stream "
          "through a shared-memory channel of this many MiB per direction (messages over a quarter "
          "of it still go by gRPC); 0: gRPC only");
ABSL_FLAG(int, shm_spin_us, 200,
          "how long a shared-memory reader spins for the worker's answer before sleeping");
ABSL_FLAG(int32_t, worker_liveness_ms, 1500,
          "a worker that answers no liveness probe (sent every quarter of this) and no request "
          "for this long is marked down and its requests failed over (0: no probes)");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, log_format, "text",
          "text (a level letter and UTC time, then the line) or json (one object per line, an "
          "event's fields as members)");
// The engine (Generator service).
ABSL_FLAG(std::string, generate, "auto",
          "run the whole model and serve Generator: true, false (needs --expert-map: MoeRouter "
          "only) or auto (true when the model directory holds the whole model; with an expert map "
          "and only MoE layers in the directory, MoeRouter only)");
ABSL_FLAG(std::string, served_model_name, "", "model name in DescribeModel (default: the directory's name)");
ABSL_FLAG(std::string, engine_device, "cpu",
          "where the model's forward pass runs: cpu, or cuda (GPU 0; GQA families; experts on the GPU "
          "without --expert-map; needs a build with the CUDA toolkit)");
ABSL_FLAG(int32_t, engine_threads, 0, "CPU threads of the model's forward pass (0: all)");
ABSL_FLAG(int32_t, generate_writer_threads, 1,
          "threads starting the Generate calls' gRPC writes after each step (a call's first "
          "tokens are written by the engine's loop at once)");
ABSL_FLAG(int32_t, micro_batches, 0,
          "run a step of two or more sequences as 1 or 2 micro-batches whose attention and MoE "
          "calls alternate (2 overlaps attention with the workers' round trip; it pays where "
          "attention does not share cores with the workers; on --engine-device cuda with "
          "--expert-map, one's exchange overlaps the other's attention on the GPU); 0: 1");
ABSL_FLAG(int64_t, kv_cache_tokens, 16384, "KV cache capacity in tokens (allocated at start)");
ABSL_FLAG(int64_t, kv_cache_bytes, 0, "KV cache capacity in bytes (overrides --kv-cache-tokens)");
ABSL_FLAG(int32_t, block_size, 16, "tokens per KV cache block");
ABSL_FLAG(int32_t, max_num_batched_tokens, 2048, "tokens of one engine step (decode + prefill chunks)");
ABSL_FLAG(int32_t, max_num_seqs, 256, "sequences running at once");
ABSL_FLAG(int32_t, sampling_threads, 0,
          "threads that sample the rows sampled on the host (every row on the CPU engine; constrained "
          "and prompt-logprob rows on the GPU engine); 0: half the cores, at most 8");
ABSL_FLAG(int32_t, long_prefill_token_threshold, 0,
          "largest prompt chunk of one step, so long prompts cannot starve decode (0: the token budget)");
ABSL_FLAG(bool, enable_prefix_caching, true, "share full KV blocks between prompts with the same prefix");
ABSL_FLAG(std::string, speculative_method, "off",
          "speculative decoding: off, ngram (draft the tokens that followed the latest earlier "
          "occurrence of the sequence's last n tokens) or mtp (draft with the checkpoint's MTP head: "
          "DeepSeek-V3 / GLM-4.5 layers.{num_hidden_layers}, CPU engine); verified exactly, greedy and "
          "sampled. Refused at start where the model cannot verify drafts or has no MTP head (docs/engine.md)");
ABSL_FLAG(int32_t, num_speculative_tokens, 0, "draft tokens per sequence and step (>= 1 with a method)");
ABSL_FLAG(int32_t, ngram_prompt_lookup_max, 0,
          "ngram: longest suffix matched (0: --ngram-prompt-lookup-min, or 5 when both are 0, as vLLM)");
ABSL_FLAG(int32_t, ngram_prompt_lookup_min, 0,
          "ngram: shortest suffix matched (0: --ngram-prompt-lookup-max, or 5 when both are 0, as vLLM)");
ABSL_FLAG(int32_t, speculative_disable_by_batch_size, 0,
          "no drafts in a step while more than this many sequences run (0: no limit; vLLM's name)");
ABSL_FLAG(std::string, speculative_draft_length, "fixed",
          "drafts per sequence and step: fixed (--num-speculative-tokens, or a request's own cap), "
          "adaptive (each sequence 1..that cap, shrinking while its drafts are rejected and growing back "
          "as they land: engine/speculative/draft_length.h) or goodput (each step 0..that cap per sequence, "
          "chosen for the most expected tokens per second under the step times measured so far, so "
          "drafts stop where their rows cost more than they yield, as at large batches: "
          "engine/speculative/goodput_draft_choice.h)");
ABSL_FLAG(int32_t, max_pending_requests, 1024,
          "Generate requests accepted and unfinished; beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, generate_timeout_ms, 600000,
          "deadline of a Generate request that sets no timeout_us and no gRPC deadline");

namespace exl3::router {
namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "exl3-router: %s\n", msg.c_str());
  return 2;
}

absl::StatusOr<std::unique_ptr<Generation>> StartGeneration(const std::string& model_dir,
                                                           const ConfigFile& config,
                                                           MoeRouterService* router,
                                                           int inline_max_tokens,
                                                           prometheus::Registry& registry) {
  GenerationOptions g;
  g.model_dir = model_dir;
  g.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  EXL3_ASSIGN_OR_RETURN(g.device, ParseEngineDevice(absl::GetFlag(FLAGS_engine_device)));
  g.threads = absl::GetFlag(FLAGS_engine_threads);
  g.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  g.inline_max_tokens = inline_max_tokens;
  g.writer_threads = absl::GetFlag(FLAGS_generate_writer_threads);
  g.default_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_generate_timeout_ms));
  engine::EngineOptions& e = g.engine;
  e.block_size = absl::GetFlag(FLAGS_block_size);
  if (absl::GetFlag(FLAGS_kv_cache_bytes) > 0) {
    e.kv_capacity = {engine::KvCacheCapacity::Unit::kBytes, absl::GetFlag(FLAGS_kv_cache_bytes)};
  } else {
    e.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens, absl::GetFlag(FLAGS_kv_cache_tokens)};
  }
  e.scheduler.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  e.scheduler.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  const int sampling_threads = absl::GetFlag(FLAGS_sampling_threads);
  if (sampling_threads < 0)
    return absl::InvalidArgumentError(absl::StrCat("--sampling-threads must be >= 0, not ", sampling_threads));
  e.sampling_threads = sampling_threads > 0 ? sampling_threads : engine::DefaultSamplingThreads();
  if (absl::GetFlag(FLAGS_long_prefill_token_threshold) > 0)
    e.scheduler.long_prefill_token_threshold = absl::GetFlag(FLAGS_long_prefill_token_threshold);
  e.scheduler.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  engine::SpeculativeOptions& spec = e.scheduler.speculative;
  EXL3_ASSIGN_OR_RETURN(spec.method, engine::ParseSpeculativeMethod(absl::GetFlag(FLAGS_speculative_method)));
  spec.num_speculative_tokens = absl::GetFlag(FLAGS_num_speculative_tokens);
  if (absl::GetFlag(FLAGS_ngram_prompt_lookup_max) != 0)
    spec.prompt_lookup_max = absl::GetFlag(FLAGS_ngram_prompt_lookup_max);
  if (absl::GetFlag(FLAGS_ngram_prompt_lookup_min) != 0)
    spec.prompt_lookup_min = absl::GetFlag(FLAGS_ngram_prompt_lookup_min);
  spec.disable_by_batch_size = absl::GetFlag(FLAGS_speculative_disable_by_batch_size);
  EXL3_ASSIGN_OR_RETURN(spec.draft_length,
                        engine::ParseDraftLengthPolicy(absl::GetFlag(FLAGS_speculative_draft_length)));
  EXL3_RETURN_IF_ERROR(engine::ValidateSpeculativeOptions(spec));
  e.max_pending_requests = absl::GetFlag(FLAGS_max_pending_requests);
  return Generation::Start(g, config, router, registry);
}

int Main() {
  exl3::LogLevel level;
  if (!exl3::ParseLogLevel(absl::GetFlag(FLAGS_log_level).c_str(), &level)) {
    return Fail("--log-level must be debug, info, warning or error");
  }
  exl3::SetLogLevel(level);
  exl3::LogFormat format;
  if (!exl3::ParseLogFormat(absl::GetFlag(FLAGS_log_format).c_str(), &format)) {
    return Fail("--log-format must be text or json");
  }
  exl3::SetLogFormat(format);
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string map_path = absl::GetFlag(FLAGS_expert_map);
  if (model_dir.empty()) return Fail("--model DIR is required");
  const std::string generate = absl::GetFlag(FLAGS_generate);
  if (generate != "auto" && generate != "true" && generate != "false")
    return Fail("--generate must be auto, true or false");
  if (map_path.empty() && generate == "false") return Fail("--generate=false needs --expert-map FILE");
  const std::string shared = absl::GetFlag(FLAGS_shared_expert);
  RouterOptions ropt;
  if (shared == "local") {
    ropt.shared_expert_local = true;
  } else if (shared == "none") {
    ropt.shared_expert_local = false;
  } else if (shared.rfind("worker:", 0) == 0 && shared.size() > 7) {
    ropt.shared_expert_local = false;
    ropt.shared_expert_worker = shared.substr(7);
  } else {
    return Fail("--shared-expert must be local, worker:NAME or none");
  }
  ropt.default_deadline_ms = absl::GetFlag(FLAGS_default_deadline_ms);
  ropt.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  ropt.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  ropt.shared_expert_threads = std::max(1, absl::GetFlag(FLAGS_shared_expert_threads));
  ropt.gate_threads = std::max(1, absl::GetFlag(FLAGS_gate_threads));
  ropt.inline_max_tokens = std::max(0, absl::GetFlag(FLAGS_inline_max_tokens));
  ropt.handler_threads = std::max(1, absl::GetFlag(FLAGS_handler_threads));
  if (ropt.max_in_flight < 1) return Fail("--max-in-flight must be at least 1");

  RouterCoreOptions copt;
  copt.model_dir = model_dir;
  copt.expert_map_path = map_path;
  copt.router = ropt;
  copt.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  copt.reconnect_backoff_max_ms = absl::GetFlag(FLAGS_reconnect_backoff_max_ms);
  if (absl::GetFlag(FLAGS_worker_shm_mb) < 0 || absl::GetFlag(FLAGS_shm_spin_us) < 0) {
    return Fail("--worker-shm-mb and --shm-spin-us must be >= 0");
  }
  copt.worker_shm_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_worker_shm_mb)) << 20;
  copt.shm_spin_us = absl::GetFlag(FLAGS_shm_spin_us);
  copt.worker_liveness_ms = absl::GetFlag(FLAGS_worker_liveness_ms);
  if (copt.worker_liveness_ms < 0) return Fail("--worker-liveness-ms must be >= 0");
  copt.worker_tls.ca_file = absl::GetFlag(FLAGS_worker_tls_ca);
  copt.worker_tls.cert_file = absl::GetFlag(FLAGS_worker_tls_cert);
  copt.worker_tls.key_file = absl::GetFlag(FLAGS_worker_tls_key);
  copt.worker_tls.enabled = absl::GetFlag(FLAGS_worker_tls) || !copt.worker_tls.ca_file.empty() ||
                            !copt.worker_tls.cert_file.empty();
  auto metrics_ep = svc::MetricsEndpoint::Start(absl::GetFlag(FLAGS_metrics_listen));
  if (!metrics_ep.ok()) return Fail(std::string(metrics_ep.status().message()));
  // config.json, read once: the router core's model and the engine both start from this read.
  absl::StatusOr<ConfigFile> config = ConfigFile::Read(model_dir + "/config.json");
  if (!config.ok()) return Fail(std::string(config.status().message()));
  // With a map: model, expert map, worker pool (connecting in the background), metrics, service.
  std::unique_ptr<RouterCore> core;
  if (!map_path.empty()) {
    auto created = RouterCore::Create(copt, *config, (*metrics_ep)->registry());
    if (!created.ok()) return Fail(std::string(created.status().message()));
    core = std::move(*created);
  }
  std::mutex server_mu;
  svc::GrpcServer* server_ptr = nullptr;
  // Readiness follows the workers: the health service serves only while the core is ready.
  if (core) {
    core->SetReadyListener([&](bool ready) {
      std::lock_guard<std::mutex> l(server_mu);
      if (server_ptr) server_ptr->SetServing(ready);
    });
  }
  std::unique_ptr<Generation> generation;
  if (generate != "false") {
    auto started = StartGeneration(model_dir, *config, core ? &core->service() : nullptr,
                                   ropt.inline_max_tokens, (*metrics_ep)->registry());
    if (started.ok()) {
      generation = std::move(*started);
    } else if (generate == "auto" && core && absl::GetFlag(FLAGS_speculative_method) == "off") {
      // (Asked for speculative decoding, the model was meant to run: its refusal ends the start.)
      exl3::LogInfo("not running the model (serving MoeRouter only): %s",
                   std::string(started.status().message()).c_str());
    } else {
      return Fail(std::string(started.status().message()));
    }
  }

  svc::ServerConfig scfg;
  scfg.listen = absl::GetFlag(FLAGS_listen);
  auto tls = svc::ServerTlsFromFlags();
  if (!tls.ok()) return Fail(std::string(tls.status().message()));
  scfg.tls = *tls;
  // gRPC's own limit is twice --max-message-bytes: a request (or answer) between the two is
  // answered in-band with RESOURCE_EXHAUSTED by the service and the stream goes on
  // (docs/protocol.md, "Streams, ids and errors").
  const int hard = static_cast<int>(
      std::min<int64_t>(2 * static_cast<int64_t>(absl::GetFlag(FLAGS_max_message_bytes)), INT32_MAX));
  scfg.max_receive_bytes = hard;
  scfg.max_send_bytes = hard;
  if (core) {
    scfg.services.push_back(&core->service());
    scfg.health_names.push_back("exl3serve.v1.MoeRouter");
  }
  if (generation) {
    scfg.services.push_back(&generation->service());
    scfg.health_names.push_back("exl3serve.v1.Generator");
  }
  auto server = svc::GrpcServer::Start(scfg);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  {
    std::lock_guard<std::mutex> l(server_mu);
    server_ptr = server->get();
  }
  if (core) {
    core->UpdateReady();
  } else {
    (*server)->SetServing(true);  // experts held here: ready once loaded
  }
  // The bound ports, not the flags: with port 0 the log is how a supervisor finds them.
  const std::string metrics_flag = absl::GetFlag(FLAGS_metrics_listen);
  const std::string metrics_at =
      (*metrics_ep)->port() == 0
          ? std::string("(none)")
          : absl::StrCat(metrics_flag.substr(0, metrics_flag.rfind(':')), ":",
                         (*metrics_ep)->port());
  exl3::LogInfo("exl3-router listening on %s (%s), metrics on %s, %s",
               (*server)->address().c_str(), scfg.tls.enabled() ? (scfg.tls.require_client_cert ? "mTLS" : "TLS") : "plaintext",
               metrics_at.c_str(),
               core ? absl::StrCat(core->map().workers.size(), " workers in ", map_path).c_str()
                    : "experts held in this process");
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  // Large requests' buffers go back to the kernel after them (services/common/memory_return.h).
  svc::MemoryReturner memory_returner(svc::MemoryReturnOptions{});

  // The weights this process reads live in memory it owns (TensorResidency::kOwned): a model file
  // changed from now on is logged, and the router goes on from its copy.
  std::optional<ModelFileWatch> file_watch;
  if (auto files = TensorSource::Open(model_dir); files.ok()) file_watch.emplace((*files)->Files());
  auto check_model_files = [&] {
    if (!file_watch) return;
    for (const ModelFileWatch::Change& c : file_watch->Check()) {
      exl3::LogWarning("model file %s changed after the load: %s; serving on from the copy made at "
                      "load (restart the router to load the new file)",
                      c.file.c_str(), c.what.c_str());
    }
  };

  // Signals: SIGTERM/SIGINT drain (ShutdownSignals); SIGHUP reloads the expert map.
  std::mutex mu;
  std::condition_variable cv;
  int shutdown_count = 0;
  std::atomic<bool> stop_hup{false};
  std::thread hup_thread([&] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGHUP);
    for (int wakeups = 0; !stop_hup; ++wakeups) {
      if (wakeups % 5 == 0) check_model_files();  // about once a second
      timespec ts{0, 200 * 1000 * 1000};
      if (sigtimedwait(&set, nullptr, &ts) != SIGHUP) continue;
      if (!core) {
        exl3::LogInfo("SIGHUP: no expert map to reload");
        continue;
      }
      exl3::LogInfo("SIGHUP: reloading expert map %s", map_path.c_str());
      absl::Status st = core->ReloadMap();
      if (!st.ok()) {
        exl3::LogError("reload refused, previous map stays in force: %s",
                      std::string(st.message()).c_str());
        continue;
      }
      exl3::LogInfo("expert map reloaded: %d workers", core->service().pool()->num_workers());
    }
  });

  auto signals = svc::ShutdownSignals::Install([&](int, int count) {
    std::lock_guard<std::mutex> l(mu);
    shutdown_count = count;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return shutdown_count > 0; });
  }
  const auto grace = std::chrono::milliseconds(absl::GetFlag(FLAGS_drain_grace_ms));
  const auto deadline = std::chrono::steady_clock::now() + grace;
  exl3::LogInfo("draining, grace %d ms", absl::GetFlag(FLAGS_drain_grace_ms));
  (*server)->SetServing(false);
  // Generation first: its requests still need the router core's MoE layers.
  const int generations_cut = generation ? generation->Drain(grace) : 0;
  int left = 0;
  if (core) {
    core->StartDrain();
    while (std::chrono::steady_clock::now() < deadline) {
      if (core->service().WaitIdle(std::chrono::milliseconds(50))) break;
      std::lock_guard<std::mutex> l(mu);
      if (shutdown_count > 1) break;  // second signal: stop now
    }
    left = core->service().in_flight();
  }
  (*server)->Shutdown(absl::Milliseconds(500));
  {
    std::lock_guard<std::mutex> l(server_mu);
    server_ptr = nullptr;
  }
  stop_hup = true;
  hup_thread.join();
  generation.reset();
  if (core) {
    core->SetReadyListener(nullptr);
    core->Stop();
  }
  if (generations_cut + left > 0) {
    exl3::LogWarning("drain cut short: %d generation requests ended UNAVAILABLE, %d MoE requests "
                    "still in flight; exiting with status 1",
                    generations_cut, left);
    return 1;
  }
  exl3::LogInfo("drained (0 requests still in flight at the end); exiting");
  return 0;
}

}  // namespace
}  // namespace exl3::router

int main(int argc, char** argv) {
  // Before any thread exists: SIGHUP is taken by the reload thread (sigtimedwait), so it must be
  // blocked everywhere. (SIGTERM/SIGINT are blocked by ShutdownSignals::Install... which must also
  // run before threads: block them here too.)
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  exl3::svc::ParseServiceFlags(argc, argv,
      "exl3-router --model DIR [--expert-map FILE] [--listen HOST:PORT] [flags]\n"
      "The attention/router service: runs the whole model (Generator: token ids in, tokens out),\n"
      "with the experts held in this process, or with --expert-map on the expert workers: it then\n"
      "gates each MoE layer's tokens, fans out to the workers, combines their partial sums with the\n"
      "shared expert, and serves the same per layer (MoeRouter) to engines with their own attention.\n"
      "SIGTERM drains, SIGHUP reloads the map.\n"
      "Flags may be written with dashes or underscores (--max-in-flight = --max_in_flight).");
  return exl3::router::Main();
}

// exl3-worker: serves the routed experts it holds of an EXL3 MoE model over gRPC
// (exl3serve.v1.ExpertWorker, docs/protocol.md), with Prometheus metrics (docs/metrics.md).
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/synchronization/notification.h"
#include "services/common/flags.h"
#include "base/logging.h"
#include "services/common/memory_return.h"
#include "services/common/server.h"
#include "services/common/signals.h"
#include "services/expert_worker/worker_server.h"

ABSL_FLAG(std::string, model, "", "EXL3 model directory (config.json + *.safetensors)");
ABSL_FLAG(std::string, experts, "",
          "experts to hold in every MoE layer: ranges such as \"0-7,12\" or \"all\"");
ABSL_FLAG(std::string, expert_map, "", "expert map YAML (docs/expert-map.md); needs --worker");
ABSL_FLAG(std::string, worker, "", "this worker's name in --expert-map");
ABSL_FLAG(bool, shared_expert, false,
          "also hold the model's shared expert of every MoE layer, for a router started with "
          "--shared-expert worker:NAME (the map entry's `shared_expert: true` does the same); "
          "alone, without --experts/--expert-map: only the shared expert");
ABSL_FLAG(std::string, listen, "127.0.0.1:50061",
          "gRPC HOST:PORT (plaintext is meant for loopback; use --tls-* elsewhere)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9461",
          "Prometheus /metrics HOST:PORT (empty: no endpoint)");
ABSL_FLAG(std::string, backend, "auto", "compute backend: auto, cpu or cuda");
ABSL_FLAG(int, device, 0, "CUDA device index (with --backend cuda/auto)");
ABSL_FLAG(std::string, weights_residency, "auto",
          "CUDA backend: where the weights live. device: copied into device memory; host: used in "
          "place from registered (pinned, mapped) host memory, what unified-memory GPUs (GB10) "
          "want; auto: host on integrated GPUs, device elsewhere");
ABSL_FLAG(int, threads, 0, "CPU compute threads (0: all hardware threads)");
ABSL_FLAG(int, load_threads, 8, "threads reading the experts' bytes at start");
ABSL_FLAG(bool, mlock, true, "CPU backend: lock the held weights in RAM (needs RLIMIT_MEMLOCK)");
ABSL_FLAG(bool, progress, true, "progress bar on stderr while loading (with --log-format text)");
ABSL_FLAG(bool, load_benchmark, false,
          "before loading, time a plain parallel read of the same bytes (page cache dropped) "
          "and log the load speed as a fraction of it");
ABSL_FLAG(int, batch_window_us, 0,
          "how long a batch waits for more requests of its layer; 0: work-conserving (a batch "
          "starts as soon as the backend is free, requests arriving meanwhile form the next)");
ABSL_FLAG(int, inline_max_tokens, 64,
          "CPU backend: a request of at most this many tokens that finds the backend idle and "
          "nothing queued is computed on the thread that received it (0: always hand off to the "
          "batcher thread); only with --batch-window-us 0");
ABSL_FLAG(int, max_batch_tokens, 4096, "most tokens in one batch");
ABSL_FLAG(int, max_queue, 1024,
          "most requests waiting to be batched; more are answered RESOURCE_EXHAUSTED");
ABSL_FLAG(int, long_prefill_token_threshold, 1024,
          "requests with more tokens are cut into chunks of this many, interleaved with small "
          "requests so prefill never starves decode");
ABSL_FLAG(int, prefill_chunk_us, 0,
          "while decode requests are being served, size prefill chunks to take about this much "
          "compute (0: as long as a recent decode batch took)");
ABSL_FLAG(uint64_t, max_message_bytes, 64u << 20,
          "largest request/response message; larger requests are answered RESOURCE_EXHAUSTED "
          "(gRPC itself drops the stream above twice this)");
ABSL_FLAG(bool, shm, true,
          "accept a same-host router's shared-memory channel for its Forward stream (same user, "
          "same /dev/shm); with false every message goes through gRPC");
ABSL_FLAG(int, shm_spin_us, 500,
          "how long the shared-memory reader spins for the next request before sleeping (higher: "
          "lower latency, more CPU while idle)");
ABSL_FLAG(double, drain_timeout_s, 30, "on SIGTERM: how long to wait for in-flight requests");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, log_format, "text",
          "text (a level letter and UTC time, then the line) or json (one object per line, an "
          "event's fields as members)");

int main(int argc, char** argv) {
  // Before any thread exists: SIGTERM/SIGINT go to the watcher thread.
  absl::Notification stop;
  std::atomic<bool> stop_requested{false};
  auto request_stop = [&] {
    if (!stop_requested.exchange(true)) stop.Notify();  // Notify must run exactly once
  };
  auto signals = exl3::svc::ShutdownSignals::Install([&](int, int count) {
    if (count >= 2) {
      std::fprintf(stderr, "exl3-worker: second signal, exiting without draining\n");
      std::_Exit(1);
    }
    request_stop();
  });

  exl3::svc::ParseServiceFlags(argc, argv,
      "serves the routed experts it holds of an EXL3 MoE model over gRPC.\n"
      "  exl3-worker --model DIR --experts 0-31 [--listen 127.0.0.1:50061]\n"
      "  exl3-worker --model DIR --expert-map map.yaml --worker w0\n"
      "  exl3-worker --model DIR --shared-expert            (the shared expert only)\n"
      "Flags may be written with dashes or underscores (--max-queue = --max_queue).");
  using namespace exl3;
  exl3::LogLevel level;
  if (!exl3::ParseLogLevel(absl::GetFlag(FLAGS_log_level).c_str(), &level)) {
    std::fprintf(stderr, "exl3-worker: --log-level must be debug, info, warning or error\n");
    return 2;
  }
  exl3::SetLogLevel(level);
  exl3::LogFormat format;
  if (!exl3::ParseLogFormat(absl::GetFlag(FLAGS_log_format).c_str(), &format)) {
    std::fprintf(stderr, "exl3-worker: --log-format must be text or json\n");
    return 2;
  }
  exl3::SetLogFormat(format);

  worker::WorkerOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.experts = absl::GetFlag(FLAGS_experts);
  o.expert_map = absl::GetFlag(FLAGS_expert_map);
  o.worker_name = absl::GetFlag(FLAGS_worker);
  o.shared_expert = absl::GetFlag(FLAGS_shared_expert);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.device = absl::GetFlag(FLAGS_device);
  o.weights_residency = absl::GetFlag(FLAGS_weights_residency);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.load_threads = absl::GetFlag(FLAGS_load_threads);
  o.lock_memory = absl::GetFlag(FLAGS_mlock);
  o.progress = absl::GetFlag(FLAGS_progress) && format == exl3::LogFormat::kText;
  o.load_benchmark = absl::GetFlag(FLAGS_load_benchmark);
  o.batch_window_us = absl::GetFlag(FLAGS_batch_window_us);
  o.inline_max_tokens = absl::GetFlag(FLAGS_inline_max_tokens);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_queue = absl::GetFlag(FLAGS_max_queue);
  o.long_prefill_token_threshold = absl::GetFlag(FLAGS_long_prefill_token_threshold);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  std::atomic<bool> backend_lost{false};
  o.on_fatal = [&](const absl::Status&) {
    backend_lost = true;
    request_stop();
  };
  o.shm = absl::GetFlag(FLAGS_shm);
  o.shm_spin_us = absl::GetFlag(FLAGS_shm_spin_us);
  o.prefill_chunk_us = absl::GetFlag(FLAGS_prefill_chunk_us);
  absl::StatusOr<svc::ServerTls> tls = svc::ServerTlsFromFlags();
  if (!tls.ok()) {
    std::fprintf(stderr, "exl3-worker: %s\n", std::string(tls.status().message()).c_str());
    return 2;
  }
  o.tls = *tls;
  // Large requests' buffers go back to the kernel after them (services/common/memory_return.h).
  svc::MemoryReturner memory_returner(svc::MemoryReturnOptions{});

  absl::StatusOr<std::unique_ptr<worker::WorkerServer>> w = worker::WorkerServer::Create(o);
  if (!w.ok()) {
    std::fprintf(stderr, "exl3-worker: %s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  // Load in the background so a SIGTERM during loading is honoured promptly.
  absl::Status load_status;
  absl::Notification loaded;
  std::thread loader([&] {
    load_status = (*w)->Load();
    loaded.Notify();
    if (!load_status.ok()) request_stop();
  });
  stop.WaitForNotification();
  if (loaded.HasBeenNotified() && !load_status.ok()) {
    loader.join();
    std::fprintf(stderr, "exl3-worker: loading failed: %s\n",
                 std::string(load_status.message()).c_str());
    return 1;
  }
  (*w)->BeginDrain();
  loader.join();  // loading is not interruptible; it ends with the worker draining
  const bool clean = (*w)->Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s)));
  w->reset();
  if (backend_lost) return 3;  // restart me: the device is unusable from this process
  return clean ? 0 : 1;
}

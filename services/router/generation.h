// What exl3-router adds to run the whole model (the attention/router service): the CPU model
// (engine/cpu/cpu_model.h) whose MoE blocks run in this process (no expert map) or on the workers
// through this process's router core, the engine (engine/core/engine.h), its metrics and the Generator
// gRPC service.
//
//   GenerationOptions o; o.model_dir = dir;                   // flags of exl3-router
//   EXL3_ASSIGN_OR_RETURN(ConfigFile config, ConfigFile::Read(dir + "/config.json"));
//   auto gen = Generation::Start(o, config, /*router=*/nullptr, registry);   // experts held here
//   scfg.services.push_back(&(*gen)->service());
//   ... on SIGTERM: (*gen)->Drain(grace);
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"
#include "engine/core/engine.h"
#include "model/config/config_file.h"
#include "model/safetensors.h"
#include "prometheus/registry.h"
#include "services/common/task_queue.h"
#include "services/router/engine_metrics.h"
#include "services/router/generator_service.h"
#include "services/router/moe_router.h"

namespace exl3::router {

enum class EngineDevice { kCpu, kCuda };
// "cpu" or "cuda"; anything else is an InvalidArgument naming both.
absl::StatusOr<EngineDevice> ParseEngineDevice(std::string_view name);

struct GenerationOptions {
  std::string model_dir;
  EngineDevice device = EngineDevice::kCpu;  // where the forward pass runs
  std::string served_model_name;  // empty: the directory's base name
  int threads = 0;                // CPU threads of the model (0: all)
  int micro_batches = 0;          // 1 or 2 (engine/cpu/cpu_model.h, engine/cuda/cuda_model.h); 0: 1
  // The CPU model's weights: kOwned moves them out of the file mappings as they load
  // (model/safetensors.h), so a model file truncated under the router cannot crash it.
  TensorResidency residency = TensorResidency::kOwned;
  engine::EngineOptions engine;
  std::chrono::milliseconds default_timeout{600000};
  std::chrono::milliseconds moe_timeout{30000};  // one MoE layer through the router core
  int inline_max_tokens = 64;
  int writer_threads = 1;  // threads starting the Generate calls' writes (generator_service.h)
};

class Generation {
 public:
  // `router` null: the experts are loaded and run in this process. Else MoE layers go through
  // it (it must outlive this object). Loads the model, allocates the KV cache, starts the engine.
  // `config`: options.model_dir's config.json as the caller read it (the same read its router
  // core opened the model from); the file is not read again.
  static absl::StatusOr<std::unique_ptr<Generation>> Start(const GenerationOptions& options,
                                                           const ConfigFile& config,
                                                           MoeRouterService* router,
                                                           prometheus::Registry& registry);
  ~Generation();  // Stop()

  GeneratorService& service() { return *service_; }
  engine::Engine& engine() { return *engine_; }
  // Refuses new requests and waits up to `grace` for those running; the rest end UNAVAILABLE
  // ("server draining"). Returns how many were cut short that way.
  int Drain(std::chrono::milliseconds grace);
  void Stop();

 private:
  Generation() = default;
  // The Generator's writer threads, woken by the engine after each pass's events; declared first,
  // so that it outlives the engine and the service.
  std::unique_ptr<svc::TaskQueue> writer_;
  std::unique_ptr<GenerateStreams> streams_;  // flushed by the engine's loop: outlives it too
  std::unique_ptr<EngineMetrics> metrics_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<GeneratorService> service_;
  std::atomic<bool> stop_refresh_{false};
  std::thread refresh_;
};

}  // namespace exl3::router

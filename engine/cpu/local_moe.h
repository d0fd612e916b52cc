// MoE blocks run in this process on the CPU: the model's gate (model/routing.h), then the CPU
// backend's expert MLPs and shared expert (kernels/cpu/cpu_backend.h) on every expert of the model.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/core/moe_executor.h"
#include "model/config/config_file.h"
#include "model/exl3_model.h"

namespace exl3::engine {

class LocalMoe final : public MoeExecutor {
 public:
  // Loads every routed and shared expert of `dir`. `compute` must outlive this.
  static absl::StatusOr<std::unique_ptr<LocalMoe>> Open(
      const std::string& dir, CpuCompute& compute,
      TensorResidency residency = TensorResidency::kMapped);
  // `config`: dir's config.json as the caller read it (ConfigFile::Read(dir)), not read again.
  static absl::StatusOr<std::unique_ptr<LocalMoe>> Open(
      const std::string& dir, const ConfigFile& config, CpuCompute& compute,
      TensorResidency residency = TensorResidency::kMapped);
  absl::Status Forward(int layer, const float* x, int num_tokens, const int32_t* token_ids,
                       float* y) override;
  // The experts the caller chose (no gate here: a hash-routed layer needs no token ids).
  std::unique_ptr<MoeCall> StartRouted(int layer, const float* x, int num_tokens, const MoeRouting& routing,
                                       float* y) override;
  MoeStageTimes TakeStageTimes() override;
  const Exl3Model& model() const { return *model_; }

 private:
  LocalMoe(std::unique_ptr<Exl3Model> model, CpuCompute& compute)
      : model_(std::move(model)), compute_(compute) {}
  std::unique_ptr<Exl3Model> model_;
  CpuCompute& compute_;
  MoeStageTimes times_;  // since the last TakeStageTimes (Forward runs on the caller's thread)
};

}  // namespace exl3::engine

// A CUDA model's MoE layers: the gate on this GPU (router logits through cuBLAS, then the top-k
// on the device, or a hash-routed layer's table lookup), then the experts either in process
// (kernels/cuda/cuda_backend.h's fused MoE kernels, in pieces of max_moe_tokens rows) or on expert
// workers behind a MoeExecutor (engine/cuda/remote_moe_exchange.h: the micro-batch's hidden states
// and top-k out, the answer back; with two micro-batches one's exchange runs while the other's
// attention does). The layer loop is the same either way: Run, then Finish once in_flight.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/remote_moe_exchange.h"
#include "engine/cuda/step_facts.h"
#include "engine/cuda/weight_bytes.h"
#include "engine/core/micro_batches.h"
#include "engine/config/model_config.h"
#include "engine/core/moe_executor.h"
#include "model/exl3_model.h"

namespace exl3::engine::cuda {

// One MoE layer's gate and, in process, its experts on this GPU.
struct CudaMoeLayer {
  int layer = 0;
  CudaLinear router;                // [E, hidden] fp32
  DeviceArray<float> bias;          // correction bias [E] or empty
  DeviceArray<int32_t> hash_table;  // hash-routed layers: tid2eid [vocab, top_k]; else empty
  std::unique_ptr<exl3::cuda::DeviceMoeLayer> experts;  // null with remote experts
};

class CudaMoe {
 public:
  struct Options {
    int max_moe_tokens = 2048;  // rows of the in-process kernels' workspace
    int micro_batches = 1;      // remote experts: 1 or 2
  };
  // `remote` null: the experts are in process.
  static absl::StatusOr<std::unique_ptr<CudaMoe>> Create(const ModelConfig& cfg, std::unique_ptr<MoeExecutor> remote,
                                                         const Options& options, const CudaLinearContext& linear);
  // Layer `layer`'s gate and, in process, its experts, from `experts` (the model's EXL3 view).
  absl::StatusOr<CudaMoeLayer> LoadLayer(const Exl3Model& experts, int layer, CudaWeightBytes* bytes);
  // A layer outside `experts`' (the MTP layer, engine/cuda/cuda_mtp_head.h): its router [E, hidden]
  // and correction bias [E] (or null) fp32, and its experts; in process only (no hash routing).
  absl::StatusOr<CudaMoeLayer> LoadLayer(int layer, const float* router, const float* bias, const MoeLayerView& view,
                                         CudaWeightBytes* bytes);

  bool remote() const { return exchange_ != nullptr; }
  int micro_batches() const { return micro_batches_; }
  // For steps of `rows` rows; *moved: an address changed.
  absl::Status Reserve(int rows, bool* moved);
  // A step's start with its micro-batches (remote experts: grows the exchange's staging).
  absl::Status BeginStep(const std::vector<MicroBatchRange>& micro_batches);
  // Rows [first, first + n) of x through `moe`: in process, their output into the same rows of d
  // now; remote, sent out as micro-batch m (host_token_ids: the step's, or null) until Finish.
  absl::Status Run(const CudaMoeLayer& moe, const CudaStep& step, int m, int first, int n, const float* x, float* d,
                   const int32_t* host_token_ids);
  bool in_flight(int m) const { return exchange_ != nullptr && exchange_->in_flight(m); }
  // Micro-batch m's answer into its rows of d (starting at row `first`); the stream waits for it.
  absl::Status Finish(int m, int first, float* d);
  // The last step's exchanges (remote experts; else empty), once its work is done.
  absl::StatusOr<RemoteExchangeTimes> StepTimes();

 private:
  CudaMoe(const ModelConfig& cfg, const CudaLinearContext& linear) : cfg_(cfg), linear_(linear) {}
  // The gate of `moe` for rows [first, first + n) of x: their top-k into topk_ids_ / topk_weights_.
  absl::Status Route(const CudaMoeLayer& moe, const CudaStep& step, int first, int n, const float* x);
  // The in-process experts of `view` onto the device as moe->experts.
  absl::Status UploadExperts(const MoeLayerView& view, CudaMoeLayer* moe, CudaWeightBytes* bytes);

  const ModelConfig& cfg_;
  CudaLinearContext linear_;
  GateConfig gate_;
  int max_moe_tokens_ = 0;
  int micro_batches_ = 1;
  std::unique_ptr<exl3::cuda::MoeRunner> runner_;  // in process
  std::unique_ptr<MoeExecutor> remote_;
  std::unique_ptr<RemoteMoeExchange> exchange_;  // with remote_
  DeviceArray<float> router_logits_, topk_weights_;
  DeviceArray<int32_t> topk_ids_;
};

}  // namespace exl3::engine::cuda

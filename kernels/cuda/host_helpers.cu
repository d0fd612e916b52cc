// Host-memory conveniences for tools: LinearForwardHost, MoeForwardHost (cuda_backend.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {
namespace {

// Device buffer freed on scope exit.
struct Scoped {
  void* p = nullptr;
  ~Scoped() {
    if (p) cudaFree(p);
  }
};

absl::Status Put(Scoped* s, const void* src, size_t bytes) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->p, std::max<size_t>(bytes, 16)));
  if (src) EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(s->p, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearForwardHost(const Exl3LinearView& host_w, const float* x, int m, float* y, Path path) {
  if (DeviceCount() == 0) return absl::FailedPreconditionError("no CUDA device");
  auto dev = DeviceLinear::Upload(host_w);
  if (!dev.ok()) return dev.status();
  const size_t xb = static_cast<size_t>(m) * host_w.in_features * 4, yb = static_cast<size_t>(m) * host_w.out_features * 4;
  Scoped dx, dy;
  EXL3_RETURN_IF_ERROR(Put(&dx, x, xb));
  EXL3_RETURN_IF_ERROR(Put(&dy, nullptr, yb));
  Workspace ws;
  EXL3_RETURN_IF_ERROR(LinearForward((*dev)->view(), static_cast<const float*>(dx.p), m, static_cast<float*>(dy.p),
                                     &ws, nullptr, path));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(y, dy.p, yb, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status MoeForwardHost(const MoeLayerView& host_layer, const float* x, const MoeAssignments& a,
                            bool include_shared, float* y, Path path) {
  if (DeviceCount() == 0) return absl::FailedPreconditionError("no CUDA device");
  EXL3_RETURN_IF_ERROR(ValidateAssignments(host_layer, a));
  const int T = a.num_tokens;
  if (T == 0) return absl::OkStatus();
  int k = 1;
  for (int t = 0; t < T; ++t) k = std::max(k, a.end(t) - a.begin(t));
  std::vector<int32_t> ids(static_cast<size_t>(T) * k, -1);
  std::vector<float> w(ids.size(), 0.f);
  for (int t = 0; t < T; ++t)
    for (int i = a.begin(t); i < a.end(t); ++i) {
      ids[static_cast<size_t>(t) * k + (i - a.begin(t))] = a.expert_ids[i];
      w[static_cast<size_t>(t) * k + (i - a.begin(t))] = a.weights[i];
    }
  auto layer = DeviceMoeLayer::Upload(host_layer);
  if (!layer.ok()) return layer.status();
  auto runner = MoeRunner::Create(**layer, T, k, path);
  if (!runner.ok()) return runner.status();
  const size_t xb = static_cast<size_t>(T) * host_layer.hidden_size * 4;
  Scoped dx, dy;
  EXL3_RETURN_IF_ERROR(Put(&dx, x, xb));
  EXL3_RETURN_IF_ERROR(Put(&dy, nullptr, xb));
  EXL3_RETURN_IF_ERROR((*runner)->ForwardHostRouting(static_cast<const float*>(dx.p), T, ids.data(), w.data(),
                                                     static_cast<float*>(dy.p), nullptr, include_shared));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(y, dy.p, xb, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace exl3::cuda

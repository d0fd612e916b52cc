#include "engine/cuda/decode_graphs.h"

#include <cuda_runtime.h>

#include <iterator>
#include <string>

#include "base/logging.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

// Batch sizes decode graphs are captured for; a step runs in the smallest that holds it.
constexpr int kBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64};
static_assert(kBuckets[std::size(kBuckets) - 1] == DecodeGraphs::kMaxRows);

size_t BucketIndex(int batch) {
  size_t i = 0;
  while (kBuckets[i] < batch) ++i;
  return i;
}

void Destroy(DecodeGraph& g) {
  if (g.exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
  g.exec = nullptr;
}

}  // namespace

int DecodeGraphs::GraphRows(int sequences, int tokens_per_sequence) const {
  if (sequences < 1 || tokens_per_sequence < 1) return 0;
  if (tokens_per_sequence == 1) return sequences <= kMaxRows ? kBuckets[BucketIndex(sequences)] : 0;
  if (!verify_steps_ || tokens_per_sequence > kMaxVerifyTokens || sequences > kMaxVerifySequences) return 0;
  return sequences * tokens_per_sequence;
}

DecodeGraph& DecodeGraphs::Get(int sequences, int tokens_per_sequence, int table_ints, uint64_t workspace_allocations) {
  const int rows = GraphRows(sequences, tokens_per_sequence);
  int stride = 16;
  while (stride < table_ints) stride *= 2;
  std::unique_ptr<DecodeGraph>& slot = graphs_[{rows, tokens_per_sequence}];
  // A longer context than it was made for, or a step since its capture grew the kernels'
  // workspace (a long prompt's chunk): its launches would use the freed buffers.
  if (slot != nullptr && (slot->table_stride < stride || slot->workspace_allocations != workspace_allocations)) {
    Destroy(*slot);
    slot.reset();
  }
  if (slot == nullptr) {
    slot = std::make_unique<DecodeGraph>();
    slot->rows = rows;
    slot->table_stride = stride;
  }
  return *slot;
}

absl::Status DecodeGraphs::Capture(DecodeGraph& g, StreamHandle handle, const std::function<absl::Status()>& launches) {
  cudaStream_t stream = static_cast<cudaStream_t>(handle);
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  const absl::Status run = launches();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  cudaError_t inst = cudaErrorUnknown;
  if (run.ok() && end == cudaSuccess) inst = cudaGraphInstantiate(&exec, graph, 0);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();  // a failed capture leaves its error behind
  if (!run.ok() || end != cudaSuccess || inst != cudaSuccess) {
    LogWarning("CUDA engine: step graph capture for %d rows failed (%s); running without graphs", g.rows,
               !run.ok() ? std::string(run.message()).c_str() : cudaGetErrorString(end != cudaSuccess ? end : inst));
    enabled_ = false;
    return absl::OkStatus();
  }
  g.exec = exec;
  return absl::OkStatus();
}

absl::Status DecodeGraphs::Replay(const DecodeGraph& g, StreamHandle stream) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec), static_cast<cudaStream_t>(stream)));
  ++replays_;
  return absl::OkStatus();
}

void DecodeGraphs::Drop() {
  for (auto& [key, g] : graphs_)
    if (g != nullptr) Destroy(*g);
  graphs_.clear();
}

StepPhaseTimes ApportionReplay(const StepPhaseTimes& w, double total, double sample_s) {
  const double eager = w.embed_s + w.attention_s + w.moe_s + w.dense_mlp_s + w.head_s;
  if (eager <= 0) {
    StepPhaseTimes t;
    t.head_s = total;
    t.sample_s = sample_s;
    return t;
  }
  const double f = total / eager;
  return StepPhaseTimes{w.embed_s * f, w.attention_s * f, w.moe_s * f, w.dense_mlp_s * f, w.head_s * f, sample_s};
}

}  // namespace exl3::engine::cuda

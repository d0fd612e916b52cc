// The MoE layer's reference path (moe_reference.h).
#include "kernels/cuda/moe_reference.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/reference_gemm.h"

namespace exl3::cuda {

absl::Status PrepareReferenceWorkspace(Workspace::Impl& w, int H, int I, int SI) {
  EXL3_RETURN_IF_ERROR(w.Init());
  EXL3_RETURN_IF_ERROR(CublasStatus(cublasCreate(&w.cublas), "cublasCreate"));
  const size_t most = std::max({size_t(H) * I, size_t(H) * SI});
  EXL3_RETURN_IF_ERROR(w.dequant.Reserve(most * 2));
  return absl::OkStatus();
}

absl::Status ReferenceProjections(Workspace::Impl& w, const RouteOut& route, const GemvProblem* probs,
                                  const ProjTable* const* tables, int count, cudaStream_t stream) {
  int counts[2];
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts, route.counts, 8, cudaMemcpyDeviceToHost, stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  std::vector<int> ce(counts[1]), cr0(counts[1]), crows(counts[1]);
  if (counts[1] > 0) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(ce.data(), route.chunk_expert, counts[1] * 4, cudaMemcpyDeviceToHost));
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(cr0.data(), route.chunk_row0, counts[1] * 4, cudaMemcpyDeviceToHost));
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(crows.data(), route.chunk_rows, counts[1] * 4, cudaMemcpyDeviceToHost));
  }
  for (int i = 0; i < count; ++i) {
    const GemvProblem& q = probs[i];
    const ProjTable& t = *tables[i];
    if (q.chunk_expert) {
      // Experts' rows are contiguous: one GEMM per expert.
      int c = 0;
      while (c < counts[1]) {
        const int e = ce[c], row0 = cr0[c];
        int rows = 0;
        while (c < counts[1] && ce[c] == e) rows += crows[c++];
        const uint16_t* tr = t.host_trellis[e];
        const MoeProjSpec& s = t.host_spec[e];  // experts may differ in K and codebook
        EXL3_RETURN_IF_ERROR(ReferenceGemm(w.cublas, tr, q.k, q.n, s.bits, s.codebook, q.a + static_cast<size_t>(row0) * q.k,
                                           rows, q.y + static_cast<size_t>(row0) * q.n,
                                           static_cast<uint16_t*>(w.dequant.ptr), stream));
      }
    } else {
      EXL3_RETURN_IF_ERROR(ReferenceGemm(w.cublas, q.single, q.k, q.n, t.bits, t.cb, q.a, q.rows, q.y,
                                         static_cast<uint16_t*>(w.dequant.ptr), stream));
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3::cuda

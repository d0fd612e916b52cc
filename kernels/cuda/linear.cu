// The dense path's launch sequence: LinearForward (native and reference) and device
// dequantisation (cuda_backend.h).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/env_switch.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dense_gemv_kernel.cuh"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/gemv_plan.h"
#include "kernels/cuda/kernel_dispatch.h"
#include "kernels/cuda/linear_kernels.h"
#include "kernels/cuda/reference_gemm.h"
#include "kernels/cuda/workspace.h"

namespace exl3::cuda {

absl::Status DequantizeInnerDevice(const Exl3LinearView& w, uint16_t* out, StreamHandle stream) {
  EXL3_RETURN_IF_ERROR(ValidateLinear(w));
  EXL3_RETURN_IF_ERROR(DispatchDequant(w.bits, static_cast<int>(w.codebook), w.trellis, w.in_features,
                                       w.out_features, out, kDequantGrid, static_cast<cudaStream_t>(stream)));
  EXL3_CUDA_CHECK_LAUNCH("DequantKernel");
  return absl::OkStatus();
}

namespace {

// Layers of one input x [m, k] and the same K and codebook in one DenseGemvKernel launch (its plan
// over their columns together): y[i] = layer i of x.
absl::Status LaunchDenseGemvLayers(const Exl3LinearView* const* w, int count, const float* x, int m, float* const* y,
                                   Workspace::Impl& s, cudaStream_t stream) {
  const int k = w[0]->in_features;
  int total_n = 0;
  for (int i = 0; i < count; ++i) total_n += w[i]->out_features;
  const DenseGemvPlan plan = PlanDenseGemv(m, k, total_n, w[0]->bits, s.sm_count);
  const int chunks = (m + kGemvRows - 1) / kGemvRows;
  EXL3_RETURN_IF_ERROR(s.gemv_acc.ReserveZeroed(static_cast<size_t>(m) * total_n * 4, stream));
  EXL3_RETURN_IF_ERROR(
      s.gemv_arrivals.ReserveZeroed(static_cast<size_t>(chunks) * (total_n / kDenseBlockCols) * 4, stream));
  DenseGemvArgs args;
  args.layers = count;
  args.x = x;
  args.rows = m;
  args.k = k;
  args.k_slice_tiles = plan.slice_tiles;
  float* acc = static_cast<float*>(s.gemv_acc.ptr);
  int* arrivals = static_cast<int*>(s.gemv_arrivals.ptr);
  for (int i = 0; i < count; ++i) {
    DenseGemvLayer& L = args.layer[i];
    L.trellis = w[i]->trellis;
    L.suh = w[i]->suh;
    L.svh = w[i]->svh;
    L.bias = w[i]->bias;
    L.y = y[i];
    L.n = w[i]->out_features;
    L.acc = acc;
    L.arrivals = arrivals;
    acc += static_cast<size_t>(m) * L.n;
    arrivals += static_cast<size_t>(chunks) * (L.n / kDenseBlockCols);
  }
  const int grid = static_cast<int>(std::min<long>(plan.units, GemvGrid(s.sm_count)));
  EXL3_RETURN_IF_ERROR(DispatchDenseGemv(w[0]->bits, static_cast<int>(w[0]->codebook), args, grid, stream));
  EXL3_CUDA_CHECK_LAUNCH("DenseGemvKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearForward(const Exl3LinearView& w, const float* x, int m, float* y, Workspace* ws,
                           StreamHandle stream_handle, Path path) {
  EXL3_RETURN_IF_ERROR(ValidateLinear(w));
  if (m < 0) return absl::InvalidArgumentError("negative row count");
  if (m == 0) return absl::OkStatus();
  Workspace::Impl& s = *ws->impl();
  EXL3_RETURN_IF_ERROR(s.Init());
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int k = w.in_features, n = w.out_features;
  const Path p = ResolvePath(path, s.cc_major, "linear");
  // Large prefill chunks: dequantise once and multiply with cuBLAS, as the reference path does
  // (gemv_plan.h says why).
  const bool dequant_gemm = p == Path::kReference || UseDequantGemm(m);
  const int gemv_path = dequant_gemm ? 0 : GemvPathFor(m, k, n, w.bits, s.sm_count);
  const bool gemv = gemv_path != 0;
  // The prefill GEMM in k-slices when its units alone would leave SMs idle (gemv_plan.h).
  const int gemm_k_stages = !dequant_gemm && !gemv ? GemmKStages(m, k, n, s.sm_count) : 0;
  if (gemv_path == 1) {
    // One launch: input transform, GEMV and output transform (dense_gemv_kernel.cuh).
    const Exl3LinearView* one[1] = {&w};
    float* const ys[1] = {y};
    return LaunchDenseGemvLayers(one, 1, x, m, ys, s, stream);
  }
  EXL3_RETURN_IF_ERROR(s.a.Reserve(static_cast<size_t>(m) * k * 2));
  __half* a = static_cast<__half*>(s.a.ptr);
  // The three-launch GEMV and the k-sliced GEMM accumulate into y with atomics: the input
  // transform zeroes it.
  const bool accumulate = gemv || gemm_k_stages > 0;
  EXL3_RETURN_IF_ERROR(LaunchInputTransform(x, m, k, w.suh, a, accumulate ? y : nullptr, n, stream));
  if (dequant_gemm) {
    if (!s.cublas) EXL3_RETURN_IF_ERROR(CublasStatus(cublasCreate(&s.cublas), "cublasCreate"));
    EXL3_RETURN_IF_ERROR(s.dequant.Reserve(static_cast<size_t>(k) * n * 2));
    EXL3_RETURN_IF_ERROR(ReferenceGemm(s.cublas, w.trellis, k, n, w.bits, static_cast<int>(w.codebook), a,
                                       m, y, static_cast<uint16_t*>(s.dequant.ptr), stream));
  } else {
    GemvBatch batch;
    batch.num_problems = 1;
    GemvProblem& q = batch.p[0];
    q.single = w.trellis;
    q.a = a;
    q.y = y;
    q.rows = m;
    q.k = k;
    q.n = n;
    if (gemv) {
      q.k_tiles_per_unit = GemvKTilesPerUnit(k, n, (m + kGemvRows - 1) / kGemvRows, s.sm_count);
      EXL3_RETURN_IF_ERROR(DispatchGemv(w.bits, static_cast<int>(w.codebook), batch, GemvGrid(s.sm_count), stream));
      EXL3_CUDA_CHECK_LAUNCH("GroupedGemvKernel");
    } else {
      q.gemm_k_stages = gemm_k_stages;
      const int k_slices = gemm_k_stages > 0 ? (k / kGemmStageK + gemm_k_stages - 1) / gemm_k_stages : 1;
      const long units = static_cast<long>((m + kGemmBM - 1) / kGemmBM) * (n / 128) * k_slices;
      EXL3_RETURN_IF_ERROR(DispatchGemm(w.bits, static_cast<int>(w.codebook), batch, GemmGrid(s.sm_count, units), stream));
      EXL3_CUDA_CHECK_LAUNCH("GroupedGemmKernel");
    }
  }
  return LaunchOutputTransform(y, m, n, w.svh, w.bias, stream);
}

static_assert(kMaxProblems == kMaxTransformJobs, "a shared forward's layers: one GEMV problem and two transform jobs each");

// EXL3_LINEAR_SHARED=0 runs a shared forward's layers one LinearForward each: for measuring what
// the shared launches gain. Read once.
static bool SharedForwardEnabled() {
  static const bool enabled = EnvSwitchOn("EXL3_LINEAR_SHARED");
  return enabled;
}

absl::Status LinearForwardShared(const Exl3LinearView* const* w, int count, const float* x, int m, float* const* y,
                                 Workspace* ws, StreamHandle stream_handle, Path path) {
  if (count < 1 || count > kMaxProblems)
    return absl::InvalidArgumentError(absl::StrCat("LinearForwardShared: ", count, " layers (1..", kMaxProblems, ")"));
  if (m < 0) return absl::InvalidArgumentError("negative row count");
  if (m == 0) return absl::OkStatus();
  Workspace::Impl& s = *ws->impl();
  EXL3_RETURN_IF_ERROR(s.Init());
  const int k = w[0]->in_features;
  bool grouped = count > 1 && SharedForwardEnabled() && ResolvePath(path, s.cc_major, "linear") == Path::kNative &&
                 !UseDequantGemm(m);
  for (int i = 0; i < count && grouped; ++i) {
    EXL3_RETURN_IF_ERROR(ValidateLinear(*w[i]));
    grouped = w[i]->in_features == k && w[i]->bits == w[0]->bits && w[i]->codebook == w[0]->codebook &&
              GemvPathFor(m, k, w[i]->out_features, w[i]->bits, s.sm_count) != 0;
  }
  if (!grouped) {
    for (int i = 0; i < count; ++i) EXL3_RETURN_IF_ERROR(LinearForward(*w[i], x, m, y[i], ws, stream_handle, path));
    return absl::OkStatus();
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  int total_n = 0;
  for (int i = 0; i < count; ++i) total_n += w[i]->out_features;
  // The one-launch kernel takes the layers together where its plan over all their columns does.
  if (GemvPathFor(m, k, total_n, w[0]->bits, s.sm_count) == 1)
    return LaunchDenseGemvLayers(w, count, x, m, y, s, stream);
  EXL3_RETURN_IF_ERROR(s.a.Reserve(static_cast<size_t>(count) * m * k * 2));
  __half* a = static_cast<__half*>(s.a.ptr);
  InputTransformJobs in;
  OutputTransformJobs out;
  GemvBatch batch;
  // One k-slice length for all: the slices that fill the SMs with every layer's columns.
  const int k_tiles_per_unit = GemvKTilesPerUnit(k, total_n, (m + kGemvRows - 1) / kGemvRows, s.sm_count);
  for (int i = 0; i < count; ++i) {
    __half* ai = a + static_cast<size_t>(i) * m * k;
    in.job[i] = {w[i]->suh, ai, y[i], w[i]->out_features};  // the GEMV adds into y: zeroed first
    out.job[i] = {y[i], w[i]->out_features, w[i]->svh, w[i]->bias};
    GemvProblem& q = batch.p[i];
    q.single = w[i]->trellis;
    q.a = ai;
    q.y = y[i];
    q.rows = m;
    q.k = k;
    q.n = w[i]->out_features;
    q.k_tiles_per_unit = k_tiles_per_unit;
  }
  in.count = out.count = batch.num_problems = count;
  EXL3_RETURN_IF_ERROR(LaunchInputTransforms(x, m, k, in, stream));
  EXL3_RETURN_IF_ERROR(DispatchGemv(w[0]->bits, static_cast<int>(w[0]->codebook), batch, GemvGrid(s.sm_count), stream));
  EXL3_CUDA_CHECK_LAUNCH("GroupedGemvKernel");
  return LaunchOutputTransforms(m, out, stream);
}

}  // namespace exl3::cuda

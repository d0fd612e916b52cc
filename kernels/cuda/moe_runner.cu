// MoeRunner (cuda_backend.h): the MoE layer's decode/prefill launch sequence on one CUDA stream,
// with no host synchronisation and no allocation on the native path:
//   1. RouteKernel        top-k ids/weights -> slots grouped by expert, row chunks per expert
//   2. MoeInputKernel     per slot: x ⊙ suh_gate/up · H -> fp16 A (and the shared expert's rows)
//   3. gate+up            GroupedGemv (<= 8-row chunks) or GroupedGemm (128-row chunks), all
//                         active experts and the shared expert in one launch per (K, codebook)
//                         (a mixed layer's classes, moe_layer.h: each class's chunks in the
//                         launch of its own (K, codebook))
//   4. MoeMidKernel       output transforms, SwiGLU (+clamp), down's input transform -> fp16 A
//   5. down               as 3
//   6. MoeCombineKernel   per token: sum_k w * ((y·H) ⊙ svh + bias) + shared -> out fp32
// The kernels of 1, 2, 4 and 6 are in moe_kernels.cu, the reference path's projections in
// moe_reference.cu. Decode-sized batches run all of it in one cooperative launch instead
// (moe_cooperative.h); ChooseSequence below is the rule.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/gemv_plan.h"
#include "kernels/cuda/kernel_dispatch.h"
#include "kernels/cuda/moe_cooperative.h"
#include "kernels/cuda/moe_kernels.h"
#include "kernels/cuda/moe_layer.h"
#include "kernels/cuda/moe_reference.h"
#include "kernels/cuda/moe_workspace.h"
#include "kernels/cuda/workspace.h"

namespace exl3::cuda {

struct MoeRunner::Impl {
  const DeviceMoeLayer::Impl* L = nullptr;
  int max_tokens = 0, topk = 0;
  Path path = Path::kNative;
  int sm_count = 0;
  int coop_blocks_per_sm = 0;  // MoeCoopBlocksPerSm(): 0 where the cooperative launch cannot run
  MoeSequence forced = MoeSequence::kAuto;
  bool coop_refused = false;  // the runtime refused the cooperative grid once (LaunchMoeCoop)
  MoeWorkspace ws;   // routing, activations, host-routing staging
  Workspace ref_ws;  // reference path: cuBLAS handle and dequant scratch
  absl::Status Projections(bool gemm, const GemvProblem* probs, const ProjTable* const* tables, int count,
                           int T, cudaStream_t stream);
};

const char* MoeSequenceName(MoeSequence s) {
  switch (s) {
    case MoeSequence::kAuto: return "auto";
    case MoeSequence::kChain: return "chain";
    case MoeSequence::kCooperative: return "cooperative";
  }
  return "?";
}

namespace {

struct SequenceChoice {
  MoeSequence sequence;
  const char* reason;
};

// The rule (kAuto) takes the cooperative launch only with EXL3_MOE_COOP=1, until the kernel has
// been checked and timed on a GPU (docs/kernels.md); the tools force either sequence. Read once.
bool CooperativeAllowedByEnv() {
  static const bool allowed = [] {
    const char* v = std::getenv("EXL3_MOE_COOP");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return allowed;
}

// Where the cooperative launch covers a forward of T tokens, and otherwise why not.
SequenceChoice CooperativeCover(const MoeRunner::Impl& R, int T) {
  const DeviceMoeLayer::Impl& L = *R.L;
  if (R.path != Path::kNative) return {MoeSequence::kChain, "the reference path runs the chain with cuBLAS projections"};
  if (R.coop_blocks_per_sm == 0) {
    return {MoeSequence::kChain, "the device cannot launch MoeCoopKernel cooperatively (no cooperative launch, or no block fits an SM)"};
  }
  if (R.coop_refused) {
    return {MoeSequence::kChain, "the runtime refused the cooperative grid as too large (fewer SMs for this context, e.g. under MPS)"};
  }
  if (T > kMoeCoopMaxTokens) return {MoeSequence::kChain, "more tokens than kMoeCoopMaxTokens (moe_cooperative.h)"};
  if (T * R.topk > kMoeCoopMaxAssign) {
    return {MoeSequence::kChain, "T * top_k above kMoeCoopMaxAssign (one routing thread per assignment)"};
  }
  if (L.hidden % 128 != 0 || L.inter % 128 != 0 || (L.has_shared && L.shared_inter % 128 != 0)) {
    return {MoeSequence::kChain, "a layer dimension that is not a multiple of 128"};
  }
  return {MoeSequence::kCooperative, "a decode-sized batch: one cooperative launch for the whole layer"};
}

// The one place the native path's launch sequence is chosen: the cooperative launch wherever it
// covers the call (it saves the chain's launches and the drain and fill between them), the chain
// elsewhere (prefill-sized batches, devices without cooperative launch, shapes it does not take),
// or what ForceSequence asked for.
SequenceChoice ChooseSequence(const MoeRunner::Impl& R, int T) {
  if (R.forced == MoeSequence::kChain) return {MoeSequence::kChain, "forced (MoeRunner::ForceSequence)"};
  if (R.forced == MoeSequence::kAuto && !CooperativeAllowedByEnv()) return {MoeSequence::kChain, "EXL3_MOE_COOP is not 1 (the cooperative launch is opt-in until verified on a GPU)"};
  return CooperativeCover(R, T);
}

}  // namespace

MoeRunner::MoeRunner() : impl_(std::make_unique<Impl>()) {}
MoeRunner::~MoeRunner() = default;
Path MoeRunner::path() const { return impl_->path; }
void MoeRunner::ForceSequence(MoeSequence s) { impl_->forced = s; }
MoeSequence MoeRunner::SequenceFor(int num_tokens, std::string* reason) const {
  const SequenceChoice c = ChooseSequence(*impl_, num_tokens);
  if (reason) *reason = c.reason;
  return c.sequence;
}

absl::StatusOr<std::unique_ptr<MoeRunner>> MoeRunner::Create(const DeviceMoeLayer& layer, int max_tokens, int top_k,
                                                             Path path) {
  if (max_tokens <= 0 || top_k <= 0) return absl::InvalidArgumentError("max_tokens and top_k must be positive");
  std::unique_ptr<MoeRunner> r(new MoeRunner());
  Impl& R = *r->impl_;
  R.L = layer.impl();
  R.max_tokens = max_tokens;
  R.topk = top_k;
  int dev = 0, cc = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&R.sm_count, cudaDevAttrMultiProcessorCount, dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev));
  R.path = ResolvePath(path, cc, "moe");
  if (R.path == Path::kNative) {
    EXL3_ASSIGN_OR_RETURN(R.coop_blocks_per_sm, MoeCoopBlocksPerSm());
  }
  const int H = R.L->hidden, I = R.L->inter, SI = std::max(R.L->shared_inter, 128);
  MoeWorkspaceShape shape;
  shape.max_tokens = max_tokens;
  shape.top_k = top_k;
  shape.hidden = H;
  shape.inter = I;
  shape.shared_inter = SI;
  shape.num_experts = R.L->num_experts;
  EXL3_RETURN_IF_ERROR(R.ws.Allocate(shape));
  if (R.path == Path::kReference) {
    EXL3_RETURN_IF_ERROR(PrepareReferenceWorkspace(*R.ref_ws.impl(), H, I, SI));
  }
  return r;
}

// Runs `count` projection problems (tables[i] describes probs[i]). Native: one GEMV (small
// chunks) or GEMM (128-row chunks) launch per distinct (K, codebook) among them, of up to
// kMaxProblems problems each; in a mixed layer (moe_layer.h) a routed projection is one problem
// per class, covering that class's chunks (RouteOut's class ranges), so the launch count is fixed
// by the layer and a uniform layer's launches are those of one problem per projection.
// Reference: ReferenceProjections (moe_reference.h).
absl::Status MoeRunner::Impl::Projections(bool gemm, const GemvProblem* probs, const ProjTable* const* tables,
                                          int count, int T, cudaStream_t stream) {
  if (path == Path::kReference) return ReferenceProjections(*ref_ws.impl(), ws.route, probs, tables, count, stream);
  struct Item {
    GemvProblem q;
    MoeProjSpec spec;
    int held;  // experts the problem may cover (routed)
  };
  constexpr int kMaxItems = 2 * kMaxMoeClasses + 2;
  Item items[kMaxItems];
  int n = 0;
  const MoeExpertClasses& C = L->classes;
  for (int i = 0; i < count; ++i) {
    const ProjTable& t = *tables[i];
    if (probs[i].chunk_expert == nullptr || C.uniform()) {
      items[n++] = Item{probs[i], MoeProjSpec{t.bits, t.cb}, L->held};
      continue;
    }
    for (int c = 0; c < C.num_classes(); ++c) {
      if (n == kMaxItems) return absl::InternalError("MoeRunner: more projection problems than kMaxItems");
      Item& it = items[n++];
      it.q = probs[i];
      it.q.chunk_base = ws.route.class_chunk0 + c;
      it.q.num_chunks = ws.route.class_chunks + c;
      it.spec = t.host_spec[C.order[C.class_first[c]]];
      it.held = C.class_held[c];
    }
  }
  bool done[kMaxItems] = {};
  for (int i = 0; i < n; ++i) {
    if (done[i]) continue;
    GemvBatch batch;
    long units = 0;
    for (int j = i; j < n && batch.num_problems < kMaxProblems; ++j) {
      if (done[j] || items[j].spec != items[i].spec) continue;
      done[j] = true;
      GemvProblem q = items[j].q;
      // MoeInputKernel zeroes no outputs before the GEMM: it must store them, not add (one k-slice).
      if (gemm && q.gemm_k_stages != 0) return absl::InternalError("MoeRunner: a k-sliced GEMM problem");
      const int held = items[j].held;
      const int chunks = q.chunk_expert ? std::min(ws.max_chunks, T * topk) : (q.rows + kGemvRows - 1) / kGemvRows;
      q.k_tiles_per_unit = GemvKTilesPerUnit(q.k, q.n, std::max(1, std::min(chunks, held)), sm_count);
      units += static_cast<long>(q.chunk_expert ? std::min(held, T * topk) : (q.rows + kGemmBM - 1) / kGemmBM) *
               (q.n / 128);
      batch.p[batch.num_problems++] = q;
    }
    const MoeProjSpec& s = items[i].spec;
    if (gemm) {
      EXL3_RETURN_IF_ERROR(DispatchGemm(s.bits, s.codebook, batch, GemmGrid(sm_count, std::max(1L, units)), stream));
      EXL3_CUDA_CHECK_LAUNCH("GroupedGemmKernel");
    } else {
      EXL3_RETURN_IF_ERROR(DispatchGemv(s.bits, s.codebook, batch, GemvGrid(sm_count), stream));
      EXL3_CUDA_CHECK_LAUNCH("GroupedGemvKernel");
    }
  }
  return absl::OkStatus();
}

absl::Status MoeRunner::Forward(const float* x, int T, const int32_t* ids, const float* weights, float* out,
                                StreamHandle stream_handle, bool include_shared) {
  Impl& R = *impl_;
  const DeviceMoeLayer::Impl& L = *R.L;
  if (T < 0 || T > R.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("token count ", T, " outside 0..", R.max_tokens));
  }
  if (T == 0) return absl::OkStatus();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const bool shared = include_shared && L.has_shared;
  const SequenceChoice choice = ChooseSequence(R, T);
  if (R.forced == MoeSequence::kCooperative && choice.sequence != MoeSequence::kCooperative) {
    return absl::FailedPreconditionError(
        absl::StrCat("MoeRunner: the cooperative launch was forced but does not cover T = ", T, ": ", choice.reason));
  }
  if (choice.sequence == MoeSequence::kCooperative) {
    MoeCoopArgs a;
    a.x = x;
    a.ids = ids;
    a.weights = weights;
    a.out = out;
    a.d = MoeDims{T, R.topk, L.hidden, L.inter, shared ? L.shared_inter : 0, L.limit, L.shared_limit, shared ? 1 : 0};
    a.num_experts = L.num_experts;
    a.gate = L.gate;
    a.up = L.up;
    a.down = L.down;
    a.sgate = L.sgate;
    a.sup = L.sup;
    a.sdown = L.sdown;
    a.shared_gate_vec = L.shared_gate_vec;
    a.b = R.ws.buf;
    const absl::Status launched = LaunchMoeCoop(a, R.coop_blocks_per_sm * R.sm_count, stream);
    if (!absl::IsResourceExhausted(launched) || R.forced == MoeSequence::kCooperative) return launched;
    // Refused as too large (nothing launched): the chain from now on.
    R.coop_refused = true;
  }
  // Chunks of 8 rows (GEMV) while experts see few tokens; 128-row chunks (prefill GEMM) beyond.
  const bool gemm = R.path == Path::kNative && T > kMoeGemvMaxTokens;
  const int chunk = gemm ? kGemmBM : kGemvRows;
  EXL3_RETURN_IF_ERROR(LaunchRoute(ids, weights, T * R.topk, R.topk, L.num_experts,
                                   static_cast<const uint16_t* const*>(L.gate.trellis), L.route_classes, chunk, R.ws.route,
                                   stream));
  MoeDims d{T, R.topk, L.hidden, L.inter, shared ? L.shared_inter : 0, L.limit, L.shared_limit, shared ? 1 : 0};
  const int rows = T * R.topk + (shared ? T : 0);
  // The GEMM's problems below leave gemm_k_stages 0: one k-slice, every output stored (no atomics),
  // so only the GEMV and the reference path need their outputs zeroed first.
  EXL3_RETURN_IF_ERROR(LaunchMoeInput(rows, x, d, L.gate, L.up, L.sgate, L.sup, L.shared_gate_vec, R.ws.route, R.ws.buf,
                                      /*zero_outputs=*/!gemm, stream));

  auto routed = [&](const ProjTable& t, const __half* a, float* y) {
    GemvProblem q;
    q.trellis = t.trellis;
    q.a = a;
    q.y = y;
    q.chunk_expert = R.ws.route.chunk_expert;
    q.chunk_row0 = R.ws.route.chunk_row0;
    q.chunk_rows = R.ws.route.chunk_rows;
    q.num_chunks = R.ws.route.counts + 1;
    q.k = t.k;
    q.n = t.n;
    return q;
  };
  auto shared_prob = [&](const ProjTable& t, const __half* a, float* y) {
    GemvProblem q;
    std::memset(&q, 0, sizeof(q));
    q.a = a;
    q.y = y;
    q.rows = T;
    q.k = t.k;
    q.n = t.n;
    return q;
  };
  GemvProblem probs[4];
  const ProjTable* tabs[4];
  int np = 0;
  probs[np] = routed(L.gate, R.ws.buf.a_gate, R.ws.buf.y_gate); tabs[np++] = &L.gate;
  probs[np] = routed(L.up, R.ws.buf.a_up, R.ws.buf.y_up); tabs[np++] = &L.up;
  if (shared) {
    probs[np] = shared_prob(L.sgate, R.ws.buf.sa_gate, R.ws.buf.sy_gate); probs[np].single = L.sgate.host_trellis[0]; tabs[np++] = &L.sgate;
    probs[np] = shared_prob(L.sup, R.ws.buf.sa_up, R.ws.buf.sy_up); probs[np].single = L.sup.host_trellis[0]; tabs[np++] = &L.sup;
  }
  EXL3_RETURN_IF_ERROR(R.Projections(gemm, probs, tabs, np, T, stream));
  EXL3_RETURN_IF_ERROR(LaunchMoeMid(rows, d, L.gate, L.up, L.down, L.sgate, L.sup, L.sdown, R.ws.route, R.ws.buf, stream));
  np = 0;
  probs[np] = routed(L.down, R.ws.buf.a_down, R.ws.buf.y_down); tabs[np++] = &L.down;
  if (shared) {
    probs[np] = shared_prob(L.sdown, R.ws.buf.sa_down, R.ws.buf.sy_down); probs[np].single = L.sdown.host_trellis[0]; tabs[np++] = &L.sdown;
  }
  EXL3_RETURN_IF_ERROR(R.Projections(gemm, probs, tabs, np, T, stream));
  EXL3_RETURN_IF_ERROR(LaunchMoeCombine(d, L.down, L.sdown, R.ws.route, R.ws.buf, out, stream));
  return absl::OkStatus();
}

absl::Status MoeRunner::Rebind(const DeviceMoeLayer& layer) {
  Impl& R = *impl_;
  const DeviceMoeLayer::Impl& N = *layer.impl();
  if (N.hidden != R.L->hidden || N.inter != R.L->inter || N.shared_inter != R.L->shared_inter ||
      N.num_experts != R.L->num_experts || N.has_shared != R.L->has_shared) {
    return absl::InvalidArgumentError(
        "MoeRunner::Rebind: the layer's shape (hidden, intermediate, experts, shared expert) differs "
        "from the one the workspace was sized for");
  }
  R.L = &N;  // kernels take the layer's tables as launch arguments: earlier launches are unaffected
  return absl::OkStatus();
}

absl::Status MoeRunner::ForwardHostRouting(const float* x, int T, const int32_t* ids, const float* weights,
                                           float* out, StreamHandle stream_handle, bool include_shared) {
  Impl& R = *impl_;
  if (T < 0 || T > R.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("token count ", T, " outside 0..", R.max_tokens));
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const size_t n = static_cast<size_t>(T) * R.topk;
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(R.ws.ids, ids, n * 4, cudaMemcpyHostToDevice, stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(R.ws.weights, weights, n * 4, cudaMemcpyHostToDevice, stream));
  return Forward(x, T, R.ws.ids, R.ws.weights, out, stream_handle, include_shared);
}

}  // namespace exl3::cuda

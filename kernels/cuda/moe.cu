// MoE layer on the GPU: upload of a layer's experts with per-projection pointer tables, and the
// decode/prefill launch sequence (one CUDA stream, no host synchronisation, no allocation):
//   1. RouteKernel        top-k ids/weights -> slots grouped by expert, row chunks per expert
//   2. MoeInputKernel     per slot: x ⊙ suh_gate/up · H -> fp16 A (and the shared expert's rows)
//   3. gate+up            GroupedGemv (<= 8-row chunks) or GroupedGemm (128-row chunks), all
//                         active experts and the shared expert in one launch per (K, codebook)
//   4. MoeMidKernel       output transforms, SwiGLU (+clamp), down's input transform -> fp16 A
//   5. down               as 3
//   6. MoeCombineKernel   per token: sum_k w * ((y·H) ⊙ svh + bias) + shared -> out fp32
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/backend_internal.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kernel_dispatch.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/transform_kernels.cuh"

namespace exl3::cuda {

// Per-projection device pointer tables, indexed by expert id.
struct ProjTable {
  const uint16_t** trellis = nullptr;  // [E] (null: expert not held)
  const uint16_t** suh = nullptr;
  const uint16_t** svh = nullptr;
  const uint16_t** bias = nullptr;  // entries may be null
  int k = 0, n = 0, bits = 0, cb = 0;
  const uint16_t* const* host_trellis = nullptr;  // host copy of `trellis` (host code only)
};

struct DeviceMoeLayer::Impl {
  int hidden = 0, inter = 0, num_experts = 0, held = 0;
  float limit = 0.f;
  ProjTable gate, up, down;     // routed
  bool has_shared = false;
  int shared_inter = 0;
  float shared_limit = 0.f;
  ProjTable sgate, sup, sdown;  // shared expert: tables of one entry
  const float* shared_gate_vec = nullptr;  // device [hidden] fp32 or null
  void* block = nullptr;
  size_t bytes = 0;
  std::vector<const void*> host_tables;  // host image of the device pointer tables
  std::unique_ptr<HostRegistration> own_pages;  // Register mode without a caller's registration
  size_t copied_bytes = 0;  // Register mode: misaligned tensors copied into `block` instead
  ~Impl() {
    if (block) cudaFree(block);
  }
};

DeviceMoeLayer::DeviceMoeLayer() : impl_(std::make_unique<Impl>()) {}
DeviceMoeLayer::~DeviceMoeLayer() = default;
int DeviceMoeLayer::hidden_size() const { return impl_->hidden; }
int DeviceMoeLayer::num_experts() const { return impl_->num_experts; }
bool DeviceMoeLayer::has_shared() const { return impl_->has_shared; }
size_t DeviceMoeLayer::device_bytes() const { return impl_->bytes; }
size_t DeviceMoeLayer::copied_bytes() const { return impl_->copied_bytes; }

namespace {

size_t Align(size_t x) { return (x + 255) & ~size_t{255}; }

size_t LinearBytes(const Exl3LinearView& v) {
  return Align(v.trellis_words() * 2) + Align(v.in_features * 2ul) + 2 * Align(v.out_features * 2ul);
}

// The kernels read tensors with loads of up to 16 bytes. A safetensors file only places tensor data
// at multiples of 8 from its header's end, so a tensor used in place from a file mapping may not be
// 16-byte aligned: those are copied into the layer's device block instead (Create's `put`).
constexpr uintptr_t kInPlaceAlign = 16;
bool Misaligned(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % kInPlaceAlign != 0; }

// Device bytes one linear needs: all of it when uploaded; in register mode its misaligned tensors.
size_t LinearDeviceBytes(const Exl3LinearView& v, bool register_host) {
  if (!register_host) return LinearBytes(v);
  size_t n = 0;
  if (Misaligned(v.trellis)) n += Align(v.trellis_words() * 2);
  if (Misaligned(v.suh)) n += Align(v.in_features * 2ul);
  if (Misaligned(v.svh)) n += Align(v.out_features * 2ul);
  if (Misaligned(v.bias)) n += Align(v.out_features * 2ul);
  return n;
}

absl::Status CheckUniform(const Exl3LinearView& v, ProjTable& t, const char* what) {
  if (t.bits == 0) {
    t.k = v.in_features;
    t.n = v.out_features;
    t.bits = v.bits;
    t.cb = static_cast<int>(v.codebook);
    return absl::OkStatus();
  }
  if (v.in_features != t.k || v.out_features != t.n || v.bits != t.bits || static_cast<int>(v.codebook) != t.cb) {
    return absl::UnimplementedError(absl::StrCat(
        "CUDA MoE: every routed expert's ", what,
        " projection must share shape, bit width and codebook (mixed ones are not supported)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Upload(const MoeLayerView& host) {
  return Create(host, /*register_host=*/false, nullptr);
}

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Register(const MoeLayerView& host,
                                                                         const HostRegistration* pages) {
  return Create(host, /*register_host=*/true, pages);
}

std::vector<HostRange> MoeLayerHostRanges(const MoeLayerView& host) {
  std::vector<HostRange> r;
  // Misaligned tensors are copied to the device by Register, not read in place: not registered.
  auto add = [&](const void* p, size_t bytes) {
    if (p != nullptr && !Misaligned(p)) r.push_back({p, bytes});
  };
  auto add_linear = [&](const Exl3LinearView& v) {
    add(v.trellis, v.trellis_words() * 2);
    add(v.suh, v.in_features * 2ul);
    add(v.svh, v.out_features * 2ul);
    add(v.bias, v.out_features * 2ul);
  };
  for (const ExpertMlp* e : host.experts) {
    if (!e) continue;
    add_linear(e->gate);
    add_linear(e->up);
    add_linear(e->down);
  }
  if (host.shared) {
    add_linear(host.shared->gate);
    add_linear(host.shared->up);
    add_linear(host.shared->down);
    add(host.shared_gate, host.hidden_size * 4ul);
  }
  return r;
}

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Create(const MoeLayerView& host, bool register_host,
                                                                       const HostRegistration* pages) {
  EXL3_RETURN_IF_ERROR(ValidateMoeLayer(host));
  std::unique_ptr<DeviceMoeLayer> layer(new DeviceMoeLayer());
  Impl& L = *layer->impl_;
  L.hidden = host.hidden_size;
  L.inter = host.intermediate_size;
  L.num_experts = host.num_experts();
  L.limit = host.swiglu_limit;
  L.has_shared = host.shared != nullptr;
  L.shared_inter = host.shared_intermediate_size;
  L.shared_limit = host.shared_swiglu_limit;
  if (L.num_experts > 2048) return absl::UnimplementedError("CUDA MoE supports at most 2048 experts");
  // Sizes: tables (3 proj x 4 arrays x (E + 1) pointers), expert tensors, shared gate vector.
  const size_t table_entries = static_cast<size_t>(L.num_experts) + 1;
  size_t total = Align(6 * 4 * table_entries * sizeof(void*));
  for (const ExpertMlp* e : host.experts) {
    if (!e) continue;
    ++L.held;
    EXL3_RETURN_IF_ERROR(CheckUniform(e->gate, L.gate, "gate"));
    EXL3_RETURN_IF_ERROR(CheckUniform(e->up, L.up, "up"));
    EXL3_RETURN_IF_ERROR(CheckUniform(e->down, L.down, "down"));
    total += LinearDeviceBytes(e->gate, register_host) + LinearDeviceBytes(e->up, register_host) +
             LinearDeviceBytes(e->down, register_host);
  }
  if (L.held == 0) return absl::UnimplementedError(
        "CUDA MoE: the layer holds no routed expert (a worker holding only the shared expert must "
        "use --backend cpu)");
  if (L.has_shared) {
    EXL3_RETURN_IF_ERROR(CheckUniform(host.shared->gate, L.sgate, "shared gate"));
    EXL3_RETURN_IF_ERROR(CheckUniform(host.shared->up, L.sup, "shared up"));
    EXL3_RETURN_IF_ERROR(CheckUniform(host.shared->down, L.sdown, "shared down"));
    total += LinearDeviceBytes(host.shared->gate, register_host) +
             LinearDeviceBytes(host.shared->up, register_host) +
             LinearDeviceBytes(host.shared->down, register_host);
    if (host.shared_gate && (!register_host || Misaligned(host.shared_gate))) total += Align(L.hidden * 4ul);
    if (L.shared_inter == 0) L.shared_inter = host.shared->gate.out_features;
  }
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&L.block, total));
  L.bytes = total;
  char* base = static_cast<char*>(L.block);
  // Host images of the tables, copied at the end.
  std::vector<const void*> tables(6 * 4 * table_entries, nullptr);
  ProjTable* projs[6] = {&L.gate, &L.up, &L.down, &L.sgate, &L.sup, &L.sdown};
  for (int p = 0; p < 6; ++p) {
    const void** t = reinterpret_cast<const void**>(base) + p * 4 * table_entries;
    projs[p]->trellis = reinterpret_cast<const uint16_t**>(t);
    projs[p]->suh = reinterpret_cast<const uint16_t**>(t + table_entries);
    projs[p]->svh = reinterpret_cast<const uint16_t**>(t + 2 * table_entries);
    projs[p]->bias = reinterpret_cast<const uint16_t**>(t + 3 * table_entries);
  }
  size_t off = Align(6 * 4 * table_entries * sizeof(void*));
  // Register mode: the kernels read the tensors in place from pinned, mapped host pages (on
  // GB10-style unified memory at memory speed, elsewhere over the interconnect).
  int use_host_ptr = 0, dev = 0;
  if (register_host) {
    if (pages == nullptr) {
      absl::StatusOr<std::unique_ptr<HostRegistration>> own = HostRegistration::Create(MoeLayerHostRanges(host));
      if (!own.ok()) return own.status();
      L.own_pages = std::move(*own);
      pages = L.own_pages.get();
    }
    EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&use_host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, dev));
  }
  // Copies in the registered case go through pinned memory of their own (cudaMallocHost): a
  // pageable source, heap memory too, can share a page with a registered range (when the
  // registered tensors themselves live on the heap), and cudaMemcpy refuses one that straddles it.
  struct PinnedStage {
    void* p = nullptr;
    size_t cap = 0;
    ~PinnedStage() {
      if (p) cudaFreeHost(p);
    }
  } stage;
  auto staged_copy = [&](void* dst, const void* src, size_t bytes) -> absl::Status {
    if (bytes > stage.cap) {
      if (stage.p) cudaFreeHost(stage.p);
      stage.p = nullptr;
      stage.cap = 0;
      EXL3_CUDA_RETURN_IF_ERROR(cudaMallocHost(&stage.p, bytes));
      stage.cap = bytes;
    }
    std::memcpy(stage.p, src, bytes);
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, stage.p, bytes, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  };
  auto put = [&](const void* src, size_t bytes) -> absl::StatusOr<const void*> {
    if (register_host && !Misaligned(src)) {
      if (!pages->Covers(src, bytes)) {
        return absl::FailedPreconditionError("DeviceMoeLayer::Register: a tensor lies outside the given host registration");
      }
      if (use_host_ptr) return src;
      void* d = nullptr;
      EXL3_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&d, const_cast<void*>(src), 0));
      return static_cast<const void*>(d);
    }
    char* dst = base + off;
    if (register_host) {
      // The source may straddle the edge of a registered range (its page shared with an aligned
      // neighbour).
      EXL3_RETURN_IF_ERROR(staged_copy(dst, src, bytes));
      L.copied_bytes += bytes;
    } else {
      EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    }
    off += Align(bytes);
    return static_cast<const void*>(dst);
  };
  auto put_linear = [&](const Exl3LinearView& v, int proj, int index) -> absl::Status {
    const void** t = tables.data() + proj * 4 * table_entries;
    auto tr = put(v.trellis, v.trellis_words() * 2);
    if (!tr.ok()) return tr.status();
    auto su = put(v.suh, v.in_features * 2ul);
    if (!su.ok()) return su.status();
    auto sv = put(v.svh, v.out_features * 2ul);
    if (!sv.ok()) return sv.status();
    t[index] = *tr;
    t[table_entries + index] = *su;
    t[2 * table_entries + index] = *sv;
    if (v.bias) {
      auto b = put(v.bias, v.out_features * 2ul);
      if (!b.ok()) return b.status();
      t[3 * table_entries + index] = *b;
    } else if (!register_host) {
      off += Align(v.out_features * 2ul);
    }
    return absl::OkStatus();
  };
  for (int e = 0; e < L.num_experts; ++e) {
    const ExpertMlp* x = host.experts[e];
    if (!x) continue;
    EXL3_RETURN_IF_ERROR(put_linear(x->gate, 0, e));
    EXL3_RETURN_IF_ERROR(put_linear(x->up, 1, e));
    EXL3_RETURN_IF_ERROR(put_linear(x->down, 2, e));
  }
  if (L.has_shared) {
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->gate, 3, 0));
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->up, 4, 0));
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->down, 5, 0));
    if (host.shared_gate) {
      auto g = put(host.shared_gate, L.hidden * 4ul);
      if (!g.ok()) return g.status();
      L.shared_gate_vec = static_cast<const float*>(*g);
    }
  }
  if (register_host) {
    EXL3_RETURN_IF_ERROR(staged_copy(base, tables.data(), tables.size() * sizeof(void*)));
  } else {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(base, tables.data(), tables.size() * sizeof(void*), cudaMemcpyHostToDevice));
  }
  L.host_tables = std::move(tables);
  for (int p = 0; p < 6; ++p) {
    projs[p]->host_trellis = reinterpret_cast<const uint16_t* const*>(L.host_tables.data() + p * 4 * table_entries);
  }
  return layer;
}

// ---------------------------------------------------------------------------------------------
// Kernels

struct RouteOut {
  int* slot_token;    // [T*topk]
  int* slot_expert;   // [T*topk]
  float* slot_weight; // [T*topk]
  int* assign_slot;   // [T*topk]: slot of assignment i, -1 if dropped
  int* chunk_expert;  // [max_chunks]
  int* chunk_row0;
  int* chunk_rows;
  int* counts;        // [0] = slots, [1] = chunks
};

constexpr int kRouteThreads = 1024;
constexpr int kMaxExperts = 2048;

// One block: groups T*topk assignments by expert (ranks within an expert in arrival order of a
// shared-memory atomic), prefix sums of counts and chunk counts, chunk list.
__global__ void __launch_bounds__(kRouteThreads) RouteKernel(const int32_t* __restrict__ ids,
                                                             const float* __restrict__ weights, int num_assign,
                                                             int topk, int num_experts,
                                                             const uint16_t* const* __restrict__ held,
                                                             int chunk_size, RouteOut o) {
  __shared__ int count[kMaxExperts];
  __shared__ unsigned long long scan[kMaxExperts];  // (chunks << 32) | rows, exclusive prefix
  __shared__ unsigned long long warp_tot[32];
  PdlEnter();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < num_experts; e += kRouteThreads) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < num_assign; i += kRouteThreads) {
    const int e = ids[i];
    int rank = -1;
    if (e >= 0 && e < num_experts && held[e] != nullptr) rank = atomicAdd(&count[e], 1);
    o.assign_slot[i] = rank;  // temporarily the rank
  }
  __syncthreads();
  // Block exclusive scan over experts; thread tid owns experts [tid*per, (tid+1)*per).
  const int per = (num_experts + kRouteThreads - 1) / kRouteThreads;
  unsigned long long local = 0;
  for (int j = 0; j < per; ++j) {
    const int e = tid * per + j;
    if (e < num_experts) {
      const unsigned long long c = count[e];
      local += (((c + chunk_size - 1) / chunk_size) << 32) | c;
    }
  }
  unsigned long long incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = warp_tot[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned long long v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_tot[lane] = w;  // inclusive
  }
  __syncthreads();
  unsigned long long run = incl - local + (warp > 0 ? warp_tot[warp - 1] : 0ull);
  for (int j = 0; j < per; ++j) {
    const int e = tid * per + j;
    if (e < num_experts) {
      scan[e] = run;
      const unsigned long long c = count[e];
      run += (((c + chunk_size - 1) / chunk_size) << 32) | c;
    }
  }
  if (tid == kRouteThreads - 1) {
    o.counts[0] = static_cast<int>(run & 0xffffffffu);
    o.counts[1] = static_cast<int>(run >> 32);
  }
  __syncthreads();
  for (int i = tid; i < num_assign; i += kRouteThreads) {
    const int rank = o.assign_slot[i];
    if (rank < 0) continue;
    const int e = ids[i];
    const int slot = static_cast<int>(scan[e] & 0xffffffffu) + rank;
    o.slot_token[slot] = i / topk;
    o.slot_expert[slot] = e;
    o.slot_weight[slot] = weights[i];
    o.assign_slot[i] = slot;
  }
  for (int e = tid; e < num_experts; e += kRouteThreads) {
    const int c = count[e];
    if (c == 0) continue;
    const int row0 = static_cast<int>(scan[e] & 0xffffffffu);
    const int ch0 = static_cast<int>(scan[e] >> 32);
    for (int j = 0; j * chunk_size < c; ++j) {
      o.chunk_expert[ch0 + j] = e;
      o.chunk_row0[ch0 + j] = row0 + j * chunk_size;
      o.chunk_rows[ch0 + j] = min(chunk_size, c - j * chunk_size);
    }
  }
}

struct MoeBuffers {
  // routed
  __half* a_gate; __half* a_up; float* y_gate; float* y_up; __half* a_down; float* y_down;
  // shared
  __half* sa_gate; __half* sa_up; float* sy_gate; float* sy_up; __half* sa_down; float* sy_down;
  float* shared_scale;  // [T] sigmoid gate (Qwen3-Next) or 1
};

struct MoeDims {
  int T, topk, hidden, inter, shared_inter;
  float limit, shared_limit;
  int with_shared;
};

// Rows [0, T*topk): routed slots; [T*topk, T*topk + T): shared-expert token rows. One warp per
// (row, 128-block of hidden); 4 warps per block. Each warp also zeroes its share of the row's
// accumulators (gate/up: inter / (hidden/128) floats, down: its 128-block).
__global__ void __launch_bounds__(128) MoeInputKernel(const float* __restrict__ x, MoeDims d, ProjTable gate,
                                                      ProjTable up, ProjTable sgate, ProjTable sup,
                                                      const float* shared_gate_vec, RouteOut r, MoeBuffers b) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int per_row = d.hidden / 128;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int row_all = w / per_row, blk = w % per_row;
  const int routed = d.T * d.topk;
  if (row_all >= routed + (d.with_shared ? d.T : 0)) return;
  int token, row;
  const uint16_t *suh_g, *suh_u;
  __half *ag, *au;
  float *yg, *yu, *yd;
  int n_inter;
  if (row_all < routed) {
    row = row_all;
    if (row >= r.counts[0]) return;
    token = r.slot_token[row];
    const int e = r.slot_expert[row];
    suh_g = gate.suh[e];
    suh_u = up.suh[e];
    ag = b.a_gate; au = b.a_up; yg = b.y_gate; yu = b.y_up; yd = b.y_down;
    n_inter = d.inter;
  } else {
    row = token = row_all - routed;
    suh_g = sgate.suh[0];
    suh_u = sup.suh[0];
    ag = b.sa_gate; au = b.sa_up; yg = b.sy_gate; yu = b.sy_up; yd = b.sy_down;
    n_inter = d.shared_inter;
  }
  const float* xr = x + static_cast<size_t>(token) * d.hidden;
  InputBlock(xr + 128 * blk, suh_g + 128 * blk, ag + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
  InputBlock(xr + 128 * blk, suh_u + 128 * blk, au + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
  const int share = (n_inter + per_row - 1) / per_row;
  for (int i = blk * share + lane; i < min(n_inter, (blk + 1) * share); i += 32) {
    yg[static_cast<size_t>(row) * n_inter + i] = 0.f;
    yu[static_cast<size_t>(row) * n_inter + i] = 0.f;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) yd[static_cast<size_t>(row) * d.hidden + 128 * blk + 32 * q + lane] = 0.f;
  if (row_all >= routed && blk == 0) {
    // Shared-expert output scale: sigmoid(x · shared_gate) (Qwen3-Next) or 1.
    float s = 0.f;
    if (shared_gate_vec) {
      for (int i = lane; i < d.hidden; i += 32) s += xr[i] * shared_gate_vec[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) b.shared_scale[token] = 1.f / (1.f + expf(-s));
    } else if (lane == 0) {
      b.shared_scale[token] = 1.f;
    }
  }
}

__device__ __forceinline__ float SiluMul(float g, float u, float limit) {
  if (limit > 0.f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return g / (1.f + expf(-g)) * u;
}

// One warp per (row, 128-block of the intermediate); per_row = max(inter, shared_inter) / 128.
__global__ void __launch_bounds__(128) MoeMidKernel(MoeDims d, ProjTable gate, ProjTable up, ProjTable down,
                                                    ProjTable sgate, ProjTable sup, ProjTable sdown, RouteOut r,
                                                    MoeBuffers b) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int per_row = max(d.inter, d.shared_inter) / 128;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int row_all = w / per_row, blk = w % per_row;
  const int routed = d.T * d.topk;
  if (row_all >= routed + (d.with_shared ? d.T : 0)) return;
  int row, e, n_inter;
  float limit;
  const ProjTable *G, *U, *D;
  const float *yg, *yu;
  __half* ad;
  if (row_all < routed) {
    row = row_all;
    if (row >= r.counts[0]) return;
    e = r.slot_expert[row];
    G = &gate; U = &up; D = &down;
    yg = b.y_gate; yu = b.y_up; ad = b.a_down;
    n_inter = d.inter;
    limit = d.limit;
  } else {
    row = row_all - routed;
    e = 0;
    G = &sgate; U = &sup; D = &sdown;
    yg = b.sy_gate; yu = b.sy_up; ad = b.sa_down;
    n_inter = d.shared_inter;
    limit = d.shared_limit;
  }
  if (blk >= n_inter / 128) return;
  const uint16_t* bias_g = G->bias[e];
  const uint16_t* bias_u = U->bias[e];
  float g[4], u[4];
  const size_t off = static_cast<size_t>(row) * n_inter + 128 * blk;
  OutputBlock(yg + off, G->svh[e] + 128 * blk, bias_g ? bias_g + 128 * blk : nullptr, g, lane);
  OutputBlock(yu + off, U->svh[e] + 128 * blk, bias_u ? bias_u + 128 * blk : nullptr, u, lane);
  const uint16_t* suh_d = D->suh[e] + 128 * blk;
  float h[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = SiluMul(g[q], u[q], limit) * HalfAt(suh_d, 32 * q + lane);
  WarpHadamard128(h, lane);
#pragma unroll
  for (int q = 0; q < 4; ++q) ad[off + 32 * q + lane] = __float2half_rn(h[q]);
}

// One warp per (token, 128-block of hidden): out = sum over the token's assignments + shared.
__global__ void __launch_bounds__(128) MoeCombineKernel(MoeDims d, ProjTable down, ProjTable sdown, RouteOut r,
                                                        MoeBuffers b, float* __restrict__ out) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int per_row = d.hidden / 128;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (w >= d.T * per_row) return;
  const int t = w / per_row, blk = w % per_row;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < d.topk; ++k) {
    const int s = r.assign_slot[t * d.topk + k];
    if (s < 0) continue;
    const int e = r.slot_expert[s];
    const float wt = r.slot_weight[s];
    const uint16_t* bias = down.bias[e];
    float v[4];
    OutputBlock(b.y_down + static_cast<size_t>(s) * d.hidden + 128 * blk, down.svh[e] + 128 * blk,
                bias ? bias + 128 * blk : nullptr, v, lane);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += wt * v[q];
  }
  if (d.with_shared) {
    const uint16_t* bias = sdown.bias[0];
    float v[4];
    OutputBlock(b.sy_down + static_cast<size_t>(t) * d.hidden + 128 * blk, sdown.svh[0] + 128 * blk,
                bias ? bias + 128 * blk : nullptr, v, lane);
    const float sc = b.shared_scale[t];
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += sc * v[q];
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) out[static_cast<size_t>(t) * d.hidden + 128 * blk + 32 * q + lane] = acc[q];
}

// ---------------------------------------------------------------------------------------------
// Runner

struct MoeRunner::Impl {
  const DeviceMoeLayer::Impl* L = nullptr;
  int max_tokens = 0, topk = 0, max_chunks = 0;
  Path path = Path::kNative;
  int sm_count = 0;
  void* block = nullptr;
  RouteOut route{};
  MoeBuffers buf{};
  int32_t* ids = nullptr;  // host-routing staging
  float* weights = nullptr;
  Workspace ref_ws;        // reference path: cuBLAS handle and dequant scratch
  ~Impl() {
    if (block) cudaFree(block);
  }
  absl::Status Projections(bool first, const GemvProblem* probs, const ProjTable* const* tables, int count,
                           int T, cudaStream_t stream);
};

MoeRunner::MoeRunner() : impl_(std::make_unique<Impl>()) {}
MoeRunner::~MoeRunner() = default;
Path MoeRunner::path() const { return impl_->path; }

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
  const size_t A = static_cast<size_t>(max_tokens) * top_k;  // routed slots
  const size_t T = max_tokens;
  const int H = R.L->hidden, I = R.L->inter, SI = std::max(R.L->shared_inter, 128);
  R.max_chunks = static_cast<int>(A) + R.L->num_experts;
  size_t sizes[] = {
      A * 4, A * 4, A * 4, A * 4,                                // slot_token, expert, weight, assign_slot
      size_t(R.max_chunks) * 4 * 3, 64,                          // chunks, counts
      A * H * 2, A * H * 2, A * I * 4, A * I * 4, A * I * 2, A * H * 4,          // routed
      T * H * 2, T * H * 2, T * SI * 4, T * SI * 4, T * SI * 2, T * H * 4, T * 4,  // shared
      A * 4, A * 4,                                              // host-routing staging
  };
  size_t total = 0;
  for (size_t s : sizes) total += Align(s);
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&R.block, total));
  char* p = static_cast<char*>(R.block);
  int i = 0;
  auto next = [&]() {
    char* q = p;
    p += Align(sizes[i++]);
    return q;
  };
  R.route.slot_token = reinterpret_cast<int*>(next());
  R.route.slot_expert = reinterpret_cast<int*>(next());
  R.route.slot_weight = reinterpret_cast<float*>(next());
  R.route.assign_slot = reinterpret_cast<int*>(next());
  R.route.chunk_expert = reinterpret_cast<int*>(next());
  R.route.chunk_row0 = R.route.chunk_expert + R.max_chunks;
  R.route.chunk_rows = R.route.chunk_row0 + R.max_chunks;
  R.route.counts = reinterpret_cast<int*>(next());
  R.buf.a_gate = reinterpret_cast<__half*>(next());
  R.buf.a_up = reinterpret_cast<__half*>(next());
  R.buf.y_gate = reinterpret_cast<float*>(next());
  R.buf.y_up = reinterpret_cast<float*>(next());
  R.buf.a_down = reinterpret_cast<__half*>(next());
  R.buf.y_down = reinterpret_cast<float*>(next());
  R.buf.sa_gate = reinterpret_cast<__half*>(next());
  R.buf.sa_up = reinterpret_cast<__half*>(next());
  R.buf.sy_gate = reinterpret_cast<float*>(next());
  R.buf.sy_up = reinterpret_cast<float*>(next());
  R.buf.sa_down = reinterpret_cast<__half*>(next());
  R.buf.sy_down = reinterpret_cast<float*>(next());
  R.buf.shared_scale = reinterpret_cast<float*>(next());
  R.ids = reinterpret_cast<int32_t*>(next());
  R.weights = reinterpret_cast<float*>(next());
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemset(R.block, 0, total));
  if (R.path == Path::kReference) {
    EXL3_RETURN_IF_ERROR(R.ref_ws.impl()->Init());
    Workspace::Impl& w = *R.ref_ws.impl();
    EXL3_RETURN_IF_ERROR(CublasStatus(cublasCreate(&w.cublas), "cublasCreate"));
    const size_t most = std::max({size_t(H) * I, size_t(H) * SI});
    EXL3_RETURN_IF_ERROR(w.dequant.Reserve(most * 2));
  }
  return r;
}

// Runs `count` projection problems (tables[i] describes probs[i]) grouped by (K, codebook): one
// launch per distinct pair. Native: GEMV for small chunks, GEMM for 128-row chunks. Reference:
// copies the chunk list to the host (synchronises) and runs dequant + cuBLAS per active expert.
absl::Status MoeRunner::Impl::Projections(bool gemm, const GemvProblem* probs, const ProjTable* const* tables,
                                          int count, int T, cudaStream_t stream) {
  if (path == Path::kReference) {
    Workspace::Impl& w = *ref_ws.impl();
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
          EXL3_RETURN_IF_ERROR(ReferenceGemm(w.cublas, tr, q.k, q.n, t.bits, t.cb, q.a + static_cast<size_t>(row0) * q.k,
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
  std::vector<bool> done(count, false);
  for (int i = 0; i < count; ++i) {
    if (done[i]) continue;
    GemvBatch batch;
    long units = 0;
    for (int j = i; j < count; ++j) {
      if (done[j] || tables[j]->bits != tables[i]->bits || tables[j]->cb != tables[i]->cb) continue;
      done[j] = true;
      GemvProblem q = probs[j];
      const int chunks = q.chunk_expert ? std::min(max_chunks, T * topk) : (q.rows + kGemvRows - 1) / kGemvRows;
      q.k_tiles_per_unit = GemvKTilesPerUnit(q.k, q.n, std::max(1, std::min(chunks, L->held)), sm_count);
      units += static_cast<long>(q.chunk_expert ? std::min(L->held, T * topk) : (q.rows + kGemmBM - 1) / kGemmBM) *
               (q.n / 128);
      batch.p[batch.num_problems++] = q;
    }
    if (gemm) {
      EXL3_RETURN_IF_ERROR(DispatchGemm(tables[i]->bits, tables[i]->cb, batch, GemmGrid(sm_count, std::max(1L, units)), stream));
      EXL3_CUDA_CHECK_LAUNCH("GroupedGemmKernel");
    } else {
      EXL3_RETURN_IF_ERROR(DispatchGemv(tables[i]->bits, tables[i]->cb, batch, GemvGrid(sm_count), stream));
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
  // Chunks of 8 rows (GEMV) while experts see few tokens; 128-row chunks (prefill GEMM) beyond.
  const bool gemm = R.path == Path::kNative && T > 64;
  const int chunk = gemm ? kGemmBM : kGemvRows;
  LaunchPdl(RouteKernel, dim3(1), dim3(kRouteThreads), stream, ids, weights, T * R.topk, R.topk, L.num_experts,
            static_cast<const uint16_t* const*>(L.gate.trellis), chunk, R.route);
  EXL3_CUDA_CHECK_LAUNCH("RouteKernel");
  MoeDims d{T, R.topk, L.hidden, L.inter, shared ? L.shared_inter : 0, L.limit, L.shared_limit, shared ? 1 : 0};
  const int rows = T * R.topk + (shared ? T : 0);
  LaunchPdl(MoeInputKernel, dim3((rows * (L.hidden / 128) + 3) / 4), dim3(128), stream, x, d, L.gate, L.up, L.sgate,
            L.sup, L.shared_gate_vec, R.route, R.buf);
  EXL3_CUDA_CHECK_LAUNCH("MoeInputKernel");

  auto routed = [&](const ProjTable& t, const __half* a, float* y) {
    GemvProblem q;
    q.trellis = t.trellis;
    q.a = a;
    q.y = y;
    q.chunk_expert = R.route.chunk_expert;
    q.chunk_row0 = R.route.chunk_row0;
    q.chunk_rows = R.route.chunk_rows;
    q.num_chunks = R.route.counts + 1;
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
  probs[np] = routed(L.gate, R.buf.a_gate, R.buf.y_gate); tabs[np++] = &L.gate;
  probs[np] = routed(L.up, R.buf.a_up, R.buf.y_up); tabs[np++] = &L.up;
  if (shared) {
    probs[np] = shared_prob(L.sgate, R.buf.sa_gate, R.buf.sy_gate); probs[np].single = L.sgate.host_trellis[0]; tabs[np++] = &L.sgate;
    probs[np] = shared_prob(L.sup, R.buf.sa_up, R.buf.sy_up); probs[np].single = L.sup.host_trellis[0]; tabs[np++] = &L.sup;
  }
  EXL3_RETURN_IF_ERROR(R.Projections(gemm, probs, tabs, np, T, stream));
  const int mid_per_row = std::max(L.inter, shared ? L.shared_inter : 0) / 128;
  LaunchPdl(MoeMidKernel, dim3((rows * mid_per_row + 3) / 4), dim3(128), stream, d, L.gate, L.up, L.down, L.sgate,
            L.sup, L.sdown, R.route, R.buf);
  EXL3_CUDA_CHECK_LAUNCH("MoeMidKernel");
  np = 0;
  probs[np] = routed(L.down, R.buf.a_down, R.buf.y_down); tabs[np++] = &L.down;
  if (shared) {
    probs[np] = shared_prob(L.sdown, R.buf.sa_down, R.buf.sy_down); probs[np].single = L.sdown.host_trellis[0]; tabs[np++] = &L.sdown;
  }
  EXL3_RETURN_IF_ERROR(R.Projections(gemm, probs, tabs, np, T, stream));
  LaunchPdl(MoeCombineKernel, dim3((T * (L.hidden / 128) + 3) / 4), dim3(128), stream, d, L.down, L.sdown, R.route,
            R.buf, out);
  EXL3_CUDA_CHECK_LAUNCH("MoeCombineKernel");
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
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(R.ids, ids, n * 4, cudaMemcpyHostToDevice, stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(R.weights, weights, n * 4, cudaMemcpyHostToDevice, stream));
  return Forward(x, T, R.ids, R.weights, out, stream_handle, include_shared);
}

}  // namespace exl3::cuda

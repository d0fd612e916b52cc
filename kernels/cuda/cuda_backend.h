// Host API of the EXL3 CUDA backend. Includes no CUDA header, so any code (services, tools, the CPU
// build) can include it; the functions exist only when the library `exl3_cuda` is linked, which
// CMake builds when a CUDA toolkit is found and then defines EXL3_HAVE_CUDA=1 for its users.
//
// Usage (dense layer):
//   auto dev = exl3::cuda::DeviceLinear::Upload(view);          // or ::Register for host memory
//   exl3::cuda::Workspace ws;                                     // grows on first use, then reused
//   exl3::cuda::LinearForward(dev->view(), d_x, m, d_y, &ws, stream);   // x [m, k] fp32 -> y [m, n]
// Usage (MoE layer):
//   auto layer = exl3::cuda::DeviceMoeLayer::Upload(moe_view);   // kernels/moe_cpu.h view
//   auto runner = exl3::cuda::MoeRunner::Create(*layer, max_tokens, top_k);  // workspace, once
//   runner->Forward(d_x, T, d_ids, d_weights, d_out, stream);    // no host sync, graph-capturable
//
// Paths: EXL3_MOE_KERNEL=native|reference (default native) picks the native kernels or the reference
// (dequantise to fp16, cuBLAS). A device the native kernels do not support (compute capability
// below 8.0) falls back to the reference by itself; the path taken is logged once on stderr.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/exl3_linear.h"
#include "kernels/moe_cpu.h"

namespace exl3::cuda {

// cudaStream_t, passed as an opaque pointer (null: the legacy default stream).
using StreamHandle = void*;

struct DeviceInfo {
  int device = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t global_mem_bytes = 0;
  size_t l2_bytes = 0;
  size_t shared_mem_per_block_optin = 0;
  bool unified_addressing = false;
  bool pageable_memory_access = false;  // the GPU reads pageable host memory (GB10, GH200)
  bool integrated = false;              // GPU and CPU share one physical memory (GB10)
};

// Number of visible devices (0 when there is no driver or GPU; never an error).
int DeviceCount();
absl::StatusOr<DeviceInfo> QueryDevice(int device = 0);

enum class Path { kAuto, kNative, kReference };
// The path EXL3_MOE_KERNEL asks for (kNative when unset); an invalid value is an error.
absl::StatusOr<Path> PathFromEnv();
const char* PathName(Path p);

// Plain device memory helpers (so callers need no CUDA header).
absl::StatusOr<void*> DeviceAlloc(size_t bytes);
void DeviceFree(void* p);
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
absl::Status Synchronize(StreamHandle stream = nullptr);
// Page-locked host memory (cudaHostAlloc): the copy engines read and write it directly, so copies
// from and to it are asynchronous and need no bounce buffer. Freed with HostFree.
absl::StatusOr<void*> HostAlloc(size_t bytes);
void HostFree(void* p);
// A stream of its own (cudaStreamCreate: it orders with the legacy default stream), destroyed with
// StreamDestroy.
absl::StatusOr<StreamHandle> StreamCreate();
void StreamDestroy(StreamHandle stream);
// Queued on `stream`, returning at once when the host side is page-locked (HostAlloc).
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, StreamHandle stream);
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, StreamHandle stream);

// One linear layer's tensors in GPU-visible memory. view() holds device pointers.
class DeviceLinear {
 public:
  // Copies trellis/suh/svh/bias into one device allocation.
  static absl::StatusOr<std::unique_ptr<DeviceLinear>> Upload(const Exl3LinearView& host);
  ~DeviceLinear();
  DeviceLinear(const DeviceLinear&) = delete;
  DeviceLinear& operator=(const DeviceLinear&) = delete;
  const Exl3LinearView& view() const { return view_; }

 private:
  DeviceLinear() = default;
  Exl3LinearView view_;
  void* block_ = nullptr;
};

// Scratch memory and library handles, allocated on first use and grown when a larger call comes;
// reused afterwards (call a forward once before capturing a graph).
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  struct Impl;
  Impl* impl() { return impl_.get(); }
  // How many times its buffers have been (re)allocated: a CUDA graph captured with the workspace
  // is stale once this changes (its launches hold the old addresses).
  uint64_t allocations() const;

 private:
  std::unique_ptr<Impl> impl_;
};

// y [m, n] fp32 = x [m, k] fp32 · W (+ bias), all pointers device memory, w.view() device pointers.
// Native: m <= 48 rows: tensor-core GEMV in chunks of 8 rows, as one launch (DenseGemvKernel) or as
// input transform, GEMV and output transform, whichever measured faster for the shape; m > 48:
// input transform, prefill GEMM (128-row chunks), output transform. Reference: the same
// transforms, W_inner dequantised to fp16 + cuBLAS. (Thresholds: gemv_plan.h.)
absl::Status LinearForward(const Exl3LinearView& w, const float* x, int m, float* y,
                           Workspace* ws, StreamHandle stream = nullptr, Path path = Path::kAuto);

// y_i [m, n_i] = x [m, k] · W_i (+ bias_i) for up to 4 layers of one input (an attention layer's q,
// k and v projections), each result as LinearForward gives it. Where every layer takes the GEMV
// path (m <= 16 rows, gemv_plan.h) with the same bit width, codebook and k, they run as one input
// transform, one GEMV over all of them and one output transform: 3 launches instead of 3 to 9,
// and the small layers' columns fill the SMs beside the large one's. Otherwise one LinearForward
// each.
absl::Status LinearForwardShared(const Exl3LinearView* const* w, int count, const float* x, int m,
                                 float* const* y, Workspace* ws, StreamHandle stream = nullptr,
                                 Path path = Path::kAuto);

// W_inner fp16 [k, n] (bit patterns, row-major) decoded on the device; matches DequantizeInner.
absl::Status DequantizeInnerDevice(const Exl3LinearView& w, uint16_t* out, StreamHandle stream = nullptr);

// Host memory registered with the device (pinned and mapped): the page-aligned union of the given
// ranges, registered once, unregistered on destruction. Read-only mappings (mmap'd model files) are
// registered read-only. The memory must outlive the registration. Registration pins the pages
// (they count as the process's resident memory and cannot be swapped).
struct HostRange {
  const void* data = nullptr;
  size_t bytes = 0;
};
class HostRegistration {
 public:
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Create(const std::vector<HostRange>& ranges);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  // Whether [data, data + bytes) lies inside one registered interval.
  bool Covers(const void* data, size_t bytes) const;
  // Bytes registered (whole pages).
  size_t bytes() const { return bytes_; }

 private:
  HostRegistration() = default;
  std::vector<std::pair<uintptr_t, uintptr_t>> intervals_;  // registered pages (kernels/page_intervals.h)
  size_t bytes_ = 0;
};

// The host ranges of an MoE layer view's tensors that Register reads in place and so needs
// registered: the 16-byte-aligned ones (it copies the others to the device).
std::vector<HostRange> MoeLayerHostRanges(const MoeLayerView& host);

// An MoE layer resident on the device: every held expert's gate/up/down plus the shared expert,
// and per-projection pointer tables the kernels index by expert id. The routed experts of one
// projection share its shape but may differ in K and codebook (kernels/moe_classes.h).
class DeviceMoeLayer {
 public:
  // Copies every held expert into device memory (one allocation).
  static absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> Upload(const MoeLayerView& host);
  // Leaves the weights where they are: the kernels read them in place from registered (pinned,
  // mapped) host memory; only the pointer tables go to device memory. For unified-memory machines
  // (GB10) and for layers too large for the device. With `pages` null the layer registers the pages
  // its tensors occupy itself; otherwise `pages` must cover every tensor of the layer (a caller
  // holding several layers registers them all at once, since neighbouring layers share pages). The
  // host memory (and `pages`) must outlive the layer.
  static absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> Register(
      const MoeLayerView& host, const HostRegistration* pages = nullptr);
  ~DeviceMoeLayer();
  DeviceMoeLayer(const DeviceMoeLayer&) = delete;
  DeviceMoeLayer& operator=(const DeviceMoeLayer&) = delete;
  struct Impl;
  const Impl* impl() const { return impl_.get(); }
  int hidden_size() const;
  int num_experts() const;
  bool has_shared() const;
  size_t device_bytes() const;
  // Register mode: bytes of tensors not 16-byte aligned in host memory (the kernels' widest
  // loads), which were copied into device memory instead of being read in place.
  size_t copied_bytes() const;

 private:
  DeviceMoeLayer();
  static absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> Create(const MoeLayerView& host, bool register_host,
                                                                 const HostRegistration* pages);
  std::unique_ptr<Impl> impl_;
};

// Runs one MoE layer for up to max_tokens tokens. Owns its workspace (allocated in Create).
// Forward: x [T, hidden] fp32, topk_ids [T, top_k] int32, topk_weights [T, top_k] fp32, out
// [T, hidden] fp32 (overwritten): out[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t]) + shared(x[t]).
// Ids that are out of range or name an expert not held are skipped. All device pointers; no host
// synchronisation and no allocation on the native path, so it can be captured in a CUDA graph.
// The native path's launch sequence for a decode step (moe_runner.cu, ChooseSequence, gives the
// rule and each reason): the chain (routing, input transform, gate+up, activation, down, combine:
// six to eight launches) or one cooperative launch of the whole layer (moe_cooperative.h).
// kAuto takes the cooperative launch only with EXL3_MOE_COOP=1 (opt-in until verified on a GPU).
enum class MoeSequence { kAuto, kChain, kCooperative };
const char* MoeSequenceName(MoeSequence s);

class MoeRunner {
 public:
  static absl::StatusOr<std::unique_ptr<MoeRunner>> Create(const DeviceMoeLayer& layer, int max_tokens,
                                                           int top_k, Path path = Path::kAuto);
  ~MoeRunner();
  MoeRunner(const MoeRunner&) = delete;
  MoeRunner& operator=(const MoeRunner&) = delete;
  absl::Status Forward(const float* x, int num_tokens, const int32_t* topk_ids,
                       const float* topk_weights, float* out, StreamHandle stream = nullptr,
                       bool include_shared = true);
  // Same with routing arrays in host memory (copied into the workspace first).
  absl::Status ForwardHostRouting(const float* x, int num_tokens, const int32_t* topk_ids,
                                  const float* topk_weights, float* out,
                                  StreamHandle stream = nullptr, bool include_shared = true);
  // Points the runner (and its workspace) at another layer of the same shape, so one workspace
  // serves every MoE layer of a model. Launches already made keep their layer.
  absl::Status Rebind(const DeviceMoeLayer& layer);
  Path path() const;
  // Forces the native path's sequence (kAuto restores the rule); Forward fails with the reason
  // where a forced cooperative launch does not cover the call. For tools (exl3-cuda-check,
  // exl3-bench).
  void ForceSequence(MoeSequence s);
  // The sequence Forward runs for num_tokens tokens (kChain on the reference path), and why.
  MoeSequence SequenceFor(int num_tokens, std::string* reason = nullptr) const;
  struct Impl;

 private:
  MoeRunner();
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3::cuda

namespace exl3::cuda {

// Conveniences for tools (exl3-tool --backend cuda): everything in host memory; uploads the
// weights, runs on device 0, copies the result back and synchronises. Not for serving loops.
absl::Status LinearForwardHost(const Exl3LinearView& host_w, const float* x, int m, float* y,
                               Path path = Path::kAuto);
// Assignments with per-token offsets are padded to the longest token's count with skipped ids.
absl::Status MoeForwardHost(const MoeLayerView& host_layer, const float* x, const MoeAssignments& a,
                            bool include_shared, float* y, Path path = Path::kAuto);

}  // namespace exl3::cuda

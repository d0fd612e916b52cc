// Device facts, the kernel path choice and plain device memory helpers (cuda_backend.h), and the
// internal ResolvePath.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"

namespace exl3::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<DeviceInfo> QueryDevice(int device) {
  cudaDeviceProp p;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&p, device));
  DeviceInfo d;
  d.device = device;
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sm_count = p.multiProcessorCount;
  d.global_mem_bytes = p.totalGlobalMem;
  d.l2_bytes = p.l2CacheSize;
  d.shared_mem_per_block_optin = p.sharedMemPerBlockOptin;
  d.unified_addressing = p.unifiedAddressing;
  d.pageable_memory_access = p.pageableMemoryAccess;
  d.integrated = p.integrated;
  return d;
}

const char* PathName(Path p) {
  switch (p) {
    case Path::kAuto: return "auto";
    case Path::kNative: return "native";
    case Path::kReference: return "reference";
  }
  return "?";
}

absl::StatusOr<Path> PathFromEnv() {
  const char* v = std::getenv("EXL3_MOE_KERNEL");
  if (v == nullptr || *v == 0 || std::strcmp(v, "native") == 0) return Path::kNative;
  if (std::strcmp(v, "reference") == 0) return Path::kReference;
  return absl::InvalidArgumentError(
      absl::StrCat("EXL3_MOE_KERNEL=", std::string(v), " is not 'native' or 'reference'"));
}

Path ResolvePath(Path requested, int cc_major, const char* what) {
  Path p = requested;
  const char* why = "requested";
  if (p == Path::kAuto) {
    auto env = PathFromEnv();
    p = env.ok() ? *env : Path::kNative;
    why = std::getenv("EXL3_MOE_KERNEL") ? "EXL3_MOE_KERNEL" : "default";
  }
  if (p == Path::kNative && cc_major < 8) {
    p = Path::kReference;
    why = "device below sm_80 (no mma.sync m16n8k16): falling back";
  }
  static std::mutex mu;
  static std::set<std::string> logged;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = absl::StrCat(what, "/", PathName(p));
  if (logged.insert(key).second) {
    std::fprintf(stderr, "exl3 cuda: %s uses the %s path (%s)\n", what, PathName(p), why);
  }
  return p;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  return p;
}
void DeviceFree(void* p) {
  if (p) cudaFree(p);
}
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}
absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}
absl::Status Synchronize(StreamHandle stream) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}
absl::StatusOr<void*> HostAlloc(size_t bytes) {
  void* p = nullptr;
  EXL3_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, std::max<size_t>(bytes, 16), cudaHostAllocDefault));
  return p;
}
void HostFree(void* p) {
  if (p) cudaFreeHost(p);
}
absl::StatusOr<StreamHandle> StreamCreate() {
  cudaStream_t s = nullptr;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&s));
  return static_cast<StreamHandle>(s);
}
void StreamDestroy(StreamHandle stream) {
  if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

}  // namespace exl3::cuda

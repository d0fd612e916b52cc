// HostRegistration: host memory pinned and mapped for the device (cudaHostRegister), page-aligned
// and merged so that neighbouring tensors sharing a page are registered once.
#include <cuda_runtime.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/page_intervals.h"

namespace exl3::cuda {

HostRegistration::~HostRegistration() {
  for (const PageInterval& iv : intervals_) cudaHostUnregister(reinterpret_cast<void*>(iv.first));
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Create(
    const std::vector<HostRange>& ranges) {
  std::unique_ptr<HostRegistration> reg(new HostRegistration());
  std::vector<ByteRange> bytes;
  bytes.reserve(ranges.size());
  for (const HostRange& r : ranges) bytes.push_back({r.data, r.bytes});
  const std::vector<PageInterval> todo = MergeToPages(bytes, static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)));
  int dev = 0, read_only_ok = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&read_only_ok, cudaDevAttrHostRegisterReadOnlySupported, dev));
  // Registered one by one; on failure the destructor unregisters those done so far.
  for (const PageInterval& iv : todo) {
    void* p = reinterpret_cast<void*>(iv.first);
    const size_t n = iv.second - iv.first;
    // Writable first: the pages may hold other data (heap memory), which a read-only
    // registration would make invalid as a copy destination. Read-only mappings (mmap'd model
    // files) refuse that; they are registered read-only.
    cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterMapped);
    if (e != cudaSuccess && read_only_ok) {
      cudaGetLastError();
      e = cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot register ", n, " bytes of host memory at ", absl::Hex(iv.first), " for the GPU: ",
          cudaGetErrorString(e)));
    }
    reg->intervals_.push_back(iv);
    reg->bytes_ += n;
  }
  return reg;
}

bool HostRegistration::Covers(const void* data, size_t bytes) const {
  return IntervalsCover(intervals_, data, bytes);
}

}  // namespace exl3::cuda

// HostRegistration: host memory pinned and mapped for the device (cudaHostRegister), page-aligned
// and merged so that neighbouring tensors sharing a page are registered once.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {

HostRegistration::~HostRegistration() {
  for (const Interval& iv : intervals_) cudaHostUnregister(reinterpret_cast<void*>(iv.first));
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Create(
    const std::vector<HostRange>& ranges) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<Interval> pages;
  pages.reserve(ranges.size());
  for (const HostRange& r : ranges) {
    if (r.data == nullptr || r.bytes == 0) continue;
    const uintptr_t b = reinterpret_cast<uintptr_t>(r.data);
    pages.emplace_back(b / page * page, (b + r.bytes + page - 1) / page * page);
  }
  std::sort(pages.begin(), pages.end());
  std::unique_ptr<HostRegistration> reg(new HostRegistration());
  for (const Interval& iv : pages) {
    if (!reg->intervals_.empty() && iv.first <= reg->intervals_.back().second) {
      reg->intervals_.back().second = std::max(reg->intervals_.back().second, iv.second);
    } else {
      reg->intervals_.push_back(iv);
    }
  }
  int dev = 0, read_only_ok = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&read_only_ok, cudaDevAttrHostRegisterReadOnlySupported, dev));
  // Registered one by one; on failure the destructor unregisters those done so far.
  std::vector<Interval> todo;
  todo.swap(reg->intervals_);
  for (const Interval& iv : todo) {
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
          cudaGetErrorString(e), " (is the memlock limit, ulimit -l, too low?)"));
    }
    reg->intervals_.push_back(iv);
    reg->bytes_ += n;
  }
  return reg;
}

bool HostRegistration::Covers(const void* data, size_t bytes) const {
  if (data == nullptr || bytes == 0) return true;
  const uintptr_t b = reinterpret_cast<uintptr_t>(data);
  // The last interval starting at or before b must reach b + bytes (intervals are disjoint).
  auto it = std::upper_bound(intervals_.begin(), intervals_.end(), Interval(b, UINTPTR_MAX));
  if (it == intervals_.begin()) return false;
  --it;
  return b >= it->first && b + bytes <= it->second;
}

}  // namespace exl3::cuda

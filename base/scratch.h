// Scratch vectors that are kept from call to call (once warm, the hot path neither allocates nor
// zero-fills) are given back after a call that grew them past kKeepScratchBytes: a burst of large
// requests (long prefills, tens of MB per message) then leaves no buffers of its size behind in
// the router or the workers (tests/services/router/resource_faults_test.py measures it).
//
//   Grow(buf, T * H); ... compute ...; ReleaseScratchIfLarge(buf);
#pragma once

#include <cstddef>
#include <vector>

namespace exl3 {

inline constexpr size_t kKeepScratchBytes = 8u << 20;
// For a set of many scratch vectors (one per expert and projection): the most they keep together.
inline constexpr size_t kKeepScratchTotalBytes = 64u << 20;

template <class T>
size_t ScratchBytes(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

template <class T>
void ReleaseScratch(std::vector<T>& v) {
  std::vector<T>().swap(v);
}

template <class T>
void ReleaseScratchIfLarge(std::vector<T>& v) {
  if (ScratchBytes(v) > kKeepScratchBytes) ReleaseScratch(v);
}

}  // namespace exl3

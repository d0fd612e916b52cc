// A few byte buffers kept between messages of a process's hot path, so that the next message of
// about the same size is written into warm pages. A 1 MB buffer allocated afresh costs a page
// fault per 4 KiB (and glibc may hand its pages back to the kernel when it is freed, then fault
// them in again): on the 2-core VM that was a third of the caller's CPU time per 64-token remote
// MoE layer call (bench/results/service.md).
//
//   std::string b = spare.Take();   // empty, with the capacity of a buffer given back, if any
//   b.assign(bytes, n);             // no allocation when the capacity suffices
//   ...
//   spare.Give(std::move(b));       // kept unless over the bounds; otherwise freed
//
// Thread-safe. Bounded: at most kMaxBuffers buffers of at most kMaxBufferBytes capacity each, so
// what it keeps stays small against the message sizes it serves.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace exl3::svc {

class SpareBuffers {
 public:
  static constexpr size_t kMaxBuffers = 4;
  static constexpr size_t kMaxBufferBytes = 8u << 20;
  // Smaller buffers are left to malloc (it keeps them warm in its arenas).
  static constexpr size_t kMinBufferBytes = 64u << 10;

  // An empty buffer: the largest one kept, or a fresh one when none is.
  std::string Take();
  // Keeps `b` (its contents dropped) if its capacity is within the bounds and fewer than
  // kMaxBuffers are kept.
  void Give(std::string&& b);
  size_t kept() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::string> kept_;  // guarded by mu_
};

}  // namespace exl3::svc

// Giving freed heap memory back to the kernel. glibc keeps what a burst of large requests freed
// (tens of MB per message: gRPC's slices, the parsed messages, per-worker copies, partial sums)
// in its arenas, so a router that served a burst of 20-150 MB requests stayed at 0.7-1.5 GB of
// resident memory for good, and workers at hundreds of MB (resource_faults_test measures it).
//
//   MemoryReturner returner(MemoryReturnOptions{});   // in main, after start-up
//   ...                                               // its thread trims while it lives
//
// At construction: allocations of at least `mmap_threshold_bytes` get their own mapping, which
// free() unmaps at once (glibc's threshold is otherwise raised by every such free up to 32 MiB,
// after which those buffers stay in the heap). Then a thread checks every `period` how much free
// memory the arenas hold (mallinfo2: one pass over the free lists) and calls malloc_trim(0)
// (which hands every whole free page of every arena back with MADV_DONTNEED) when that is above
// `trim_above_bytes` and either it or the resident memory changed since the last trim: a steady
// state costs no trims.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace exl3::svc {

struct MemoryReturnOptions {
  size_t mmap_threshold_bytes = 4u << 20;
  size_t trim_above_bytes = 32u << 20;
  std::chrono::milliseconds period{500};
};

class MemoryReturner {
 public:
  explicit MemoryReturner(MemoryReturnOptions opt);
  ~MemoryReturner();
  MemoryReturner(const MemoryReturner&) = delete;
  MemoryReturner& operator=(const MemoryReturner&) = delete;

  // Trims now if the arenas hold more free memory than the threshold and it changed since the
  // last trim; returns whether it trimmed. Called by the thread; public for tests.
  bool TrimIfWorthIt();
  uint64_t trims() const;

 private:
  void Run();
  const MemoryReturnOptions opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;             // guarded by mu_
  size_t free_after_trim_ = 0;      // guarded by mu_: arena free bytes right after the last trim
  size_t resident_after_trim_ = 0;  // guarded by mu_: resident bytes then
  uint64_t trims_ = 0;            // guarded by mu_
  std::thread thread_;
};

}  // namespace exl3::svc

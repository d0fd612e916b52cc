// Giving freed heap memory back to the kernel. glibc keeps what a burst of large requests freed
// (tens of MB per message: gRPC's slices, the parsed messages, per-worker copies, partial sums)
// in its arenas, so a router that served a burst of 20-150 MB requests stayed at 0.7-1.5 GB of
// resident memory for good, and workers at hundreds of MB (resource_faults_test measures it).
//
//   MemoryReturner returner(MemoryReturnOptions{});   // in main, after start-up
//   ...                                               // its thread trims while it lives
//
// At construction: allocations of at least `mmap_threshold_bytes` get their own mapping, which
// free() unmaps at once (glibc's threshold is otherwise raised by every such free up to 32 MiB);
// smaller ones come from the arenas, and free() no longer hands the top of a heap back by itself
// (M_TRIM_THRESHOLD): the thread below does. A message buffer under the threshold (a 1024-token
// prefill chunk of hidden 4096 in fp32 is 16 MB) is so reused warm by the next message instead of
// being mapped afresh, which cost a page fault per 4 KiB for every buffer of every message (4-8 ms
// per 16 MB on a 2-core VM, bench/results/service.md). The thread checks every `period` how much
// free memory the arenas hold (mallinfo2: one pass over the free lists) and calls malloc_trim(0)
// (which hands every whole free page of every arena back with MADV_DONTNEED) when that is above
// `trim_above_bytes` and either it or the resident memory changed since the last trim: an idle
// process costs no trims, a busy one at most one per period (its buffers then fault in once more).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace exl3::svc {

struct MemoryReturnOptions {
  size_t mmap_threshold_bytes = 32u << 20;  // glibc's largest (HEAP_MAX_SIZE / 2)
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

// Making a worker's expert tensors resident: every byte range of the held experts' tensors is
// read in parallel threads (page by page from the mapped files), with Residency::kOwned moved
// into anonymous memory of the process at the same addresses, and, where permitted, locked in
// RAM (mlock), with a progress bar on stderr and the achieved GB/s.
//
//   std::vector<TensorRange> ranges = HeldTensorRanges(model);
//   LoadStats s = MakeResident(ranges, /*threads=*/8, /*lock=*/true, /*progress=*/true,
//                              Residency::kOwned);
//   // s.bytes, s.seconds, s.locked_bytes (0 where mlock is not permitted: RLIMIT_MEMLOCK)
//
// Owned weights survive changes to the model files after the load: a file truncated, rewritten
// or replaced under a running worker no longer backs the pages it computes from (with kMapped a
// truncated file turns the next read of a page past its new end into SIGBUS).
// A ModelFileWatch (model/model_file_watch.h) tells the operator when that happened.
//
// BaselineRead does a plain parallel pread of the same file ranges (after dropping them from the
// page cache) so the load speed can be compared with what the disk gives in the same run.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/exl3_model.h"

namespace exl3::worker {

struct TensorRange {
  const uint8_t* data = nullptr;  // in the mapped file
  size_t size = 0;
  std::string file;
  uint64_t file_offset = 0;  // of data inside `file`
};

// The ranges of every tensor of every held routed expert (gate, up, down of each), and with
// `shared` those of every MoE layer's shared expert.
std::vector<TensorRange> HeldTensorRanges(const Exl3Model& model, bool shared = false);

struct LoadStats {
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t locked_bytes = 0;
  std::string lock_error;  // why mlock failed, when it did
  uint64_t owned_bytes = 0;  // Residency::kOwned: bytes now in anonymous memory (page-rounded)
  std::string own_error;     // why a span could not be moved into owned memory, when one could not
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

// kMapped: the pages stay those of the mapped files (page cache). kOwned: each page-aligned span
// holding a range is copied into anonymous memory, read-only, that then replaces the file mapping
// at the same addresses (mremap), so every pointer into the model stays valid and no longer
// depends on the file. Costs one memcpy of the held bytes at load; the file's page cache is left
// to the kernel to reclaim.
enum class Residency { kMapped, kOwned };

LoadStats MakeResident(const std::vector<TensorRange>& ranges, int threads, bool lock,
                       bool progress, Residency residency = Residency::kMapped);

// Drops the files' pages from the page cache (POSIX_FADV_DONTNEED: only pages not mapped-in or
// locked go), then preads every range in parallel into scratch buffers. Returns bytes/seconds.
LoadStats BaselineRead(const std::vector<TensorRange>& ranges, int threads);
void DropFromPageCache(const std::vector<TensorRange>& ranges);

// Runs fn(0), ..., fn(n - 1) on up to `threads` threads, each taking the next index.
void ParallelFor(int threads, size_t n, const std::function<void(size_t)>& fn);

// Reads one byte of every page of [begin, begin + size) (page-aligned): faults a mapped file in.
void TouchPages(uintptr_t begin, size_t size, size_t page);

// "loading experts [####....] 42.0% 1.20/2.86 GB 3.10 GB/s" on stderr, redrawn every 200 ms
// while `show`, until Finish (or destruction) draws it a last time. Add may be called from any
// thread.
class LoadProgressBar {
 public:
  LoadProgressBar(uint64_t total_bytes, bool show);
  ~LoadProgressBar();
  LoadProgressBar(const LoadProgressBar&) = delete;
  LoadProgressBar& operator=(const LoadProgressBar&) = delete;
  void Add(uint64_t bytes) { done_.fetch_add(bytes); }
  void Finish();
  double seconds() const;  // since construction

 private:
  void Draw(bool final) const;
  const uint64_t total_;
  const bool show_;
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  std::atomic<uint64_t> done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;  // guarded by mu_
  std::thread thread_;
};

// Unlocks what MakeResident locked (the model's mapping must still be alive).
void UnlockRanges(const std::vector<TensorRange>& ranges);

// The files `ranges` come from, each once (for a ModelFileWatch: model/model_file_watch.h).
std::vector<std::string> FilesOf(const std::vector<TensorRange>& ranges);

}  // namespace exl3::worker

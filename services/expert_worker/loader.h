// Making a worker's expert tensors resident: every byte range of the held experts' tensors is
// read in parallel threads (page by page from the mapped files) and, where permitted, locked in
// RAM (mlock), with a progress bar on stderr and the achieved GB/s.
//
//   std::vector<TensorRange> ranges = HeldTensorRanges(model);
//   LoadStats s = MakeResident(ranges, /*threads=*/8, /*lock=*/true, /*progress=*/true);
//   // s.bytes, s.seconds, s.locked_bytes (0 where mlock is not permitted: RLIMIT_MEMLOCK)
//
// BaselineRead does a plain parallel pread of the same file ranges (after dropping them from the
// page cache) so the load speed can be compared with what the disk gives in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
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
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

LoadStats MakeResident(const std::vector<TensorRange>& ranges, int threads, bool lock,
                       bool progress);

// Drops the files' pages from the page cache (POSIX_FADV_DONTNEED: only pages not mapped-in or
// locked go), then preads every range in parallel into scratch buffers. Returns bytes/seconds.
LoadStats BaselineRead(const std::vector<TensorRange>& ranges, int threads);
void DropFromPageCache(const std::vector<TensorRange>& ranges);

// Unlocks what MakeResident locked (the model's mapping must still be alive).
void UnlockRanges(const std::vector<TensorRange>& ranges);

}  // namespace exl3::worker

#include "services/common/memory_return.h"

#include <malloc.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace exl3::svc {
namespace {

size_t ArenaFreeBytes() {
  const struct mallinfo2 mi = mallinfo2();
  return mi.fordblks;
}

// Resident bytes of the process (/proc/self/statm, second field, in pages).
size_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

size_t Distance(size_t a, size_t b) { return a > b ? a - b : b - a; }

}  // namespace

MemoryReturner::MemoryReturner(MemoryReturnOptions opt) : opt_(opt) {
  if (opt_.mmap_threshold_bytes > 0) mallopt(M_MMAP_THRESHOLD, static_cast<int>(opt_.mmap_threshold_bytes));
  thread_ = std::thread([this] { Run(); });
}

MemoryReturner::~MemoryReturner() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool MemoryReturner::TrimIfWorthIt() {
  const size_t free_now = ArenaFreeBytes();
  std::lock_guard<std::mutex> l(mu_);
  // Free chunks that a trim already gave back stay on the free lists (counted by fordblks): only
  // a change of them since, or resident memory grown since (free pages touched again, then freed
  // again), means there is something to give back.
  constexpr size_t kChange = 1u << 20;
  if (free_now < opt_.trim_above_bytes) return false;
  if (Distance(free_now, free_after_trim_) < kChange && ResidentBytes() < resident_after_trim_ + kChange) {
    return false;
  }
  malloc_trim(0);
  free_after_trim_ = ArenaFreeBytes();
  resident_after_trim_ = ResidentBytes();
  ++trims_;
  return true;
}

uint64_t MemoryReturner::trims() const {
  std::lock_guard<std::mutex> l(mu_);
  return trims_;
}

void MemoryReturner::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!cv_.wait_for(l, opt_.period, [this] { return stop_; })) {
    l.unlock();
    TrimIfWorthIt();
    l.lock();
  }
}

}  // namespace exl3::svc

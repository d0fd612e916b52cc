#include "services/expert_worker/loader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/owned_pages.h"
#include "base/logging.h"

namespace exl3::worker {
namespace {

constexpr size_t kChunk = 8u << 20;  // unit of work handed to a thread

struct Piece {
  const TensorRange* r;
  size_t offset, size;
};

std::vector<Piece> Split(const std::vector<TensorRange>& ranges) {
  std::vector<Piece> pieces;
  for (const auto& r : ranges) {
    for (size_t o = 0; o < r.size; o += kChunk) pieces.push_back({&r, o, std::min(kChunk, r.size - o)});
  }
  return pieces;
}

// A page-aligned address range.
struct Span {
  uintptr_t begin = 0;
  size_t size = 0;
};

// The page-aligned spans covering `ranges`, sorted, overlapping and touching ones merged (each
// range lies in one mapping, and merged spans cover only mapped pages).
std::vector<Span> PageSpans(const std::vector<TensorRange>& ranges, size_t page) {
  std::vector<Span> spans;
  for (const auto& r : ranges) {
    if (r.size == 0) continue;
    const uintptr_t a = reinterpret_cast<uintptr_t>(r.data) & ~(page - 1);
    const uintptr_t b = (reinterpret_cast<uintptr_t>(r.data) + r.size + page - 1) & ~(page - 1);
    spans.push_back({a, b - a});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  std::vector<Span> merged;
  for (const Span& s : spans) {
    if (!merged.empty() && s.begin <= merged.back().begin + merged.back().size) {
      const uintptr_t end = std::max(merged.back().begin + merged.back().size, s.begin + s.size);
      merged.back().size = end - merged.back().begin;
    } else {
      merged.push_back(s);
    }
  }
  return merged;
}

// Cuts spans into pieces of at most `chunk` bytes (a multiple of the page size).
std::vector<Span> SplitSpans(const std::vector<Span>& spans, size_t chunk) {
  std::vector<Span> out;
  for (const Span& s : spans) {
    for (size_t o = 0; o < s.size; o += chunk) out.push_back({s.begin + o, std::min(chunk, s.size - o)});
  }
  return out;
}

// Header length of a safetensors file: the data section starts at 8 + this.
uint64_t DataOffset(const std::string& file) {
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  uint64_t n = 0;
  if (pread(fd, &n, 8, 0) != 8) n = 0;
  close(fd);
  return 8 + n;
}

}  // namespace

void TouchPages(uintptr_t begin, size_t size, size_t page) {
  // Faults the file in (read-ahead makes this sequential I/O).
  volatile uint8_t sink = 0;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(begin);
  for (size_t o = 0; o < size; o += page) sink = static_cast<uint8_t>(sink ^ q[o]);
}

void ParallelFor(int threads, size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> ts;
  const int nt = std::max(1, std::min<int>(threads, static_cast<int>(n)));
  for (int i = 0; i < nt; ++i) {
    ts.emplace_back([&] {
      for (size_t k; (k = next.fetch_add(1)) < n;) fn(k);
    });
  }
  for (auto& t : ts) t.join();
}

LoadProgressBar::LoadProgressBar(uint64_t total, bool show) : total_(total), show_(show) {
  if (show_) {
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> l(mu_);
      while (!finished_) {
        l.unlock();
        Draw(false);
        l.lock();
        cv_.wait_for(l, std::chrono::milliseconds(200));
      }
    });
  }
}

LoadProgressBar::~LoadProgressBar() { Finish(); }

void LoadProgressBar::Finish() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (finished_) return;
    finished_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (show_) Draw(true);
}

double LoadProgressBar::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

void LoadProgressBar::Draw(bool final) const {
  const int width = 40;
  const uint64_t done = done_.load();
  const double secs = seconds();
  const double frac = total_ ? static_cast<double>(done) / total_ : 1.0;
  const int fill = static_cast<int>(frac * width);
  char bar[width + 1];
  for (int i = 0; i < width; ++i) bar[i] = i < fill ? '#' : '.';
  bar[width] = 0;
  std::fprintf(stderr, "\rloading experts [%s] %5.1f%% %.2f/%.2f GB %.2f GB/s%s", bar, frac * 100,
               done / 1e9, total_ / 1e9, secs > 0 ? done / secs / 1e9 : 0.0, final ? "\n" : "");
  std::fflush(stderr);
}

std::vector<TensorRange> HeldTensorRanges(const Exl3Model& model, bool shared) {
  std::vector<TensorRange> out;
  std::map<std::string, uint64_t> data_offset;
  const MoeConfig& c = model.config();
  for (int layer : c.MoeLayers()) {
    std::vector<int> experts = model.HeldExperts(layer);
    if (shared && model.SharedExpert(layer) != nullptr) experts.push_back(-1);  // -1: the shared one
    for (int e : experts) {
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const Exl3Linear* lin = model.Linear(layer, e, p);
        if (lin == nullptr) continue;
        for (const TensorView& t : lin->tensors) {
          auto it = data_offset.find(t.file);
          if (it == data_offset.end()) it = data_offset.emplace(t.file, DataOffset(t.file)).first;
          out.push_back({t.data, t.size_bytes(), t.file, it->second + t.info->begin});
        }
      }
    }
  }
  return out;
}

LoadStats MakeResident(const std::vector<TensorRange>& ranges, int threads, bool lock,
                       bool progress, Residency residency) {
  LoadStats st;
  for (const auto& r : ranges) st.bytes += r.size;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Page-aligned spans: disjoint, so that each page is copied (kOwned) or locked by one thread.
  const std::vector<Span> pieces = SplitSpans(PageSpans(ranges, page), kChunk);
  uint64_t span_bytes = 0;
  for (const Span& p : pieces) span_bytes += p.size;
  std::atomic<uint64_t> locked{0};
  std::atomic<bool> lock_ok{lock};
  std::mutex err_mu;
  std::string own_error;
  LoadProgressBar bar(span_bytes, progress);
  ParallelFor(threads, pieces.size(), [&](size_t k) {
    const Span& p = pieces[k];
    void* at = reinterpret_cast<void*>(p.begin);
    madvise(at, p.size, MADV_WILLNEED);
    if (residency == Residency::kOwned) {
      if (absl::Status s = ReplaceWithOwnedCopy(p.begin, p.size); !s.ok()) {
        std::lock_guard<std::mutex> l(err_mu);
        if (own_error.empty()) own_error = std::string(s.message());
      }
    } else {
      TouchPages(p.begin, p.size, page);
    }
    if (lock_ok.load(std::memory_order_relaxed)) {
      if (mlock(at, p.size) == 0) {
        locked.fetch_add(p.size);
      } else {
        const int e = errno;
        std::lock_guard<std::mutex> l(err_mu);
        if (lock_ok.exchange(false)) {
          st.lock_error = std::strerror(e);
        }
      }
    }
    bar.Add(p.size);
  });
  st.seconds = bar.seconds();
  bar.Finish();
  if (!st.lock_error.empty()) {
    // Partial locking is worse than none: unlock what was locked so the gauge stays honest.
    UnlockRanges(ranges);
    locked.store(0);
  }
  st.locked_bytes = locked.load();
  st.own_error = own_error;
  if (residency == Residency::kOwned && own_error.empty()) st.owned_bytes = span_bytes;
  return st;
}

void UnlockRanges(const std::vector<TensorRange>& ranges) {
  const long page = sysconf(_SC_PAGESIZE);
  for (const auto& r : ranges) {
    if (r.size == 0) continue;
    const uintptr_t a = reinterpret_cast<uintptr_t>(r.data) & ~static_cast<uintptr_t>(page - 1);
    const uintptr_t b = reinterpret_cast<uintptr_t>(r.data) + r.size;
    munlock(reinterpret_cast<void*>(a), b - a);
  }
}

void DropFromPageCache(const std::vector<TensorRange>& ranges) {
  std::set<std::string> files;
  for (const auto& r : ranges) files.insert(r.file);
  for (const auto& f : files) {
    const int fd = open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

LoadStats BaselineRead(const std::vector<TensorRange>& ranges, int threads) {
  DropFromPageCache(ranges);
  LoadStats st;
  for (const auto& r : ranges) st.bytes += r.size;
  const std::vector<Piece> pieces = Split(ranges);
  std::map<std::string, int> fds;
  for (const auto& r : ranges) {
    if (!fds.count(r.file)) fds[r.file] = open(r.file.c_str(), O_RDONLY | O_CLOEXEC);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<uint64_t> read_bytes{0};
  ParallelFor(threads, pieces.size(), [&](size_t k) {
    thread_local std::vector<uint8_t> buf;
    const Piece& p = pieces[k];
    buf.resize(p.size);
    const int fd = fds.at(p.r->file);
    size_t got = 0;
    while (got < p.size) {
      const ssize_t n = pread(fd, buf.data() + got, p.size - got, p.r->file_offset + p.offset + got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    read_bytes.fetch_add(got);
  });
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.bytes = read_bytes.load();
  for (auto& [f, fd] : fds) {
    if (fd >= 0) close(fd);
  }
  return st;
}

std::vector<std::string> FilesOf(const std::vector<TensorRange>& ranges) {
  std::vector<std::string> files;
  std::set<std::string> seen;
  for (const TensorRange& r : ranges) {
    if (seen.insert(r.file).second) files.push_back(r.file);
  }
  return files;
}

}  // namespace exl3::worker

#include "services/expert_worker/host_resident_weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace exl3::worker {
namespace {

uintptr_t Begin(const TensorRange& r) { return reinterpret_cast<uintptr_t>(r.data); }
uintptr_t End(const TensorRange& r) { return Begin(r) + r.size; }
uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// One thread's unit of work: a page-aligned piece of one group's span.
struct Chunk {
  size_t group = 0;
  uintptr_t begin = 0, end = 0;
};

// Drops the page cache of each file's bytes in [lo, hi) (POSIX_FADV_DONTNEED: only pages no
// process maps or locks go, so the in-place groups and other readers of the files keep theirs).
void DropCachedFileRanges(const std::map<std::string, std::pair<uint64_t, uint64_t>>& spans) {
  for (const auto& [file, span] : spans) {
    const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    posix_fadvise(fd, static_cast<off_t>(span.first), static_cast<off_t>(span.second - span.first),
                  POSIX_FADV_DONTNEED);
    close(fd);
  }
}

}  // namespace

HostPlacementPlan PlanHostPlacement(const std::vector<TensorRange>& ranges, size_t page) {
  HostPlacementPlan plan;
  plan.copy_offset.assign(ranges.size(), 0);
  std::vector<size_t> order;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].size > 0 && ranges[i].data != nullptr) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return Begin(ranges[a]) != Begin(ranges[b]) ? Begin(ranges[a]) < Begin(ranges[b])
                                                : ranges[a].size < ranges[b].size;
  });
  const uintptr_t mask = ~static_cast<uintptr_t>(page - 1);
  std::vector<std::vector<size_t>> duplicates_of(ranges.size());  // same data and size, placed as one
  size_t run_first = 0;  // the first range of the current run of equal ranges
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorRange& r = ranges[order[k]];
    if (k > 0 && Begin(ranges[run_first]) == Begin(r) && ranges[run_first].size == r.size) {
      duplicates_of[run_first].push_back(order[k]);
      continue;
    }
    run_first = order[k];
    const uintptr_t b = Begin(r) & mask;
    const uintptr_t e = (End(r) + page - 1) & mask;
    if (plan.groups.empty() || b >= plan.groups.back().end) {  // shares no page with the last group
      plan.groups.push_back({b, e, Placement::kInPlace, {}});
    } else {
      plan.groups.back().end = std::max(plan.groups.back().end, e);
    }
    plan.groups.back().tensors.push_back(order[k]);
  }
  for (HostPlacementPlan::Group& g : plan.groups) {
    const bool aligned = std::all_of(g.tensors.begin(), g.tensors.end(), [&](size_t i) {
      return Begin(ranges[i]) % kGpuLoadAlignment == 0;
    });
    g.placement = aligned ? Placement::kInPlace : Placement::kRealignedCopy;
    for (size_t i : g.tensors) {
      if (g.placement == Placement::kInPlace) {
        plan.in_place_bytes += ranges[i].size;
        continue;
      }
      plan.copy_offset[i] = plan.copy_bytes;
      for (size_t d : duplicates_of[i]) plan.copy_offset[d] = plan.copy_bytes;
      plan.copy_bytes += RoundUp(ranges[i].size, kCopyAlignment);
      plan.copied_bytes += ranges[i].size;
    }
  }
  return plan;
}

absl::StatusOr<std::unique_ptr<HostResidentWeights>> HostResidentWeights::Load(
    const std::vector<TensorRange>& ranges, const HostLoadOptions& options) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const HostPlacementPlan plan = PlanHostPlacement(ranges, page);
  std::unique_ptr<HostResidentWeights> w(new HostResidentWeights());
  w->stats_.in_place_bytes = plan.in_place_bytes;
  w->stats_.copied_bytes = plan.copied_bytes;
  w->stats_.bytes = plan.in_place_bytes + plan.copied_bytes;
  w->stats_.copy_bytes = plan.copy_bytes;
  if (plan.copy_bytes > 0) {
    // Not populated: its pages become resident as the copy fills them, while the file pages they
    // replace leave.
    w->copy_mapped_ = RoundUp(plan.copy_bytes, page);
    void* p = mmap(nullptr, w->copy_mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", w->copy_mapped_,
                                                       " bytes for the realigned copy of the weights: ",
                                                       std::strerror(errno)));
    }
    w->copy_ = p;
  }
  uint8_t* const copy = static_cast<uint8_t*>(w->copy_);

  const size_t chunk = RoundUp(std::max<size_t>(options.chunk_bytes, 1), page);
  std::vector<Chunk> chunks;
  uint64_t span_bytes = 0;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const HostPlacementPlan::Group& grp = plan.groups[g];
    span_bytes += grp.end - grp.begin;
    for (uintptr_t b = grp.begin; b < grp.end; b += chunk) chunks.push_back({g, b, std::min(grp.end, b + chunk)});
  }
  std::mutex err_mu;
  std::string error;
  std::atomic<uint64_t> dropped{0};
  LoadProgressBar bar(span_bytes, options.progress);
  ParallelFor(options.threads, chunks.size(), [&](size_t k) {
    const Chunk& c = chunks[k];
    const HostPlacementPlan::Group& grp = plan.groups[c.group];
    void* at = reinterpret_cast<void*>(c.begin);
    const size_t len = c.end - c.begin;
    madvise(at, len, MADV_WILLNEED);
    if (grp.placement == Placement::kInPlace) {
      TouchPages(c.begin, len, page);
    } else {
      // The tensors overlapping this chunk (the group's are sorted by address and disjoint or
      // equal): copy the part of each that lies inside it.
      auto it = std::partition_point(grp.tensors.begin(), grp.tensors.end(),
                                     [&](size_t i) { return End(ranges[i]) <= c.begin; });
      for (; it != grp.tensors.end() && Begin(ranges[*it]) < c.end; ++it) {
        const TensorRange& r = ranges[*it];
        const uintptr_t from = std::max(Begin(r), c.begin);
        const uintptr_t to = std::min(End(r), c.end);
        std::memcpy(copy + plan.copy_offset[*it] + (from - Begin(r)), reinterpret_cast<const void*>(from), to - from);
      }
      // The chunk's pages leave the process: the copy now holds their tensors.
      if (madvise(at, len, MADV_DONTNEED) != 0) {
        const int e = errno;
        std::lock_guard<std::mutex> l(err_mu);
        if (error.empty()) {
          error = absl::StrCat("cannot drop the file pages of copied weights: ", std::strerror(e));
        }
      } else {
        dropped.fetch_add(len);
      }
    }
    bar.Add(len);
  });
  w->stats_.seconds = bar.seconds();
  bar.Finish();
  if (!error.empty()) return absl::InternalError(error);

  for (const HostPlacementPlan::Group& g : plan.groups) {
    if (g.placement != Placement::kRealignedCopy) continue;
    std::map<std::string, std::pair<uint64_t, uint64_t>> cached;  // file -> the group's byte span
    // Again over the whole span: a neighbouring chunk's page faults may have mapped a few pages
    // of an already dropped chunk back in (fault-around).
    madvise(reinterpret_cast<void*>(g.begin), g.end - g.begin, MADV_DONTNEED);
    for (size_t i : g.tensors) {
      const TensorRange& r = ranges[i];
      w->moved_.push_back({Begin(r), r.size, reinterpret_cast<uintptr_t>(copy + plan.copy_offset[i])});
      if (r.file.empty()) continue;
      auto [it, fresh] = cached.try_emplace(r.file, r.file_offset, r.file_offset + r.size);
      if (!fresh) {
        it->second.first = std::min(it->second.first, r.file_offset);
        it->second.second = std::max(it->second.second, r.file_offset + r.size);
      }
    }
    DropCachedFileRanges(cached);
  }
  w->stats_.dropped_bytes = dropped.load();
  std::sort(w->moved_.begin(), w->moved_.end(), [](const Moved& a, const Moved& b) { return a.from < b.from; });
  return w;
}

HostResidentWeights::~HostResidentWeights() {
  if (copy_ != nullptr) munmap(copy_, copy_mapped_);
}

const void* HostResidentWeights::Resolve(const void* p) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = std::upper_bound(moved_.begin(), moved_.end(), a, [](uintptr_t x, const Moved& m) { return x < m.from; });
  if (it == moved_.begin()) return p;
  --it;
  if (a >= it->from + it->bytes) return p;
  return reinterpret_cast<const void*>(it->to + (a - it->from));
}

std::unique_ptr<PlacedMoeLayer> HostResidentWeights::Place(const MoeLayerView& layer) const {
  return std::make_unique<PlacedMoeLayer>(layer, *this);
}

namespace {

Exl3LinearView Resolved(const Exl3LinearView& v, const HostResidentWeights& w) {
  Exl3LinearView r = v;
  r.trellis = w.Resolve(v.trellis);
  r.suh = w.Resolve(v.suh);
  r.svh = w.Resolve(v.svh);
  r.bias = w.Resolve(v.bias);
  return r;
}

ExpertMlp Resolved(const ExpertMlp& m, const HostResidentWeights& w) {
  return ExpertMlp{Resolved(m.gate, w), Resolved(m.up, w), Resolved(m.down, w)};
}

}  // namespace

PlacedMoeLayer::PlacedMoeLayer(const MoeLayerView& layer, const HostResidentWeights& weights) : view_(layer) {
  experts_.reserve(layer.experts.size());  // no reallocation below: view_ points into it
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    if (layer.experts[e] == nullptr) continue;
    experts_.push_back(Resolved(*layer.experts[e], weights));
    view_.experts[e] = &experts_.back();
  }
  if (layer.shared != nullptr) {
    shared_ = Resolved(*layer.shared, weights);
    view_.shared = &shared_;
  }
  view_.shared_gate = weights.Resolve(layer.shared_gate);
}

}  // namespace exl3::worker

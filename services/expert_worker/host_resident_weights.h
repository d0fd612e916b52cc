// The weights of --weights-residency host (the unified-memory path of a GB10, where the GPU reads
// host memory at memory speed): every held tensor placed where the GPU kernels read it in place,
// whatever its alignment in the model files, and held once.
//
//   std::vector<TensorRange> ranges = HeldTensorRanges(model, shared);
//   auto w = HostResidentWeights::Load(ranges, {.threads = 8, .progress = true});
//   std::unique_ptr<PlacedMoeLayer> placed = (*w)->Place(*model.LayerView(layer));
//   // placed->view(): every tensor pointer 16-byte aligned, in the file mapping or in the copy;
//   // register the pages it points at (kernels/cuda/cuda_backend.h HostRegistration) and read
//   // them from the GPU. The model and *w must outlive `placed`.
//
// Why: the CUDA kernels read tensors with 16-byte loads, and a safetensors file promises only
// 8-byte alignment. Files written by Python's safetensors leave most EXL3 tensors 8 bytes past a
// 16-byte boundary (a 4-byte mcg / mul1 scalar shifts every later offset); files with an odd
// number of such scalars before a tensor leave it only 4-byte aligned. Copying those tensors into
// device memory, as DeviceMoeLayer::Register does for tensors it cannot read in place, holds
// them twice on a machine whose device memory is its host memory.
//
// Design: held tensors whose pages touch form a group (PlanHostPlacement), placed as a whole:
//  - kInPlace: every tensor of the group is 16-byte aligned: the kernels read the file mapping,
//    whose pages are faulted in here;
//  - kRealignedCopy: some tensor is not: every tensor of the group is copied into one anonymous
//    buffer, each at a kCopyAlignment boundary, page chunk by page chunk, and each chunk's file
//    pages leave the process (MADV_DONTNEED) as soon as they are copied, and the page cache at
//    the end (POSIX_FADV_DONTNEED; pages another process maps stay). The copy replaces the
//    mapping: resident memory while loading is the share plus the chunks in flight (threads x
//    chunk_bytes), never the share twice.
// Groups, not tensors: a page holding an aligned tensor (read in place) and the end of a
// misaligned one (copied) would stay resident beside the copy; two groups never share a page.
// Why not kernels that take 8-byte aligned tensors instead: the trellis streams into shared
// memory through cp.async.cg, which moves exactly 16 aligned bytes (kernels/cuda/gemv_kernel.cuh,
// gemm_kernel.cuh); 8-byte pieces would need twice the copies, through L1 (cp.async.ca), on the
// loop that sets the kernels' speed, and would still not cover 4-byte aligned tensors. The copy costs one memcpy of the misaligned share at start, and
// those tensors no longer depend on the files afterwards (services/expert_worker/loader.h,
// Residency::kOwned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/moe_cpu.h"
#include "services/expert_worker/loader.h"

namespace exl3::worker {

// The GPU kernels' widest loads: a tensor read in place must start at a multiple of this.
inline constexpr uintptr_t kGpuLoadAlignment = 16;
// Where each tensor starts in the realigned copy (as in DeviceMoeLayer's device blocks).
inline constexpr uint64_t kCopyAlignment = 256;

enum class Placement { kInPlace, kRealignedCopy };

struct HostPlacementPlan {
  struct Group {
    uintptr_t begin = 0, end = 0;  // the page-aligned span of the mapping holding its tensors
    Placement placement = Placement::kInPlace;
    std::vector<size_t> tensors;   // indices into the ranges, by address
  };
  std::vector<Group> groups;          // by address; no two share a page
  std::vector<uint64_t> copy_offset;  // per range: its offset in the copy (kRealignedCopy only)
  uint64_t copy_bytes = 0;            // size of the copy
  uint64_t in_place_bytes = 0;        // tensor bytes read in place
  uint64_t copied_bytes = 0;          // tensor bytes copied
};

// Groups `ranges` (empty ones skipped; the same range listed twice is placed once, at one copy
// offset) and decides each group's placement. `page` is a power of two. Touches no memory.
HostPlacementPlan PlanHostPlacement(const std::vector<TensorRange>& ranges, size_t page);

struct HostLoadOptions {
  int threads = 8;
  size_t chunk_bytes = 8u << 20;  // unit of work of a thread; rounded up to whole pages
  bool progress = false;          // progress bar on stderr
};

struct HostLoadStats {
  uint64_t bytes = 0;           // tensor bytes held (in place + copied)
  uint64_t in_place_bytes = 0;  // tensor bytes read in place from the file mapping
  uint64_t copied_bytes = 0;    // tensor bytes moved into the realigned copy
  uint64_t copy_bytes = 0;      // size of the copy (with the alignment padding)
  uint64_t dropped_bytes = 0;   // file mapping bytes (whole pages) given back after copying
  double seconds = 0;
};

class PlacedMoeLayer;

class HostResidentWeights {
 public:
  // Places every range (PlanHostPlacement), faults in-place groups in and copies the others.
  // The ranges must lie in read-only file mappings (their pages are dropped once copied) that
  // outlive this object.
  static absl::StatusOr<std::unique_ptr<HostResidentWeights>> Load(const std::vector<TensorRange>& ranges,
                                                                   const HostLoadOptions& options);
  ~HostResidentWeights();
  HostResidentWeights(const HostResidentWeights&) = delete;
  HostResidentWeights& operator=(const HostResidentWeights&) = delete;

  // Where the byte at `p` is held now: in the copy when `p` lies in a copied tensor, else `p`.
  const void* Resolve(const void* p) const;
  template <class T>
  const T* Resolve(const T* p) const {
    return static_cast<const T*>(Resolve(static_cast<const void*>(p)));
  }
  // `layer` with every tensor pointer resolved. Pointers outside the held ranges (owned buffers
  // of the model: unpacked signs, converted biases) are kept.
  std::unique_ptr<PlacedMoeLayer> Place(const MoeLayerView& layer) const;

  const HostLoadStats& stats() const { return stats_; }
  const void* copy_data() const { return copy_; }  // null when nothing was copied

 private:
  HostResidentWeights() = default;
  struct Moved {
    uintptr_t from = 0;
    size_t bytes = 0;
    uintptr_t to = 0;
  };
  std::vector<Moved> moved_;  // by `from`, disjoint
  void* copy_ = nullptr;
  size_t copy_mapped_ = 0;  // bytes of the copy's mapping (whole pages)
  HostLoadStats stats_;
};

// An MoE layer view whose tensors point where HostResidentWeights holds them. It owns the expert
// structs its view points at, so it is neither copied nor moved.
class PlacedMoeLayer {
 public:
  PlacedMoeLayer(const MoeLayerView& layer, const HostResidentWeights& weights);
  PlacedMoeLayer(const PlacedMoeLayer&) = delete;
  PlacedMoeLayer& operator=(const PlacedMoeLayer&) = delete;
  const MoeLayerView& view() const { return view_; }

 private:
  std::vector<ExpertMlp> experts_;  // the held ones, in expert order; never reallocated
  ExpertMlp shared_;
  MoeLayerView view_;
};

}  // namespace exl3::worker

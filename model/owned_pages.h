// Moving pages of a read-only file mapping into memory the process owns, at the same addresses,
// so that a model file truncated, rewritten or replaced after the load no longer backs what the
// process computes from (a truncated file turns the next read of a mapped page past its new end
// into SIGBUS). Every pointer into the mapping stays valid.
//
//   EXL3_RETURN_IF_ERROR(ReplaceWithOwnedCopy(page_aligned_begin, page_multiple_size));
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace exl3 {

// Copies [begin, begin + size) (page-aligned, inside one read-only mapping) into fresh anonymous
// memory, makes it read-only and moves it over the range (mremap with MREMAP_FIXED replaces the
// file mapping there in one step). RESOURCE_EXHAUSTED when the memory cannot be had.
absl::Status ReplaceWithOwnedCopy(uintptr_t begin, size_t size);

}  // namespace exl3

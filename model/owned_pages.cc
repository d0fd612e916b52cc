#include "model/owned_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace exl3 {

absl::Status ReplaceWithOwnedCopy(uintptr_t begin, size_t size) {
  void* at = reinterpret_cast<void*>(begin);
  void* copy = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (copy == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", size, " bytes for the weights: ", std::strerror(errno)));
  }
  std::memcpy(copy, at, size);
  if (mprotect(copy, size, PROT_READ) != 0 ||
      mremap(copy, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED) {
    const int e = errno;
    munmap(copy, size);
    return absl::InternalError(absl::StrCat("cannot move the weights' copy into place: ", std::strerror(e)));
  }
  return absl::OkStatus();
}

}  // namespace exl3

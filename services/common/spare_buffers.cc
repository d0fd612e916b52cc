#include "services/common/spare_buffers.h"

#include <algorithm>
#include <utility>

namespace exl3::svc {

std::string SpareBuffers::Take() {
  std::string b;
  std::lock_guard<std::mutex> l(mu_);
  if (kept_.empty()) return b;
  auto it = std::max_element(kept_.begin(), kept_.end(), [](const auto& x, const auto& y) {
    return x.capacity() < y.capacity();
  });
  b.swap(*it);
  kept_.erase(it);
  return b;
}

void SpareBuffers::Give(std::string&& b) {
  const size_t cap = b.capacity();
  if (cap < kMinBufferBytes || cap > kMaxBufferBytes) return;
  std::string keep;
  keep.swap(b);
  keep.clear();  // the capacity stays
  std::lock_guard<std::mutex> l(mu_);
  if (kept_.size() >= kMaxBuffers) return;  // freed (after the lock) with `keep`
  kept_.push_back(std::move(keep));
}

size_t SpareBuffers::kept() const {
  std::lock_guard<std::mutex> l(mu_);
  return kept_.size();
}

}  // namespace exl3::svc

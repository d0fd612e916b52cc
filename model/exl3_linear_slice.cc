#include "model/exl3_linear_slice.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace exl3 {

absl::StatusOr<std::unique_ptr<Exl3Linear>> SliceExl3LinearOutputs(const Exl3Linear& whole, int first, int count) {
  const Exl3LinearView& w = whole.view;
  if (first < 0 || count <= 0 || first % 128 != 0 || count % 128 != 0 || first + count > w.out_features)
    return absl::InvalidArgumentError(absl::StrCat(
        whole.prefix, ": output columns [", first, ", ", first + count, ") of ", w.out_features,
        " are not a slice of whole 128-column blocks (EXL3 transforms its outputs in such blocks)"));
  auto s = std::make_unique<Exl3Linear>();
  s->prefix = absl::StrCat(whole.prefix, "[", first, ":", first + count, "]");
  Exl3LinearView& v = s->view;
  v = w;
  v.out_features = count;
  const int rows = w.in_features / 16, tiles = count / 16, words = 16 * w.bits;
  s->owned_trellis.resize(static_cast<size_t>(rows) * tiles * words);
  for (int i = 0; i < rows; ++i)
    std::copy_n(w.tile(i, first / 16), static_cast<size_t>(tiles) * words,
                &s->owned_trellis[static_cast<size_t>(i) * tiles * words]);
  v.trellis = s->owned_trellis.data();
  s->owned_suh.assign(w.suh, w.suh + w.in_features);
  v.suh = s->owned_suh.data();
  s->owned_svh.assign(w.svh + first, w.svh + first + count);
  v.svh = s->owned_svh.data();
  if (w.bias != nullptr) {
    s->owned_bias.assign(w.bias + first, w.bias + first + count);
    v.bias = s->owned_bias.data();
  }
  s->bytes = (s->owned_trellis.size() + s->owned_suh.size() + s->owned_svh.size() + s->owned_bias.size()) * 2;
  return s;
}

}  // namespace exl3

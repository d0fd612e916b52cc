#include "engine/cpu/attention/dsv4_grouped_wo_a.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/linear.h"

namespace exl3::engine {
namespace {

// Whether a layer (EXL3 or dense) is stored at `prefix`.
bool HasLayer(const TensorSource& src, const std::string& prefix) {
  return src.Has(prefix + ".trellis") || src.Has(prefix + ".weight");
}

absl::StatusOr<std::vector<float>> DenseWithoutBias(const TensorSource& src,
                                                    const std::string& prefix, int in, int out) {
  EXL3_ASSIGN_OR_RETURN(Linear l, Linear::Load(src, prefix, in, out));
  if (l.has_bias()) return absl::InvalidArgumentError(absl::StrCat(prefix, ": has a bias (wo_a has none)"));
  return l.DenseWeight();
}

}  // namespace

absl::StatusOr<std::vector<float>> LoadGroupedWoA(const TensorSource& src, const std::string& prefix,
                                                  int o_groups, int o_lora_rank, int in_per_group) {
  auto slice = [&](int g) { return absl::StrCat(prefix, ".slice.", g); };
  const bool grouped = HasLayer(src, prefix), sliced = HasLayer(src, slice(0));
  if (grouped && sliced)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": stored both as one layer and as "
                                                   "per-group slices (", slice(0), ", ...)"));
  if (!sliced) return DenseWithoutBias(src, prefix, in_per_group, o_groups * o_lora_rank);
  if (HasLayer(src, slice(o_groups)))
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": has a slice ", o_groups, " but the "
                                                   "config has ", o_groups, " output groups"));
  std::vector<float> w;
  w.reserve(static_cast<size_t>(o_groups) * o_lora_rank * in_per_group);
  for (int g = 0; g < o_groups; ++g) {
    if (!HasLayer(src, slice(g)))
      return absl::NotFoundError(absl::StrCat(prefix, ": slice ", g, " of ", o_groups, " (",
                                              slice(g), ") is missing"));
    EXL3_ASSIGN_OR_RETURN(std::vector<float> rows,
                          DenseWithoutBias(src, slice(g), in_per_group, o_lora_rank));
    w.insert(w.end(), rows.begin(), rows.end());
  }
  return w;
}

}  // namespace exl3::engine

// A generated model's spec (test_model_spec.h) with its family's defaults filled in and checked,
// last by the engine's config parser reading the config.json it would write (family_config.h).
#pragma once

#include "absl/status/statusor.h"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// Fills the family defaults (-1 fields) and checks the spec (multiples of 128 for hidden and
// intermediate sizes, top_k <= experts, groups dividing experts, ...).
absl::StatusOr<TestModelSpec> ResolveTestModelSpec(const TestModelSpec& spec);

}  // namespace exl3

// A reference.safetensors' tensors as the engine tests read them (tests/fixtures/engine/*/
// reference.safetensors): fp32 values (any stored float dtype) or int32 ids, a failed expectation
// and an empty vector where the tensor is missing or unreadable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/safetensors.h"

namespace exl3::engine::testing {

inline std::vector<float> ReferenceFloats(const TensorSource& ref, const std::string& name) {
  auto t = ref.Get(name);
  EXPECT_TRUE(t.ok()) << name;
  if (!t.ok()) return {};
  auto f = ToFloat32(*t);
  EXPECT_TRUE(f.ok()) << name << ": " << f.status();
  return f.ok() ? *f : std::vector<float>{};
}

inline std::vector<int32_t> ReferenceInts(const TensorSource& ref, const std::string& name) {
  auto t = ref.Get(name);
  EXPECT_TRUE(t.ok()) << name;
  if (!t.ok()) return {};
  return std::vector<int32_t>(t->as<int32_t>(), t->as<int32_t>() + t->size_bytes() / sizeof(int32_t));
}

}  // namespace exl3::engine::testing

// LoadGroupedWoA: DeepSeek-V4's wo_a read alike from one grouped layer and from exllamav3's
// per-group slices (wo_a.slice.G); inconsistent layouts are refused by name.
#include "engine/cpu/attention/dsv4_grouped_wo_a.h"

#include <filesystem>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

constexpr int kGroups = 2, kRank = 3, kIn = 4;

// The grouped weight [kGroups * kRank, kIn]: w[r][i] = 10 r + i.
std::vector<float> Grouped() {
  std::vector<float> w(kGroups * kRank * kIn);
  for (int r = 0; r < kGroups * kRank; ++r)
    for (int i = 0; i < kIn; ++i) w[r * kIn + i] = 10.0f * r + i;
  return w;
}

// A file with dense layers: "wo_a" grouped (when `grouped`) and the slices `slices` of it.
std::string Write(const std::string& name, bool grouped, const std::vector<int>& slices) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("dsv4_grouped_wo_a_test_" + std::to_string(::getpid()) + "_" + name +
                             ".safetensors")).string();
  const std::vector<float> w = Grouped();
  SafetensorsWriter out;
  if (grouped) out.AddF32("wo_a.weight", {kGroups * kRank, kIn}, w.data());
  for (int g : slices)
    out.AddF32("wo_a.slice." + std::to_string(g) + ".weight", {kRank, kIn},
               w.data() + static_cast<size_t>(g % kGroups) * kRank * kIn);
  EXPECT_TRUE(out.Write(path).ok());
  return path;
}

absl::StatusOr<std::vector<float>> Load(const std::string& path) {
  auto src = TensorSource::Open(path);
  if (!src.ok()) return src.status();
  return LoadGroupedWoA(**src, "wo_a", kGroups, kRank, kIn);
}

TEST(LoadGroupedWoA, OneGroupedLayer) {
  const std::string path = Write("grouped", true, {});
  auto w = Load(path);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, Grouped());
  std::filesystem::remove(path);
}

TEST(LoadGroupedWoA, ExllamaSlicesGiveTheSameMatrix) {
  const std::string path = Write("slices", false, {0, 1});
  auto w = Load(path);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, Grouped());
  std::filesystem::remove(path);
}

TEST(LoadGroupedWoA, RefusesInconsistentLayouts) {
  struct Case {
    std::string name;
    bool grouped;
    std::vector<int> slices;
    std::string message;
  };
  const Case cases[] = {
      {"both", true, {0, 1}, "wo_a: stored both as one layer and as per-group slices (wo_a.slice.0, ...)"},
      {"missing", false, {0}, "wo_a: slice 1 of 2 (wo_a.slice.1) is missing"},
      {"extra", false, {0, 1, 2}, "wo_a: has a slice 2 but the config has 2 output groups"},
  };
  for (const Case& c : cases) {
    const std::string path = Write(c.name, c.grouped, c.slices);
    auto w = Load(path);
    ASSERT_FALSE(w.ok()) << c.name;
    EXPECT_EQ(w.status().message(), c.message) << c.name;
    std::filesystem::remove(path);
  }
}

}  // namespace
}  // namespace exl3::engine

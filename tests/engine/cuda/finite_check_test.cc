// CudaModelOptions::check_finite (engine/cuda/finite_check.h): a model whose layer 1 has a NaN in
// its feed-forward norm fails its first step naming that layer and block; the same model unchecked
// runs (its logits are NaN, which is what the check exists to trace back).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/cuda/cuda_model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/model_harness.h"

namespace exl3::engine::cuda {
namespace {

namespace fs = std::filesystem;

// Copies the fixture `name` to a fresh directory with every element of the bf16 tensor `tensor`
// set to NaN.
fs::path CopyWithNaN(const std::string& name, const std::string& tensor) {
  const fs::path from = fs::path("tests/fixtures/engine") / name;
  const fs::path to = fs::temp_directory_path() / ("finite_check_" + name);
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
  std::fstream f(to / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_bytes = 0;
  f.read(reinterpret_cast<char*>(&header_bytes), sizeof(header_bytes));
  std::string header(header_bytes, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_bytes));
  const nlohmann::json h = nlohmann::json::parse(header);
  const nlohmann::json& t = h.at(tensor);
  EXPECT_EQ(t.at("dtype").get<std::string>(), "BF16");
  const auto offsets = t.at("data_offsets").get<std::vector<uint64_t>>();
  const uint16_t nan_bf16 = 0x7FC0;
  f.seekp(static_cast<std::streamoff>(sizeof(header_bytes) + header_bytes + offsets[0]));
  for (uint64_t at = offsets[0]; at < offsets[1]; at += sizeof(nan_bf16))
    f.write(reinterpret_cast<const char*>(&nan_bf16), sizeof(nan_bf16));
  return to;
}

TEST(FiniteCheckTest, NamesTheFirstLayerAndBlockWithANaN) {
  REQUIRE_GPU();
  const fs::path dir = CopyWithNaN("glm4_moe_all", "model.layers.1.post_attention_layernorm.weight");
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {6, 7, 8}};

  CudaModelOptions checked;
  checked.check_finite = true;
  auto model = CudaModel::Open(dir.string(), checked);
  ASSERT_TRUE(model.ok()) << model.status();
  auto rows = testing::RunGreedy(**model, prompts, /*steps=*/1, /*chunk=*/4);
  ASSERT_FALSE(rows.ok());
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(rows.status().message().find("after layer 1's feed-forward input: row 0 column 0"), std::string::npos)
      << rows.status();

  auto unchecked = CudaModel::Open(dir.string(), CudaModelOptions{});
  ASSERT_TRUE(unchecked.ok()) << unchecked.status();
  auto nan_rows = testing::RunGreedy(**unchecked, prompts, /*steps=*/1, /*chunk=*/4);
  ASSERT_TRUE(nan_rows.ok()) << nan_rows.status();
  EXPECT_TRUE(std::isnan((*nan_rows)[0][0][0]));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace exl3::engine::cuda

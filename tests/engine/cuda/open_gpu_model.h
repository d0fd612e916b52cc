// A fixture directory's GPU model for the GPU engine tests that run it through an engine
// (tests/engine/cuda/speculative_decoding_test.cc, mtp_drafting_test.cc).
#pragma once

#include <memory>
#include <string>

#include "engine/cuda/cuda_model.h"
#include "gtest/gtest.h"

namespace exl3::engine::cuda {

// Null, and a test failure, when it does not open.
inline std::unique_ptr<CudaModel> OpenGpuModel(const std::string& dir) {
  auto model = CudaModel::Open(dir, CudaModelOptions{});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

}  // namespace exl3::engine::cuda

// Writes a generated model's files: its shards (safetensors, "format": "pt", streamed to disk in
// batches), model.safetensors.index.json and JSON/text files beside them.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/encoder/progress.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tools/test_model/generated_tensor.h"

namespace exl3 {

// model-0000i-of-0000n.safetensors (i counted from 0).
std::string ShardName(int i, int n);

// Writes `tensors` into the shard at `path` in their order, their bytes from `values` (in
// batches of about 512 MB, bounding the memory held), and records each in `weight_map` (name ->
// file name). bar: may be null.
absl::Status WriteShard(const std::filesystem::path& path, const std::vector<GenTensor>& tensors,
                        TensorValues& values, ProgressBar* bar, nlohmann::json* weight_map,
                        DataSectionStart data_start = DataSectionStart::k64ByteAligned);

// model.safetensors.index.json: total_size (of the shards named) and the weight map.
absl::Status WriteIndex(const std::filesystem::path& dir, const nlohmann::json& weight_map);

absl::Status WriteText(const std::filesystem::path& p, const std::string& text);

// `j` indented by 2, with a final newline.
absl::Status WriteJson(const std::filesystem::path& p, const nlohmann::json& j);

uint64_t ShardsBytes(const std::vector<std::vector<GenTensor>>& shards);

}  // namespace exl3

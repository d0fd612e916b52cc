#include "tools/test_model/shard_writer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "model/encoder/safetensors_stream_writer.h"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Tensors are generated in batches of about this many bytes (bounding the memory held), each
// batch's tensors in parallel, and written in order.
constexpr uint64_t kBatchBytes = uint64_t{512} << 20;

}  // namespace

std::string ShardName(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

absl::Status WriteText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", p.string()));
  return absl::OkStatus();
}

absl::Status WriteJson(const fs::path& p, const json& j) { return WriteText(p, j.dump(2) + "\n"); }

absl::Status WriteShard(const fs::path& path, const std::vector<GenTensor>& tensors, TensorValues& values,
                        ProgressBar* bar, json* weight_map, DataSectionStart data_start) {
  SafetensorsStreamWriter w;
  w.AddMetadata("format", "pt");
  w.SetDataSectionStart(data_start);
  for (const GenTensor& t : tensors) w.Declare(t.name, t.dtype, t.shape);
  absl::Status s = w.Open(path.string());
  if (!s.ok()) return s;
  for (size_t i = 0; i < tensors.size();) {
    std::vector<const GenTensor*> batch;
    uint64_t bytes = 0;
    for (; i < tensors.size() && (batch.empty() || bytes < kBatchBytes); ++i) {
      batch.push_back(&tensors[i]);
      bytes += TensorBytes(tensors[i]);
    }
    const std::vector<std::vector<uint8_t>> data = values.Generate(batch);
    for (size_t k = 0; k < batch.size(); ++k) {
      s = w.Write(batch[k]->name, data[k].data(), data[k].size());
      if (!s.ok()) return s;
      if (bar) bar->Add(data[k].size());
      (*weight_map)[batch[k]->name] = path.filename().string();
    }
  }
  return w.Finish();
}

absl::Status WriteIndex(const fs::path& dir, const json& weight_map) {
  uint64_t total = 0;
  std::error_code ec;
  std::vector<std::string> seen;
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    const std::string f = it.value().get<std::string>();
    if (std::find(seen.begin(), seen.end(), f) == seen.end()) {
      seen.push_back(f);
      total += fs::file_size(dir / f, ec);
    }
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteJson(dir / "model.safetensors.index.json", index);
}

uint64_t ShardsBytes(const std::vector<std::vector<GenTensor>>& shards) {
  uint64_t total = 0;
  for (const auto& sh : shards)
    for (const auto& t : sh) total += TensorBytes(t);
  return total;
}

}  // namespace exl3

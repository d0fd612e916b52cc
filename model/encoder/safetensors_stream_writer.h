// Writes a safetensors file tensor by tensor without holding it in memory: every tensor is
// declared first (name, dtype, shape), then the header goes out and the data is appended in
// declaration order. The file appears atomically (PATH.tmp, then rename) when Finish succeeds,
// so an interrupted writer never leaves a complete-looking file behind.
//
// Usage:
//   SafetensorsStreamWriter w;
//   w.Declare("a.trellis", DType::kI16, {8, 8, 32});
//   w.AddMetadata("format", "pt");
//   EXL3_RETURN_IF_ERROR(w.Open(path));
//   EXL3_RETURN_IF_ERROR(w.Write("a.trellis", data, bytes));   // may be split over several calls
//   EXL3_RETURN_IF_ERROR(w.Finish());
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/safetensors.h"

namespace exl3 {

class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter() = default;
  ~SafetensorsStreamWriter();  // an unfinished file is removed
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  void Declare(std::string name, DType dtype, std::vector<int64_t> shape);
  void AddMetadata(std::string key, std::string value);
  // Before Open: where the data section starts (default: 64-byte aligned).
  void SetDataSectionStart(DataSectionStart start) { data_start_ = start; }
  size_t num_tensors() const { return entries_.size(); }
  uint64_t data_bytes() const;  // total of all declared tensors

  absl::Status Open(const std::string& path);
  // Appends bytes of tensor `name`, which must be the current tensor (declaration order); a
  // tensor may be written in several pieces.
  absl::Status Write(const std::string& name, const void* data, size_t bytes);
  absl::Status Finish();

 private:
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  DataSectionStart data_start_ = DataSectionStart::k64ByteAligned;
  std::string path_;
  std::FILE* file_ = nullptr;
  size_t current_ = 0;         // index of the tensor being written
  uint64_t written_ = 0;       // bytes of it written so far
};

}  // namespace exl3

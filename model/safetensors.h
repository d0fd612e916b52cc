// safetensors files on mmap: validated header parsing, lazy per-tensor access, sharded models
// through model.safetensors.index.json, and a writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/fp16.h"  // HalfBitsToFloat, BFloat16BitsToFloat, ...
#include "model/checkpoint_naming.h"
#include "model/weight_digest.h"

namespace exl3 {

enum class DType { kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kI64, kU64, kF64,
                   kF8E4M3, kF8E5M2 };

size_t DTypeSize(DType d);
std::string_view DTypeName(DType d);  // safetensors spelling: "F16", "BF16", ...
bool ParseDType(std::string_view name, DType* out);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets inside the data section
  uint64_t end = 0;
  int64_t num_elements() const;
  size_t size_bytes() const { return static_cast<size_t>(end - begin); }
};

// Where a tensor's bytes are in its file, for a reader that reads them with pread instead of the
// mapping (a large table read sparsely: never copied, and a file truncated under the process
// gives a short read, not SIGBUS).
struct TensorLocation {
  const TensorInfo* info = nullptr;
  std::string file;
  uint64_t offset = 0;  // of the tensor's first byte in `file`
};

// A tensor's bytes, valid while its file stays open.
struct TensorView {
  const TensorInfo* info = nullptr;
  const uint8_t* data = nullptr;
  std::string file;  // the file it lives in, for messages

  size_t size_bytes() const { return info->size_bytes(); }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data); }
};

// The parsed header of one file: tensors sorted by offset, metadata.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + header length
};

// Parses and validates a header against the file size. `path` only names the file in errors.
// Checks: header length, JSON, dtypes, shapes, offsets inside the file, byte sizes matching
// shape x dtype, and that tensors neither overlap nor leave holes.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t file_size,
                                                         std::string_view path);

// Where tensors live once a TensorSource has handed them out: in the mapped files (kMapped), or
// moved, as each is first handed out, into memory the process owns at the same addresses
// (kOwned, model/owned_pages.h): the files may then be truncated or replaced under a running
// process without a SIGBUS on its next read. kOwned costs a copy of every tensor read.
enum class TensorResidency { kMapped, kOwned };

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* Find(std::string_view name) const;
  absl::StatusOr<TensorView> Get(std::string_view name) const;
  absl::StatusOr<TensorLocation> Locate(std::string_view name) const;
  // Moves the mapped pages holding [data, data + size) into owned memory (those not moved yet).
  absl::Status Own(const uint8_t* data, size_t size) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  mutable std::mutex own_mu_;
  mutable std::vector<bool> owned_pages_;  // guarded by own_mu_; sized on the first Own
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// All tensors of a model: one .safetensors file, or a directory with one file or with
// model.safetensors.index.json naming the shard of every tensor. Files are opened lazily.
// Tensors are named as the project reads them: a checkpoint in DeepSeek's release naming
// (model/checkpoint_naming.h) is served under the transformers names; TensorView::info->name
// keeps the stored name.
class TensorSource {
 public:
  static absl::StatusOr<std::unique_ptr<TensorSource>> Open(
      const std::string& file_or_dir, TensorResidency residency = TensorResidency::kMapped);

  // How the checkpoint names its tensors.
  CheckpointNaming naming() const { return naming_; }
  // The name a tensor is stored under (the same name for a transformers-named checkpoint).
  std::string StoredName(std::string_view name) const;

  bool Has(std::string_view name) const;
  absl::StatusOr<TensorView> Get(std::string_view name) const;
  std::vector<std::string> Names() const;  // sorted
  // Name, dtype, shape and offsets; reads no tensor data.
  absl::StatusOr<const TensorInfo*> Info(std::string_view name) const;
  // The tensor's file and offset there, for pread; reads no tensor data and owns nothing.
  absl::StatusOr<TensorLocation> Locate(std::string_view name) const;
  // From now on Get checks each tensor's bytes, the first time it is read, against `digests`
  // (model/weight_digest.h, one per tensor): DATA_LOSS naming the tensor, its file and both
  // digests when they differ (the file changed after it was written).
  void VerifyWith(WeightDigests digests);
  // The model's files (every shard, opened or not), sorted.
  std::vector<std::string> Files() const;

 private:
  absl::StatusOr<const SafetensorsFile*> FileFor(std::string_view name) const;
  absl::Status Verify(std::string_view name, const TensorView& v) const;
  // Detects the naming and re-keys shard_of_ by the project's names.
  absl::Status ApplyNaming();
  // What to add to "tensor X is not in the model" when the layer is stored another way.
  std::string MissingTensorHint(std::string_view name) const;
  std::string dir_;
  TensorResidency residency_ = TensorResidency::kMapped;
  std::map<std::string, std::string, std::less<>> shard_of_;  // tensor -> file path
  CheckpointNaming naming_ = CheckpointNaming::kTransformers;
  std::map<std::string, std::string, std::less<>> stored_name_;  // renamed tensors only
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
  mutable std::unique_ptr<std::mutex> mu_;
  std::optional<WeightDigests> digests_;
  mutable std::set<std::string, std::less<>> verified_;  // guarded by *mu_
};

// Tensor contents converted to fp32 (F16, BF16, F32, F64 accepted), checking the shape.
absl::StatusOr<std::vector<float>> ToFloat32(const TensorView& t);


// One tensor of a file being written: its bytes follow the previous tensor's.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};

// Where a written file's data section (after the 8-byte length and the header text) starts,
// which sets every tensor's alignment in the file and in its (page-aligned) mapping.
enum class DataSectionStart {
  // At a multiple of 64: tensors whose predecessors' sizes are multiples of 16 (all EXL3 tensors
  // but the 4-byte mcg / mul1 scalars) are 16-byte aligned, read in place by the GPU's 16-byte
  // loads (--weights-residency host).
  k64ByteAligned,
  // 8 bytes past a multiple of 16, as a header padded to 8 bytes (what the format promises, and
  // what Python's safetensors writes) can leave it: those tensors are 8- but not 16-byte aligned.
  k8PastA16ByteBoundary,
};

// The header JSON of a file holding `entries` back to back in this order, padded with spaces so
// that the data section starts as `start` says.
std::string SafetensorsHeaderText(const std::vector<SafetensorsEntry>& entries,
                                  const std::map<std::string, std::string>& metadata,
                                  DataSectionStart start = DataSectionStart::k64ByteAligned);

// Builds a safetensors file in memory and writes it atomically (temp file, then rename).
class SafetensorsWriter {
 public:
  void Add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t size_bytes);
  void AddF32(std::string name, std::vector<int64_t> shape, const float* data);
  void AddMetadata(std::string key, std::string value);
  absl::Status Write(const std::string& path) const;
  size_t num_tensors() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace exl3

#include "model/encoder/safetensors_stream_writer.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace exl3 {

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove((path_ + ".tmp").c_str());
  }
}

void SafetensorsStreamWriter::Declare(std::string name, DType dtype, std::vector<int64_t> shape) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  entries_.push_back({std::move(name), dtype, std::move(shape), n});
}

void SafetensorsStreamWriter::AddMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

uint64_t SafetensorsStreamWriter::data_bytes() const {
  uint64_t total = 0;
  for (const SafetensorsEntry& e : entries_) total += e.bytes;
  return total;
}

absl::Status SafetensorsStreamWriter::Open(const std::string& path) {
  if (file_ != nullptr) return absl::FailedPreconditionError("stream writer already open");
  const std::string text = SafetensorsHeaderText(entries_, metadata_, data_start_);
  path_ = path;
  const std::string tmp = path + ".tmp";
  file_ = std::fopen(tmp.c_str(), "wb");
  if (file_ == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const uint64_t len = text.size();
  if (std::fwrite(&len, 8, 1, file_) != 1 || std::fwrite(text.data(), 1, len, file_) != len) {
    return absl::InternalError(absl::StrCat("writing ", tmp, " failed: ", std::strerror(errno)));
  }
  current_ = 0;
  written_ = 0;
  while (current_ < entries_.size() && entries_[current_].bytes == 0) ++current_;
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Write(const std::string& name, const void* data,
                                            size_t bytes) {
  if (file_ == nullptr) return absl::FailedPreconditionError("stream writer not open");
  if (current_ >= entries_.size() || entries_[current_].name != name) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stream writer: tensor '", name, "' written out of order (expected '",
        current_ < entries_.size() ? entries_[current_].name : std::string("(none)"), "')"));
  }
  const SafetensorsEntry& e = entries_[current_];
  if (written_ + bytes > e.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("stream writer: tensor '", name, "' takes ",
                                                   e.bytes, " bytes; got more"));
  }
  if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
    return absl::InternalError(absl::StrCat("writing ", path_, ".tmp failed: ", std::strerror(errno)));
  }
  written_ += bytes;
  if (written_ == e.bytes) {
    ++current_;
    written_ = 0;
    while (current_ < entries_.size() && entries_[current_].bytes == 0) ++current_;
  }
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Finish() {
  if (file_ == nullptr) return absl::FailedPreconditionError("stream writer not open");
  if (current_ != entries_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("stream writer: tensor '",
                                                      entries_[current_].name, "' not fully written"));
  }
  const bool ok = std::fclose(file_) == 0;
  file_ = nullptr;
  const std::string tmp = path_ + ".tmp";
  if (!ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("writing ", path_, " failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace exl3

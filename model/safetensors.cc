#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/fp16.h"
#include "model/owned_pages.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::kBool, "BOOL", 1}, {DType::kU8, "U8", 1},       {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},   {DType::kU16, "U16", 2},     {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI32, "I32", 4},     {DType::kU32, "U32", 4},
    {DType::kF32, "F32", 4},   {DType::kI64, "I64", 8},     {DType::kU64, "U64", 8},
    {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};

absl::Status Corrupt(std::string_view path, std::string_view what) {
  return absl::DataLossError(absl::StrCat("safetensors file ", std::string(path), ": ", std::string(what)));
}

}  // namespace

size_t DTypeSize(DType d) {
  for (const auto& e : kDTypes) if (e.dtype == d) return e.size;
  return 0;
}

std::string_view DTypeName(DType d) {
  for (const auto& e : kDTypes) if (e.dtype == d) return e.name;
  return "?";
}

bool ParseDType(std::string_view name, DType* out) {
  for (const auto& e : kDTypes) {
    if (e.name == name) {
      *out = e.dtype;
      return true;
    }
  }
  return false;
}

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t file_size,
                                                         std::string_view path) {
  if (file_size < 8) return Corrupt(path, absl::StrCat("only ", file_size, " bytes, no header"));
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);  // little-endian hosts only (x86-64, arm64)
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    return Corrupt(path, absl::StrCat("header length ", header_len, " exceeds the file (",
                                      file_size, " bytes) or the 100 MB limit"));
  }
  nlohmann::json j = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len, nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corrupt(path, "header is not a JSON object");

  SafetensorsHeader header;
  header.data_offset = 8 + header_len;
  const uint64_t data_size = file_size - header.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Corrupt(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Corrupt(path, absl::StrCat("metadata value of '", m.key(), "' is not a string"));
        }
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](std::string_view what) {
      return Corrupt(path, absl::StrCat("tensor '", name, "': ", std::string(what)));
    };
    if (!v.is_object()) return bad("entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string dtype");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array shape");
    if (off == v.end() || !off->is_array() || off->size() != 2) return bad("data_offsets must be [begin, end]");
    TensorInfo info;
    info.name = name;
    if (!ParseDType(dt->get<std::string>(), &info.dtype)) {
      return bad(absl::StrCat("unknown dtype '", dt->get<std::string>(), "'"));
    }
    uint64_t elems = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) return bad("shape has a negative or non-integer dimension");
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && elems > std::numeric_limits<uint64_t>::max() / 16 / dim) {
        return bad("shape is too large");
      }
      elems *= dim;
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const auto& o : *off) {
      if (!o.is_number_unsigned()) return bad("data_offsets are not non-negative integers");
    }
    info.begin = (*off)[0].get<uint64_t>();
    info.end = (*off)[1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_size) {
      return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                              ") lie outside the data section of ", data_size, " bytes"));
    }
    if (info.end - info.begin != elems * DTypeSize(info.dtype)) {
      return bad(absl::StrCat("holds ", info.end - info.begin, " bytes but shape and dtype need ",
                              elems * DTypeSize(info.dtype)));
    }
    header.tensors.push_back(std::move(info));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t cursor = 0;
  for (const auto& t : header.tensors) {
    if (t.begin < cursor) {
      return Corrupt(path, absl::StrCat("tensor '", t.name, "' overlaps the tensor before it"));
    }
    if (t.begin > cursor) {
      return Corrupt(path, absl::StrCat("a hole of ", t.begin - cursor, " bytes before tensor '",
                                        t.name, "'"));
    }
    cursor = t.end;
  }
  return header;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("mmap of ", path, " failed: ", std::strerror(errno)));
    }
    f->map_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(f->map_, f->size_, path);
  if (!header.ok()) return header.status();
  f->header_ = std::move(*header);
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) f->by_name_[f->header_.tensors[i].name] = i;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

absl::StatusOr<TensorLocation> SafetensorsFile::Locate(std::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", std::string(name), "' is not in ", path_));
  }
  return TensorLocation{info, path_, header_.data_offset + info->begin};
}

absl::Status SafetensorsFile::Own(const uint8_t* data, size_t size) const {
  if (size == 0) return absl::OkStatus();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t first = static_cast<size_t>(data - map_) / page;
  const size_t last = (static_cast<size_t>(data - map_) + size - 1) / page;  // inclusive
  std::lock_guard<std::mutex> lock(own_mu_);
  if (owned_pages_.empty()) owned_pages_.assign((size_ + page - 1) / page, false);
  // Each run of pages not owned yet in one copy.
  for (size_t p = first; p <= last;) {
    if (owned_pages_[p]) {
      ++p;
      continue;
    }
    size_t end = p;
    while (end <= last && !owned_pages_[end]) ++end;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(map_) + p * page;
    if (absl::Status s = ReplaceWithOwnedCopy(begin, (end - p) * page); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path_, ": ", s.message()));
    }
    for (size_t q = p; q < end; ++q) owned_pages_[q] = true;
    p = end;
  }
  return absl::OkStatus();
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

absl::StatusOr<TensorView> SafetensorsFile::Get(std::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", std::string(name), "' is not in ", path_));
  }
  return TensorView{info, map_ + header_.data_offset + info->begin, path_};
}

absl::StatusOr<std::unique_ptr<TensorSource>> TensorSource::Open(const std::string& file_or_dir,
                                                                 TensorResidency residency) {
  namespace fs = std::filesystem;
  std::unique_ptr<TensorSource> src(new TensorSource());
  src->mu_ = std::make_unique<std::mutex>();
  src->residency_ = residency;
  std::error_code ec;
  auto add_file = [&](const std::string& path) -> absl::Status {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
    if (!f.ok()) return f.status();
    for (const auto& t : (*f)->tensors()) {
      auto [it, inserted] = src->shard_of_.emplace(t.name, path);
      if (!inserted) {
        return absl::DataLossError(absl::StrCat("tensor '", t.name, "' appears in both ",
                                                it->second, " and ", path));
      }
    }
    src->open_[path] = std::move(*f);
    return absl::OkStatus();
  };
  if (fs::is_regular_file(file_or_dir, ec)) {
    absl::Status s = add_file(file_or_dir);
    if (!s.ok()) return s;
    EXL3_RETURN_IF_ERROR(src->ApplyNaming());
    return src;
  }
  if (!fs::is_directory(file_or_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(file_or_dir, " is neither a file nor a directory"));
  }
  src->dir_ = file_or_dir;
  const fs::path index = fs::path(file_or_dir) / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    std::ifstream in(index);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrCat(index.string(), ": not JSON with a weight_map"));
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return absl::DataLossError(absl::StrCat(index.string(), ": shard of '", it.key(),
                                                "' is not a string"));
      }
      const std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard.find("..") != std::string::npos) {
        return absl::DataLossError(absl::StrCat(index.string(), ": shard name '", shard,
                                                "' leaves the model directory"));
      }
      const std::string path = (fs::path(file_or_dir) / shard).string();
      if (!fs::is_regular_file(path, ec)) {
        return absl::NotFoundError(absl::StrCat(index.string(), " names shard ", shard,
                                                " for tensor '", it.key(), "', which is missing"));
      }
      src->shard_of_[it.key()] = path;
    }
    EXL3_RETURN_IF_ERROR(src->ApplyNaming());
    return src;
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(file_or_dir, ec)) {
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat(file_or_dir, " holds no .safetensors file"));
  }
  for (const auto& f : files) {
    absl::Status s = add_file(f);
    if (!s.ok()) return s;
  }
  EXL3_RETURN_IF_ERROR(src->ApplyNaming());
  return src;
}

absl::Status TensorSource::ApplyNaming() {
  std::vector<std::string> stored;
  stored.reserve(shard_of_.size());
  for (const auto& [name, file] : shard_of_) stored.push_back(name);
  naming_ = DetectCheckpointNaming(stored);
  if (naming_ == CheckpointNaming::kTransformers) return absl::OkStatus();
  std::map<std::string, std::string, std::less<>> renamed;
  for (const auto& [name, file] : shard_of_) {
    std::string project = ProjectTensorName(naming_, name);
    if (renamed.count(project)) {
      return absl::DataLossError(absl::StrCat("tensor '", name, "' (", std::string(CheckpointNamingName(naming_)),
                                              " naming) would be read as '", project,
                                              "', which another tensor already is"));
    }
    if (project != name) stored_name_[project] = name;
    renamed[std::move(project)] = file;
  }
  shard_of_ = std::move(renamed);
  return absl::OkStatus();
}

std::string TensorSource::StoredName(std::string_view name) const {
  auto it = stored_name_.find(name);
  return it == stored_name_.end() ? std::string(name) : it->second;
}

std::string TensorSource::MissingTensorHint(std::string_view name) const {
  constexpr std::string_view kWeight = ".weight";
  if (name.size() <= kWeight.size() || name.substr(name.size() - kWeight.size()) != kWeight) {
    return "";
  }
  const std::string base(name.substr(0, name.size() - kWeight.size()));
  if (Has(base + ".slice.0.trellis") || Has(base + ".slice.0.weight")) {
    return absl::StrCat(": '", base, "' is stored as per-group slices ('", base,
                        ".slice.0', ...: exllamav3's DeepSeek-V4 wo_a; "
                        "engine/cpu/attention/dsv4_grouped_wo_a.h reads those as one layer)");
  }
  if (!Has(base + ".trellis")) return "";
  if (Has(base + ".signs")) {
    return absl::StrCat(": '", base, "' is stored as an exllamav3 quantized embedding table ('",
                        base, ".trellis' and '", base, ".signs'), which this project does not read");
  }
  return absl::StrCat(": '", base, "' is stored as an EXL3 layer ('", base, ".trellis')");
}

absl::StatusOr<const SafetensorsFile*> TensorSource::FileFor(std::string_view name) const {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", std::string(name), "' is not in the model",
                                            MissingTensorHint(name)));
  }
  std::lock_guard<std::mutex> lock(*mu_);
  auto f = open_.find(it->second);
  if (f == open_.end()) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(it->second);
    if (!opened.ok()) return opened.status();
    f = open_.emplace(it->second, std::move(*opened)).first;
  }
  return f->second.get();
}

bool TensorSource::Has(std::string_view name) const { return shard_of_.count(std::string(name)) > 0; }

namespace {
absl::Status NotInShard(std::string_view name, const std::string& path) {
  return absl::DataLossError(absl::StrCat("the index places tensor '", std::string(name), "' in ",
                                          path, ", which does not hold it"));
}
}  // namespace

absl::StatusOr<TensorView> TensorSource::Get(std::string_view name) const {
  absl::StatusOr<const SafetensorsFile*> f = FileFor(name);
  if (!f.ok()) return f.status();
  absl::StatusOr<TensorView> v = (*f)->Get(StoredName(name));
  if (!v.ok()) return NotInShard(StoredName(name), (*f)->path());
  if (residency_ == TensorResidency::kOwned) {
    EXL3_RETURN_IF_ERROR((*f)->Own(v->data, v->size_bytes()));
  }
  if (digests_) {
    if (absl::Status st = Verify(name, *v); !st.ok()) return st;
  }
  return v;
}

absl::Status TensorSource::Verify(std::string_view name_view, const TensorView& v) const {
  // Digests are recorded under the names the project reads (TensorSource::Names()).
  const std::string name(name_view);
  {
    std::lock_guard<std::mutex> lock(*mu_);
    if (verified_.count(name)) return absl::OkStatus();
  }
  // Hashed outside the lock: loader threads read different tensors at once.
  const std::string got = DigestBytes(v.data, v.size_bytes());
  const auto want = digests_->find(name);
  if (want == digests_->end() || want->second != got) {
    return absl::DataLossError(absl::StrCat(
        "tensor '", name, "' in ", v.file, " has content digest ", got, ", but ",
        kWeightDigestFile, " records ", want == digests_->end() ? "none" : want->second,
        ": the file changed after the model was written"));
  }
  std::lock_guard<std::mutex> lock(*mu_);
  verified_.insert(name);
  return absl::OkStatus();
}

void TensorSource::VerifyWith(WeightDigests digests) { digests_ = std::move(digests); }

std::vector<std::string> TensorSource::Files() const {
  std::set<std::string> files;
  for (const auto& [tensor, file] : shard_of_) files.insert(file);
  return {files.begin(), files.end()};
}


absl::StatusOr<const TensorInfo*> TensorSource::Info(std::string_view name) const {
  absl::StatusOr<const SafetensorsFile*> f = FileFor(name);
  if (!f.ok()) return f.status();
  const TensorInfo* info = (*f)->Find(StoredName(name));
  if (info == nullptr) return NotInShard(StoredName(name), (*f)->path());
  return info;
}

absl::StatusOr<TensorLocation> TensorSource::Locate(std::string_view name) const {
  absl::StatusOr<const SafetensorsFile*> f = FileFor(name);
  if (!f.ok()) return f.status();
  absl::StatusOr<TensorLocation> l = (*f)->Locate(name);
  if (!l.ok()) return NotInShard(name, (*f)->path());
  return l;
}

std::vector<std::string> TensorSource::Names() const {
  std::vector<std::string> names;
  names.reserve(shard_of_.size());
  for (const auto& [name, file] : shard_of_) names.push_back(name);
  return names;
}

absl::StatusOr<std::vector<float>> ToFloat32(const TensorView& t) {
  const size_t n = static_cast<size_t>(t.info->num_elements());
  std::vector<float> out(n);
  switch (t.info->dtype) {
    case DType::kF32: std::memcpy(out.data(), t.data, n * 4); break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        out[i] = HalfBitsToFloat(h);
      }
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        out[i] = BFloat16BitsToFloat(h);
      }
      break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, t.data + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.info->name, "' in ", t.file,
                                                     " has dtype ", std::string(DTypeName(t.info->dtype)),
                                                     "; expected F16, BF16, F32 or F64"));
  }
  return out;
}

void SafetensorsWriter::Add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t size_bytes) {
  Entry e{std::move(name), dtype, std::move(shape), {}};
  e.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size_bytes);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::AddF32(std::string name, std::vector<int64_t> shape, const float* data) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  Add(std::move(name), DType::kF32, std::move(shape), data, n * sizeof(float));
}

void SafetensorsWriter::AddMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsHeaderText(const std::vector<SafetensorsEntry>& entries,
                                  const std::map<std::string, std::string>& metadata,
                                  DataSectionStart start) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    header[e.name] = {{"dtype", DTypeName(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text = header.dump();
  switch (start) {
    case DataSectionStart::k64ByteAligned:
      while ((text.size() + 8) % 64 != 0) text.push_back(' ');
      break;
    case DataSectionStart::k8PastA16ByteBoundary:
      while ((text.size() + 8) % 16 != 8) text.push_back(' ');
      break;
  }
  return text;
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  std::vector<SafetensorsEntry> specs;
  specs.reserve(entries_.size());
  for (const Entry& e : entries_) specs.push_back({e.name, e.dtype, e.shape, e.bytes.size()});
  const std::string text = SafetensorsHeaderText(specs, metadata_);
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const uint64_t len = text.size();
  bool ok = std::fwrite(&len, 8, 1, f) == 1 && std::fwrite(text.data(), 1, len, f) == len;
  for (const Entry& e : entries_) {
    ok = ok && (e.bytes.empty() || std::fwrite(e.bytes.data(), 1, e.bytes.size(), f) == e.bytes.size());
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("writing ", path, " failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace exl3

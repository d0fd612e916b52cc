#include "model/model_file_watch.h"

#include <sys/stat.h>

#include "absl/strings/str_cat.h"

namespace exl3 {

ModelFileWatch::Stat ModelFileWatch::StatOf(const std::string& file) {
  struct stat sb;
  Stat s;
  if (stat(file.c_str(), &sb) != 0) return s;
  s.exists = true;
  s.dev = sb.st_dev;
  s.ino = sb.st_ino;
  s.size = static_cast<uint64_t>(sb.st_size);
  s.mtime_ns = static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec;
  return s;
}

ModelFileWatch::ModelFileWatch(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    if (!loaded_.count(f)) loaded_[f] = StatOf(f);
  }
  last_ = loaded_;
}

std::vector<ModelFileWatch::Change> ModelFileWatch::Check() {
  std::vector<Change> changes;
  int changed = 0;
  for (auto& [file, last] : last_) {
    const Stat now = StatOf(file);
    if (!(now == loaded_.at(file))) ++changed;
    if (now == last) continue;
    std::string what;
    if (!now.exists) {
      what = "removed";
    } else if (!last.exists || now.dev != last.dev || now.ino != last.ino) {
      what = absl::StrCat("replaced by another file of ", now.size, " bytes");
    } else if (now.size != last.size) {
      what = absl::StrCat("size ", last.size, " -> ", now.size, " bytes");
    } else {
      what = "rewritten (modification time changed)";
    }
    changes.push_back({file, what});
    last = now;
  }
  changed_ = changed;
  return changes;
}

}  // namespace exl3

// The model files a process serves from, as they were after the load (device, inode, size,
// mtime): Check() names those that changed since, each change once. The router and the worker
// log what it finds (their weights live in memory they own by then: model/owned_pages.h).
//
//   ModelFileWatch watch(files);
//   for (const ModelFileWatch::Change& c : watch.Check()) Log("%s: %s", c.file, c.what);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace exl3 {

class ModelFileWatch {
 public:
  explicit ModelFileWatch(const std::vector<std::string>& files);
  struct Change {
    std::string file;
    std::string what;  // e.g. "size 1048576 -> 4096 bytes"
  };
  std::vector<Change> Check();
  int changed_files() const { return changed_; }  // files that differ from the load now

 private:
  struct Stat {
    bool exists = false;
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Stat&) const = default;
  };
  static Stat StatOf(const std::string& file);
  std::map<std::string, Stat> loaded_, last_;
  int changed_ = 0;
};

}  // namespace exl3

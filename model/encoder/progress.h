// A progress bar on stderr for long conversions: redrawn in place (at most 10 times a second)
// when stderr is a terminal, otherwise one line per 5 % so that logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>

namespace exl3 {

class ProgressBar {
 public:
  // total: units of work (e.g. tiles); label: printed before the bar. enabled = false: silent.
  ProgressBar(std::string label, uint64_t total, bool enabled = true);
  ~ProgressBar();

  void Add(uint64_t units, std::string_view detail = "");  // thread-safe
  void SetDetail(std::string_view detail);
  void Finish();  // draws 100 % and ends the line

 private:
  void Draw(bool force);
  std::mutex mu_;
  std::string label_, detail_;
  uint64_t total_, done_ = 0;
  bool enabled_, tty_, finished_ = false;
  int last_step_ = -1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace exl3

#include "model/encoder/progress.h"

#include <unistd.h>

#include <algorithm>

namespace exl3 {

ProgressBar::ProgressBar(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)), total_(std::max<uint64_t>(total, 1)), enabled_(enabled),
      tty_(isatty(2) != 0), start_(std::chrono::steady_clock::now()), last_draw_(start_) {
  if (enabled_) Draw(true);
}

ProgressBar::~ProgressBar() {
  if (enabled_ && !finished_ && tty_) std::fputc('\n', stderr);
}

void ProgressBar::Add(uint64_t units, std::string_view detail) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = std::min(total_, done_ + units);
  if (!detail.empty()) detail_ = std::string(detail);
  if (enabled_) Draw(false);
}

void ProgressBar::SetDetail(std::string_view detail) {
  std::lock_guard<std::mutex> lock(mu_);
  detail_ = std::string(detail);
  if (enabled_) Draw(false);
}

void ProgressBar::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  done_ = total_;
  if (enabled_) {
    Draw(true);
    if (tty_) std::fputc('\n', stderr);
  }
  finished_ = true;
}

void ProgressBar::Draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  const double frac = static_cast<double>(done_) / static_cast<double>(total_);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  char eta[32] = "";
  if (done_ > 0 && done_ < total_) {
    const double left = elapsed * (1.0 - frac) / frac;
    std::snprintf(eta, sizeof(eta), ", ETA %dm%02ds", static_cast<int>(left) / 60,
                  static_cast<int>(left) % 60);
  }
  if (tty_) {
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(filled, '#');
    bar.append(kWidth - filled, ' ');
    std::fprintf(stderr, "\r%s [%s] %5.1f%% (%.0fs%s) %s\033[K", label_.c_str(), bar.c_str(),
                 100.0 * frac, elapsed, eta, detail_.c_str());
  } else {
    const int step = static_cast<int>(frac * 20);  // every 5 %
    if (step == last_step_ && (!force || step == 20)) return;
    last_step_ = step;
    std::fprintf(stderr, "%s %5.1f%% (%.0fs%s) %s\n", label_.c_str(), 100.0 * frac, elapsed, eta,
                 detail_.c_str());
  }
  std::fflush(stderr);
  last_draw_ = now;
}

}  // namespace exl3

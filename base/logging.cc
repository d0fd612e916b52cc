#include "base/logging.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

namespace exl3 {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelTag(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
  }
  return "?";
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(const char* name, LogLevel* out) {
  static const struct { const char* n; LogLevel l; } kLevels[] = {
      {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
      {"warning", LogLevel::kWarning}, {"error", LogLevel::kError}};
  for (const auto& e : kLevels) {
    if (std::strcmp(name, e.n) == 0) {
      *out = e.l;
      return true;
    }
  }
  return false;
}

void LogV(LogLevel level, const char* fmt, va_list args) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t;
  gmtime_r(&ts.tv_sec, &t);
  char head[64];
  snprintf(head, sizeof(head), "%s %02d:%02d:%02d.%03ld ", LevelTag(level), t.tm_hour, t.tm_min,
           t.tm_sec, ts.tv_nsec / 1000000);
  char body[2048];
  vsnprintf(body, sizeof(body), fmt, args);
  std::string line = std::string(head) + body + "\n";
  fputs(line.c_str(), stderr);
}

#define EXL3_DEFINE_LOG(name, level) \
  void name(const char* fmt, ...) {  \
    va_list args;                    \
    va_start(args, fmt);             \
    LogV(level, fmt, args);          \
    va_end(args);                    \
  }
EXL3_DEFINE_LOG(LogDebug, LogLevel::kDebug)
EXL3_DEFINE_LOG(LogInfo, LogLevel::kInfo)
EXL3_DEFINE_LOG(LogWarning, LogLevel::kWarning)
EXL3_DEFINE_LOG(LogError, LogLevel::kError)
#undef EXL3_DEFINE_LOG

}  // namespace exl3

// Minimal leveled logging to stderr (the services, and the engines' rare warnings): one line per
// call, UTC timestamp, level.
//
//   LogInfo("loaded %d experts in %.2f s", n, secs);
//   LogWarning("listening on %s without TLS", addr.c_str());
//
// Thread-safe (one fprintf per line). Level threshold from SetLogLevel (default kInfo).
#pragma once

#include <cstdarg>

namespace exl3 {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool ParseLogLevel(const char* name, LogLevel* out);  // "debug", "info", "warning", "error"
void LogV(LogLevel level, const char* fmt, va_list args);

void LogDebug(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogInfo(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogWarning(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogError(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace exl3

// Minimal leveled logging to stderr (the services, and the engines' rare warnings): one line per
// call, UTC time, level.
//
//   LogInfo("loaded %d experts in %.2f s", n, secs);
//   LogWarning("listening on %s without TLS", addr.c_str());
//   LogEvent(LogLevel::kInfo, "request end", {LogField::Text("id", id), LogField::Int("tokens", n)});
//
// Two formats (SetLogFormat; the binaries' --log-format):
//   text  I 12:00:00.000 loaded 8 experts in 0.21 s
//         I 12:00:00.310 request end id=chatcmpl-abc tokens=16
//   json  {"time":"2026-12-07T12:00:00.000Z","level":"INFO","message":"loaded 8 experts in 0.21 s"}
//         {"time":"2026-12-07T12:00:00.310Z","level":"INFO","message":"request end id=chatcmpl-abc
//          tokens=16","event":"request end","id":"chatcmpl-abc","tokens":16}   (one line)
// (the front end's JSON lines have the same time, level and message: docs/frontend.md). An
// event's fields are key=value in text (values quoted where they would break the line:
// QuoteLogValue) and, in JSON, members of the object besides the text form as its message
// (numbers as numbers, an absent value as null), so a log collector gets them without parsing.
//
// Thread-safe (one fputs per line). Level threshold from SetLogLevel (default kInfo).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace exl3 {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText, kJson };

void SetLogLevel(LogLevel level);
bool ParseLogLevel(const char* name, LogLevel* out);  // "debug", "info", "warning", "error"
void SetLogFormat(LogFormat format);
bool ParseLogFormat(const char* name, LogFormat* out);  // "text", "json"
void LogV(LogLevel level, const char* fmt, va_list args);

void LogDebug(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogInfo(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogWarning(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void LogError(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// The longest text value a line carries; a longer one (a raw gRPC client's id, an error message)
// is cut there and marked "...".
inline constexpr size_t kMaxLogValueBytes = 512;

// One field of an event: its key and its value, a number or a text or absent.
class LogField {
 public:
  static LogField Int(std::string_view key, int64_t value);
  // Seconds with 4 decimals; nullopt for a phase never reached ("none" in text, null in JSON).
  static LogField Seconds(std::string_view key, std::optional<double> seconds);
  static LogField Text(std::string_view key, std::string_view value,
                       size_t max_bytes = kMaxLogValueBytes);

  std::string_view key() const { return key_; }
  std::string TextForm() const;  // key=value
  std::string JsonForm() const;  // "key":value

 private:
  enum class Kind { kNumber, kText, kAbsent };
  LogField(std::string_view key, Kind kind, std::string value)
      : key_(key), kind_(kind), value_(std::move(value)) {}

  std::string key_;
  Kind kind_;
  std::string value_;  // kNumber: its digits; kText: the text, cut to its bound
  bool cut_ = false;   // kText: a longer text was cut (marked "...")
};

// An event's line without the logger's prefix, in either format.
std::string EventText(std::string_view event, const std::vector<LogField>& fields);
std::string EventJson(std::string_view event, const std::vector<LogField>& fields);
void LogEvent(LogLevel level, std::string_view event, const std::vector<LogField>& fields);

// `value` as a text-format field value: as it is when it is non-empty printable ASCII without a
// space, '"', '\\' or '='; else in double quotes, with '"' and '\\' escaped and every byte outside
// printable ASCII as \xNN, so that a line stays one line whatever a client sent. Cut at
// `max_bytes` ("...").
std::string QuoteLogValue(std::string_view value, size_t max_bytes = kMaxLogValueBytes);
// `value` as a JSON string, quotes included (control bytes as \u00XX; other bytes as they are).
std::string JsonString(std::string_view value);

}  // namespace exl3

#include "base/logging.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

namespace exl3 {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<LogFormat> g_format{LogFormat::kText};

// A level's letter on a text line, its flag spelling, and its name on a JSON line (upper-case, as
// the front end's are).
struct LevelNames {
  const char* tag;
  const char* flag;
  const char* json;
};

const LevelNames& NamesOf(LogLevel level) {
  static constexpr LevelNames kNames[] = {
      {"D", "debug", "DEBUG"}, {"I", "info", "INFO"}, {"W", "warning", "WARNING"}, {"E", "error", "ERROR"}};
  return kNames[static_cast<int>(level)];
}

bool Enabled(LogLevel level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

// The line's start: "I 12:00:00.000 " in text, `{"time":"...","level":"INFO",` in JSON.
std::string Prefix(LogLevel level, LogFormat format) {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t;
  gmtime_r(&ts.tv_sec, &t);
  char head[96];
  const long ms = ts.tv_nsec / 1000000;
  if (format == LogFormat::kJson) {
    snprintf(head, sizeof(head), "{\"time\":\"%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ\",\"level\":\"%s\",",
             t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, ms,
             NamesOf(level).json);
  } else {
    snprintf(head, sizeof(head), "%s %02d:%02d:%02d.%03ld ", NamesOf(level).tag, t.tm_hour, t.tm_min,
             t.tm_sec, ms);
  }
  return head;
}

void Write(const std::string& line) { fputs(line.c_str(), stderr); }

bool PlainByte(char c) { return c > ' ' && c <= '~' && c != '"' && c != '\\' && c != '='; }

// The length of the valid UTF-8 sequence at s[i] (2 to 4 bytes), or 0 where there is none.
size_t Utf8SequenceAt(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n;      // the sequence's bytes
  unsigned min;  // its smallest code point (a smaller one is an overlong form)
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
    min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  unsigned cp = c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3f);
  }
  const bool surrogate = cp >= 0xd800 && cp <= 0xdfff;
  return cp >= min && cp <= 0x10ffff && !surrogate ? n : 0;
}

// QuoteLogValue's form of `value`, which was cut from a longer one where `cut` (marked "...").
std::string Quoted(std::string_view value, bool cut) {
  bool plain = !value.empty();
  for (char c : value) plain = plain && PlainByte(c);
  if (plain) return cut ? "\"" + std::string(value) + "...\"" : std::string(value);
  std::string out = "\"";
  for (char c : value) {
    const auto b = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (b >= ' ' && b <= '~') {
      out += c;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "\\x%02x", b);
      out += hex;
    }
  }
  if (cut) out += "...";
  out += '"';
  return out;
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(const char* name, LogLevel* out) {
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    if (std::strcmp(name, NamesOf(l).flag) == 0) {
      *out = l;
      return true;
    }
  }
  return false;
}

void SetLogFormat(LogFormat format) { g_format.store(format); }

bool ParseLogFormat(const char* name, LogFormat* out) {
  if (std::strcmp(name, "text") == 0) {
    *out = LogFormat::kText;
  } else if (std::strcmp(name, "json") == 0) {
    *out = LogFormat::kJson;
  } else {
    return false;
  }
  return true;
}

void LogV(LogLevel level, const char* fmt, va_list args) {
  if (!Enabled(level)) return;
  char body[2048];
  vsnprintf(body, sizeof(body), fmt, args);
  const LogFormat format = g_format.load(std::memory_order_relaxed);
  if (format == LogFormat::kJson) {
    Write(Prefix(level, format) + "\"message\":" + JsonString(body) + "}\n");
  } else {
    Write(Prefix(level, format) + body + "\n");
  }
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

LogField LogField::Int(std::string_view key, int64_t value) {
  return LogField(key, Kind::kNumber, std::to_string(value));
}

LogField LogField::Seconds(std::string_view key, std::optional<double> seconds) {
  if (!seconds.has_value()) return LogField(key, Kind::kAbsent, "");
  char digits[32];
  snprintf(digits, sizeof(digits), "%.4f", *seconds);
  return LogField(key, Kind::kNumber, digits);
}

LogField LogField::Text(std::string_view key, std::string_view value, size_t max_bytes) {
  LogField f(key, Kind::kText, std::string(value.substr(0, max_bytes)));
  f.cut_ = value.size() > max_bytes;
  return f;
}

std::string LogField::TextForm() const {
  switch (kind_) {
    case Kind::kNumber: return key_ + "=" + value_;
    case Kind::kAbsent: return key_ + "=none";
    case Kind::kText: break;
  }
  return key_ + "=" + Quoted(value_, cut_);
}

std::string LogField::JsonForm() const {
  switch (kind_) {
    case Kind::kNumber: return JsonString(key_) + ":" + value_;
    case Kind::kAbsent: return JsonString(key_) + ":null";
    case Kind::kText: break;
  }
  return JsonString(key_) + ":" + JsonString(cut_ ? value_ + "..." : value_);
}

std::string EventText(std::string_view event, const std::vector<LogField>& fields) {
  std::string line(event);
  for (const LogField& f : fields) line += " " + f.TextForm();
  return line;
}

std::string EventJson(std::string_view event, const std::vector<LogField>& fields) {
  std::string obj = "\"message\":" + JsonString(EventText(event, fields)) +
                    ",\"event\":" + JsonString(event);
  for (const LogField& f : fields) obj += "," + f.JsonForm();
  return obj;
}

void LogEvent(LogLevel level, std::string_view event, const std::vector<LogField>& fields) {
  if (!Enabled(level)) return;
  const LogFormat format = g_format.load(std::memory_order_relaxed);
  if (format == LogFormat::kJson) {
    Write(Prefix(level, format) + EventJson(event, fields) + "}\n");
  } else {
    Write(Prefix(level, format) + EventText(event, fields) + "\n");
  }
}

std::string QuoteLogValue(std::string_view value, size_t max_bytes) {
  const bool cut = value.size() > max_bytes;
  return Quoted(cut ? value.substr(0, max_bytes) : value, cut);
}

std::string JsonString(std::string_view value) {
  std::string out = "\"";
  for (size_t i = 0; i < value.size();) {
    const char c = value[i];
    const auto b = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (b < 0x20 || b == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\u%04x", b);
      out += esc;
    } else if (b >= 0x80) {
      // Valid UTF-8 as it is; a stray byte as U+FFFD, so that the line stays valid JSON.
      const size_t n = Utf8SequenceAt(value, i);
      if (n == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(value.substr(i, n));
        i += n;
      }
      continue;
    } else {
      out += c;
    }
    ++i;
  }
  out += '"';
  return out;
}

}  // namespace exl3

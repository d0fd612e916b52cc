#include "services/router/request_log.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"

namespace exl3::router {
namespace {

namespace pb = ::exl3serve::v1;

bool Plain(char c) { return c > ' ' && c <= '~' && c != '"' && c != '\\' && c != '='; }

// "0.0121", or "none" for a phase the request never reached.
std::string Seconds(std::optional<double> s) {
  return s.has_value() ? absl::StrFormat("%.4f", *s) : std::string("none");
}

std::string EndLine(std::string_view id, int prompt_tokens, int generated_tokens,
                    int cached_tokens, std::string_view finish_reason,
                    std::optional<double> ttft_s, double total_s, const absl::Status& error) {
  std::string line = absl::StrCat(
      "request end id=", LogValue(id), " prompt_tokens=", prompt_tokens,
      " generated_tokens=", generated_tokens, " cached_tokens=", cached_tokens,
      " finish_reason=", std::string(finish_reason), " ttft_s=", Seconds(ttft_s),
      " total_s=", Seconds(total_s));
  if (!error.ok()) {
    absl::StrAppend(&line, " error=", LogValue(error.ToString(), kMaxLoggedErrorBytes));
  }
  return line;
}

}  // namespace

std::string LogValue(std::string_view value, size_t max_bytes) {
  const bool cut = value.size() > max_bytes;
  if (cut) value = value.substr(0, max_bytes);
  bool plain = !value.empty();
  for (char c : value) plain = plain && Plain(c);
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

std::string RequestStartLine(const pb::GenerateRequest& req) {
  return absl::StrCat("request start id=", LogValue(req.request_id()),
                      " prompt_tokens=", req.prompt_token_ids_size(),
                      " max_tokens=", req.max_tokens());
}

std::string RequestEndLine(std::string_view id, const engine::FinishInfo& finish) {
  return EndLine(id, finish.usage.prompt_tokens, finish.usage.completion_tokens,
                 finish.usage.cached_tokens, engine::FinishReasonName(finish.reason),
                 finish.timings.time_to_first_token_s, finish.timings.total_s, finish.status);
}

std::string RequestRefusedLine(const pb::GenerateRequest& req, const absl::Status& why,
                               std::chrono::steady_clock::time_point since) {
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  return EndLine(req.request_id(), req.prompt_token_ids_size(), 0, 0, "refused", std::nullopt,
                 total_s, why);
}

void LogRequestStart(const pb::GenerateRequest& req) {
  LogInfo("%s", RequestStartLine(req).c_str());
}

void LogRequestEnd(std::string_view id, const engine::FinishInfo& finish) {
  LogInfo("%s", RequestEndLine(id, finish).c_str());
}

void LogRequestRefused(const pb::GenerateRequest& req, const absl::Status& why,
                       std::chrono::steady_clock::time_point since) {
  LogInfo("%s", RequestRefusedLine(req, why, since).c_str());
}

}  // namespace exl3::router

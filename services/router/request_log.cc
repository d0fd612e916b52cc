#include "services/router/request_log.h"

#include <optional>
#include <vector>

#include "base/logging.h"

namespace exl3::router {
namespace {

namespace pb = ::exl3serve::v1;

void LogEnd(std::string_view id, int prompt_tokens, int generated_tokens, int cached_tokens,
            std::string_view finish_reason, std::optional<double> ttft_s, double total_s,
            const absl::Status& error) {
  std::vector<LogField> fields = {
      LogField::Text("id", id, kMaxLoggedIdBytes),
      LogField::Int("prompt_tokens", prompt_tokens),
      LogField::Int("generated_tokens", generated_tokens),
      LogField::Int("cached_tokens", cached_tokens),
      LogField::Text("finish_reason", finish_reason),
      LogField::Seconds("ttft_s", ttft_s),
      LogField::Seconds("total_s", total_s)};
  if (!error.ok()) fields.push_back(LogField::Text("error", error.ToString()));
  LogEvent(LogLevel::kInfo, "request end", fields);
}

}  // namespace

std::string RequestIdOf(const pb::GenerateRequest& req, const grpc::CallbackServerContext* ctx) {
  if (!req.request_id().empty() || ctx == nullptr) return req.request_id();
  const auto& metadata = ctx->client_metadata();
  const auto it = metadata.find("x-request-id");
  return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

void LogRequestStart(std::string_view id, const pb::GenerateRequest& req) {
  LogEvent(LogLevel::kInfo, "request start",
           {LogField::Text("id", id, kMaxLoggedIdBytes),
            LogField::Int("prompt_tokens", req.prompt_token_ids_size()),
            LogField::Int("max_tokens", req.max_tokens())});
}

void LogRequestEnd(std::string_view id, const engine::FinishInfo& finish) {
  LogEnd(id, finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.usage.cached_tokens,
         engine::FinishReasonName(finish.reason), finish.timings.time_to_first_token_s,
         finish.timings.total_s, finish.status);
}

void LogRequestRefused(std::string_view id, const pb::GenerateRequest& req,
                       const absl::Status& why, std::chrono::steady_clock::time_point since) {
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  LogEnd(id, req.prompt_token_ids_size(), 0, 0, "refused", std::nullopt, total_s, why);
}

}  // namespace exl3::router

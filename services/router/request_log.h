// The Generator service's log of each request (both calls: Generate and GenerateStream): one
// line when the service takes the request, before the engine sees it, and one when it ends, so a
// client's request id (GenerateRequest.request_id: the front end's "chatcmpl-..." / "cmpl-..." id,
// which holds the client's X-Request-Id) finds the engine's side of the request. key=value
// fields, values quoted where they need it (LogValue):
//
//   I 12:00:00.000 request start id=chatcmpl-abc prompt_tokens=12 max_tokens=16
//   I 12:00:00.310 request end id=chatcmpl-abc prompt_tokens=12 generated_tokens=16
//       cached_tokens=0 finish_reason=length ttft_s=0.0121 total_s=0.3104
//   I 12:00:00.320 request end id=x prompt_tokens=3 generated_tokens=0 cached_tokens=0
//       finish_reason=refused ttft_s=none total_s=0.0000 error="max_tokens must be positive"
//
// (each line one line; wrapped here). finish_reason is the engine's (stop, length, abort, error)
// or `refused` (the request never ran: ToGenerateParams or Engine::Submit said no); a failure
// carries its error. At --log-level info (exl3-router's default); warning leaves them out.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "engine/core/engine.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::router {

// The longest id a line carries; a longer one (a raw gRPC client's: the front end's are shorter)
// is cut there and marked "...".
inline constexpr size_t kMaxLoggedIdBytes = 256;
// The longest error message a line carries, likewise.
inline constexpr size_t kMaxLoggedErrorBytes = 512;

// `value` as a field's value: as it is when it is non-empty printable ASCII without a space, '"',
// '\\' or '='; else in double quotes, with '"' and '\\' escaped and every byte outside printable
// ASCII as \xNN, so that a line stays one line whatever a client sent. Cut at `max_bytes` ("...").
std::string LogValue(std::string_view value, size_t max_bytes = kMaxLoggedIdBytes);

// The lines (without the logger's prefix).
std::string RequestStartLine(const ::exl3serve::v1::GenerateRequest& req);
std::string RequestEndLine(std::string_view id, const engine::FinishInfo& finish);
// A request that never ran: `why` is ToGenerateParams' or Engine::Submit's error; `since` when
// the service took it.
std::string RequestRefusedLine(const ::exl3serve::v1::GenerateRequest& req,
                               const absl::Status& why,
                               std::chrono::steady_clock::time_point since);

// The lines written with LogInfo (base/logging.h).
void LogRequestStart(const ::exl3serve::v1::GenerateRequest& req);
void LogRequestEnd(std::string_view id, const engine::FinishInfo& finish);
void LogRequestRefused(const ::exl3serve::v1::GenerateRequest& req, const absl::Status& why,
                       std::chrono::steady_clock::time_point since);

}  // namespace exl3::router

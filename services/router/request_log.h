// The Generator service's log of each request (both calls: Generate and GenerateStream): one
// event when the service takes the request, before the engine sees it, and one when it ends, so a
// client's request id finds the engine's side of the request. The id is GenerateRequest.request_id
// (the front end's "chatcmpl-..." / "cmpl-..." id, which holds the client's X-Request-Id), or for a
// Generate call without one, the call's `x-request-id` metadata (RequestIdOf). As text
// (base/logging.h; with --log-format json the same fields are members of one object per line):
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
#include "grpcpp/server_context.h"

namespace exl3::router {

// The longest id an event carries (a raw gRPC client's may be longer; the front end's are not).
inline constexpr size_t kMaxLoggedIdBytes = 256;

// The request's id: its request_id, else the call's `x-request-id` metadata (a raw gRPC client's
// way to name a request), else empty. `ctx` may be null (a GenerateStream action: its call's
// metadata names no single request).
std::string RequestIdOf(const ::exl3serve::v1::GenerateRequest& req,
                        const grpc::CallbackServerContext* ctx);

void LogRequestStart(std::string_view id, const ::exl3serve::v1::GenerateRequest& req);
void LogRequestEnd(std::string_view id, const engine::FinishInfo& finish);
// A request that never ran: `why` is ToGenerateParams' or Engine::Submit's error; `since` when
// the service took it.
void LogRequestRefused(std::string_view id, const ::exl3serve::v1::GenerateRequest& req,
                       const absl::Status& why, std::chrono::steady_clock::time_point since);

}  // namespace exl3::router

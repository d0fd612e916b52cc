// The Generator service's messages (proto/exl3serve/v1/exl3serve.proto) from and to the engine's
// terms (engine/core/engine.h), shared by its two calls: Generate (services/router/generator_service.cc)
// and GenerateStream (services/router/generate_stream.cc).
#pragma once

#include <chrono>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/core/engine.h"
#include "services/router/generator_options.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "grpcpp/support/status.h"

namespace exl3::router {

// The request's parameters in the engine's terms. Engine::Submit validates them; this compiles
// the request's constraint with options.grammar_compiler (INVALID_ARGUMENT: it does not compile,
// or there is no compiler; the library's or options.constraints_unavailable's words).
absl::StatusOr<engine::GenerateParams> ToGenerateParams(
    const ::exl3serve::v1::GenerateRequest& req, std::chrono::steady_clock::time_point deadline,
    const GeneratorOptions& options);

// When the request must end: its timeout_us (clamped to a day) or else `default_timeout` from
// now, and never after `call_deadline` (the gRPC call's; a far future one means none).
std::chrono::steady_clock::time_point RequestDeadline(
    const ::exl3serve::v1::GenerateRequest& req, std::chrono::milliseconds default_timeout,
    std::chrono::system_clock::time_point call_deadline);

// Appends the tokens (with their logprobs) to `out`.
void AddTokens(const std::vector<engine::SampledToken>& tokens,
               ::exl3serve::v1::GenerateResponse* out);
// Appends the prompt's logprobs (GenerateEvent::prompt_logprobs) to `out`.
void AddPromptLogprobs(const std::vector<engine::SampledToken>& prompt_logprobs,
                       ::exl3serve::v1::GenerateResponse* out);
// The last message's finish reason, usage and timings.
void SetFinish(const engine::FinishInfo& finish, ::exl3serve::v1::GenerateResponse* out);
// The status a request ends with: OK when it stopped or reached its length, CANCELLED when
// aborted, the engine's error otherwise.
grpc::Status FinalStatus(const engine::FinishInfo& finish);

}  // namespace exl3::router

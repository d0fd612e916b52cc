#include "services/router/generate_messages.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"

#include "services/common/status.h"

namespace exl3::router {
namespace {

namespace pb = ::exl3serve::v1;

pb::FinishReason ToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return pb::FINISH_REASON_STOP;
    case engine::FinishReason::kLength:
      return pb::FINISH_REASON_LENGTH;
    case engine::FinishReason::kAbort:
      return pb::FINISH_REASON_ABORT;
    case engine::FinishReason::kError:
      return pb::FINISH_REASON_ERROR;
  }
  return pb::FINISH_REASON_ERROR;
}

// The request's constraint, if any, in the compiler's terms.
std::optional<engine::ConstraintSpec> ConstraintOf(const pb::SamplingParams& s) {
  engine::ConstraintSpec spec;
  switch (s.constraint_case()) {
    case pb::SamplingParams::CONSTRAINT_NOT_SET:
      return std::nullopt;
    case pb::SamplingParams::kJsonSchema:
      spec.kind = engine::ConstraintKind::kJsonSchema;
      spec.text = s.json_schema();
      break;
    case pb::SamplingParams::kJsonObject:
      if (!s.json_object()) return std::nullopt;
      spec.kind = engine::ConstraintKind::kJsonObject;
      break;
    case pb::SamplingParams::kRegex:
      spec.kind = engine::ConstraintKind::kRegex;
      spec.text = s.regex();
      break;
    case pb::SamplingParams::kGrammar:
      spec.kind = engine::ConstraintKind::kGrammar;
      spec.text = s.grammar();
      break;
    case pb::SamplingParams::kChoice:
      spec.kind = engine::ConstraintKind::kChoice;
      spec.choices.assign(s.choice().choices().begin(), s.choice().choices().end());
      break;
    case pb::SamplingParams::kTaggedJson:
      spec.kind = engine::ConstraintKind::kTaggedJson;
      for (const pb::TaggedJson& t : s.tagged_json().alternatives()) {
        spec.tagged.push_back({t.begin(), t.json_schema(), t.end()});
      }
      break;
    case pb::SamplingParams::kStructuralTag:
      spec.kind = engine::ConstraintKind::kStructuralTag;
      spec.text = s.structural_tag().json();
      spec.tag_json = s.structural_tag().json_layout() == pb::JSON_LAYOUT_COMPACT
                          ? engine::StructuralTagJson::kCompact
                          : engine::StructuralTagJson::kFreeWhitespace;
      break;
  }
  if (s.has_constraint_after_reasoning()) {
    const pb::ReasoningBlock& block = s.constraint_after_reasoning();
    spec.after_reasoning = engine::ReasoningBlock{
        block.start(), block.end(),
        block.output_starts_inside() ? engine::ReasoningBlock::Opening::kStartsInside
                                     : engine::ReasoningBlock::Opening::kOptional};
  }
  return spec;
}

}  // namespace

absl::StatusOr<engine::GenerateParams> ToGenerateParams(
    const pb::GenerateRequest& req, std::chrono::steady_clock::time_point deadline,
    const GeneratorOptions& options) {
  engine::GenerateParams p;
  p.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  const pb::SamplingParams& s = req.sampling();
  p.sampling.temperature = s.temperature();
  p.sampling.top_k = s.top_k();
  p.sampling.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  p.sampling.min_p = s.min_p();
  p.sampling.repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  p.sampling.presence_penalty = s.presence_penalty();
  p.sampling.frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) p.sampling.seed = s.seed();
  p.sampling.logprobs = s.logprobs();
  for (const auto& [token, bias] : s.logit_bias()) p.sampling.logit_bias.push_back({token, bias});
  // Token order, for the same sampling whatever the map's order.
  std::sort(p.sampling.logit_bias.begin(), p.sampling.logit_bias.end(),
            [](const engine::TokenBias& a, const engine::TokenBias& b) { return a.token < b.token; });
  const std::optional<engine::ConstraintSpec> spec = ConstraintOf(s);
  if (!spec.has_value() && s.has_constraint_after_reasoning()) {
    return absl::InvalidArgumentError(
        "constraint_after_reasoning is set but the request has no constraint");
  }
  if (spec.has_value()) {
    if (options.grammar_compiler == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", engine::ConstraintKindName(spec->kind),
          " constraint cannot be served: ", options.constraints_unavailable));
    }
    absl::StatusOr<std::shared_ptr<const engine::TokenGrammar>> grammar =
        options.grammar_compiler->Compile(*spec);
    if (!grammar.ok()) return grammar.status();
    p.sampling.grammar = *std::move(grammar);
  }
  p.max_tokens = req.max_tokens();
  p.min_tokens = req.min_tokens();
  p.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  p.ignore_eos = req.ignore_eos();
  p.deadline = deadline;
  if (req.has_prompt_logprobs()) p.prompt_logprobs = req.prompt_logprobs();
  if (req.has_num_speculative_tokens()) p.num_speculative_tokens = req.num_speculative_tokens();
  p.tag = req.request_id();
  return p;
}

std::chrono::steady_clock::time_point RequestDeadline(
    const pb::GenerateRequest& req, std::chrono::milliseconds default_timeout,
    std::chrono::system_clock::time_point call_deadline) {
  const auto now = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point deadline = now + default_timeout;
  if (req.timeout_us() > 0) {
    // Clamped to a day: larger values mean "no deadline" in practice and must not overflow.
    const uint64_t us = std::min<uint64_t>(req.timeout_us(), 86400ull * 1000000);
    deadline = now + std::chrono::microseconds(us);
  }
  const auto call_left = call_deadline - std::chrono::system_clock::now();
  if (call_left < std::chrono::hours(24 * 365)) deadline = std::min(deadline, now + call_left);
  return deadline;
}

namespace {

void AddToken(const engine::SampledToken& t, pb::GeneratedToken* g) {
  g->set_token_id(t.token);
  if (t.logprob) g->set_logprob(*t.logprob);
  g->set_rank(t.rank);
  for (const engine::TokenLogprob& lp : t.top_logprobs) {
    pb::TokenLogprob* e = g->add_top_logprobs();
    e->set_token_id(lp.token);
    e->set_logprob(lp.logprob);
  }
}

}  // namespace

void AddTokens(const std::vector<engine::SampledToken>& tokens, pb::GenerateResponse* out) {
  for (const engine::SampledToken& t : tokens) AddToken(t, out->add_tokens());
}

void AddPromptLogprobs(const std::vector<engine::SampledToken>& prompt_logprobs, pb::GenerateResponse* out) {
  for (const engine::SampledToken& t : prompt_logprobs) AddToken(t, out->add_prompt_logprobs());
}

void SetFinish(const engine::FinishInfo& f, pb::GenerateResponse* out) {
  out->set_finish_reason(ToProto(f.reason));
  pb::Usage* u = out->mutable_usage();
  u->set_prompt_tokens(f.usage.prompt_tokens);
  u->set_completion_tokens(f.usage.completion_tokens);
  u->set_cached_tokens(f.usage.cached_tokens);
  pb::GenerateTimings* t = out->mutable_timings();
  t->set_queue_seconds(f.timings.queue_s.value_or(0));
  t->set_prefill_seconds(f.timings.prefill_s.value_or(0));
  t->set_first_token_seconds(f.timings.time_to_first_token_s.value_or(0));
  t->set_mean_inter_token_seconds(f.timings.mean_inter_token_s.value_or(0));
  t->set_total_seconds(f.timings.total_s);
}

grpc::Status FinalStatus(const engine::FinishInfo& finish) {
  switch (finish.reason) {
    case engine::FinishReason::kStop:
    case engine::FinishReason::kLength:
      return grpc::Status::OK;
    case engine::FinishReason::kAbort:
      return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
    case engine::FinishReason::kError:
      return svc::ToGrpcStatus(finish.status);
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, "unknown finish reason");
}

}  // namespace exl3::router

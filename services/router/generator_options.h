// The Generator service's settings (services/router/generator_service.h), shared by its calls.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/sampling/token_grammar.h"

#include "prometheus/histogram.h"

namespace exl3::router {

struct GeneratorOptions {
  std::chrono::milliseconds default_timeout{600000};  // requests without timeout_us or deadline
  std::string experts;  // "local" or "workers", for DescribeModel
  int max_num_seqs = 0;  // for DescribeModel
  // Per call, from its first tokens' event (the engine's first token, on its loop) to the write of
  // the message carrying them started, and to gRPC's OnWriteDone of it (the message handed to the
  // transport). Null: not measured. Not owned; must outlive the service.
  prometheus::Histogram* first_write_started = nullptr;
  prometheus::Histogram* first_write_done = nullptr;
  // Compiles requests' constraints (SamplingParams.constraint) on the calls' threads; null: a
  // constrained request is refused INVALID_ARGUMENT with constraints_unavailable (why: e.g. the
  // model directory has no tokenizer.json).
  std::shared_ptr<const engine::TokenGrammarCompiler> grammar_compiler;
  std::string constraints_unavailable;
};

}  // namespace exl3::router

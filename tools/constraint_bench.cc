// exl3-constraint-bench: what constrained decoding costs on the host per sequence and step
// (bench/results/structured-output.md): building the compiler from a tokenizer.json, compiling the
// benchmarks' JSON schema (tools/exl3_bench/bench_json_schema.h; and the cached compile), and
// along the schema's sampled paths the mask fill (TokenConstraint::FillNextTokenMask, which the
// engine runs while the forward pass does) and the sampler's pass with and without the mask, on
// synthetic logits. The whole engine step with and without the constraint, on the GPU engine:
// exl3-engine-bench --constrained-tokenizer (tools/exl3_bench/constraint_step_bench.h).
//
//   exl3-constraint-bench --tokenizer DIR/tokenizer.json [--vocab_size N] [--sequences 20]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/command_line.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/token_constraint.h"
#include "engine/sampling/token_grammar.h"
#include "tools/exl3_bench/bench_json_schema.h"

ABSL_FLAG(std::string, tokenizer, "", "a tokenizer.json (required)");
ABSL_FLAG(int, vocab_size, 0,
          "the model's vocabulary size (0: the smallest power of two holding the tokenizer's ids)");
ABSL_FLAG(int, sequences, 20, "sampled paths through the schema (one seed each)");
ABSL_FLAG(int, max_steps, 80, "tokens per path at most");

namespace {

using exl3::engine::ConstraintKind;
using exl3::engine::Sampler;
using exl3::engine::SampledToken;
using exl3::engine::SamplingParams;
using exl3::engine::SequenceHistory;
using exl3::engine::TokenConstraint;
using exl3::engine::TokenGrammarCompiler;
using Clock = std::chrono::steady_clock;
using exl3::bench::kBenchJsonSchema;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Deterministic logits of a step: spread over [0, 10) by a multiplicative hash.
void FillLogits(std::vector<float>& logits, uint64_t seed, int step) {
  for (size_t i = 0; i < logits.size(); ++i) {
    logits[i] = static_cast<float>((i * 2654435761u + seed * 97 + step * 13) % 1000) / 100.0f;
  }
}

}  // namespace

int main(int argc, char** argv) {
  exl3::ConfigureFlagsUsage("exl3-constraint-bench",
                            "exl3-constraint-bench --tokenizer PATH [--vocab_size N]\n"
                            "The host cost of a constrained step (bench/results/structured-output.md).",
                            "tools/constraint_bench");
  absl::ParseCommandLine(argc, argv);
  std::ifstream in(absl::GetFlag(FLAGS_tokenizer));
  if (!in) {
    std::fprintf(stderr, "exl3-constraint-bench: cannot read --tokenizer '%s'\n",
                 absl::GetFlag(FLAGS_tokenizer).c_str());
    return 2;
  }
  std::stringstream text;
  text << in.rdbuf();
  int vocab = absl::GetFlag(FLAGS_vocab_size);
  if (vocab <= 0) {
    // The tokenizer's own size: the largest vocabulary the compiler refuses nothing of.
    for (vocab = 1; !TokenGrammarCompiler::FromTokenizerJson(text.str(), vocab, {}).ok(); vocab *= 2) {
    }
  }
  const Clock::time_point t0 = Clock::now();
  auto compiler = TokenGrammarCompiler::FromTokenizerJson(text.str(), vocab, {0});
  if (!compiler.ok()) {
    std::fprintf(stderr, "exl3-constraint-bench: %s\n", compiler.status().ToString().c_str());
    return 1;
  }
  const Clock::time_point t1 = Clock::now();
  auto grammar = (*compiler)->Compile({ConstraintKind::kJsonSchema, kBenchJsonSchema, {}});
  const Clock::time_point t2 = Clock::now();
  auto cached = (*compiler)->Compile({ConstraintKind::kJsonSchema, kBenchJsonSchema, {}});
  const Clock::time_point t3 = Clock::now();
  if (!grammar.ok() || !cached.ok()) {
    std::fprintf(stderr, "exl3-constraint-bench: %s\n", grammar.status().ToString().c_str());
    return 1;
  }
  std::printf("vocab %d: compiler %.1f ms, schema compile %.1f ms, cached compile %.3f ms\n", vocab,
              Ms(t1 - t0), Ms(t2 - t1), Ms(t3 - t2));

  Sampler sampler(vocab);
  std::vector<float> logits(vocab);
  SamplingParams params;  // temperature 1
  double fill_ms = 0, masked_ms = 0, plain_ms = 0;
  int steps = 0, refusals = 0;
  for (uint64_t seed = 0; seed < static_cast<uint64_t>(absl::GetFlag(FLAGS_sequences)); ++seed) {
    TokenConstraint constraint(*grammar);
    std::vector<int32_t> output;
    for (int step = 0; step < absl::GetFlag(FLAGS_max_steps) &&
                       constraint.state() != TokenConstraint::State::kTerminated;
         ++step) {
      FillLogits(logits, seed, step);
      const Clock::time_point a = Clock::now();
      constraint.FillNextTokenMask();
      const Clock::time_point b = Clock::now();
      SequenceHistory masked;
      masked.output = output;
      masked.allowed_tokens = constraint.next_token_mask();
      // The constraint takes the token as the engine has it do (engine/core/scheduler.cc): a token its
      // matcher refuses although its mask allowed it is drawn again and counted.
      const std::optional<SampledToken> token = sampler.SampleAccepted(
          logits, params, seed, masked,
          [&](int32_t t) {
            if (constraint.Accept(t).ok()) return true;
            ++refusals;
            return false;
          },
          8);
      const Clock::time_point c = Clock::now();
      FillLogits(logits, seed, step);
      SequenceHistory plain;
      plain.output = output;
      const Clock::time_point d = Clock::now();
      sampler.Sample(logits, params, seed, plain);
      const Clock::time_point e = Clock::now();
      fill_ms += Ms(b - a);
      masked_ms += Ms(c - b);
      plain_ms += Ms(e - d);
      ++steps;
      if (!token.has_value()) {
        std::fprintf(stderr, "exl3-constraint-bench: path %d step %d: the constraint refused every token drawn\n",
                     static_cast<int>(seed), step);
        return 1;
      }
      output.push_back(token->token);
    }
  }
  std::printf("%d steps: mask fill %.1f us/step, sampling with the mask %.1f us/step, without %.1f "
              "us/step; %d tokens the mask allowed were refused by the matcher and drawn again\n",
              steps, fill_ms / steps * 1e3, masked_ms / steps * 1e3, plain_ms / steps * 1e3, refusals);
  return 0;
}

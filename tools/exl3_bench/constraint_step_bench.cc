#include "tools/exl3_bench/constraint_step_bench.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "engine/sampling/token_grammar.h"
#include "tools/exl3_bench/bench_json_schema.h"

namespace exl3::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Every step's metrics of one run (EngineObserver: called on the engine's loop thread).
class StepLog final : public engine::EngineObserver {
 public:
  void OnStep(const engine::StepMetrics& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    steps_.push_back(s);
  }
  std::vector<engine::StepMetrics> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(steps_, {});
  }

 private:
  std::mutex mu_;
  std::vector<engine::StepMetrics> steps_;
};

// The step counts and medians of `run` from its steps at batch B.
void FillSteps(const std::vector<engine::StepMetrics>& steps, int batch, ConstraintStepRun& run) {
  std::vector<double> step, forward, sample;
  for (const engine::StepMetrics& s : steps) {
    if (s.num_decode_tokens == 0) continue;
    ++run.decode_steps;
    if (s.failed || s.num_prefill_tokens > 0 || s.num_sequences != batch || s.num_decode_tokens != batch) continue;
    step.push_back(s.schedule_s + s.forward_s + s.sample_s + s.bookkeeping_s);
    forward.push_back(s.forward_s);
    sample.push_back(s.sample_s);
  }
  run.full_batch_steps = static_cast<int64_t>(step.size());
  run.step_s = Median(step);
  run.forward_s = Median(forward);
  run.sample_s = Median(sample);
}

// B requests at once, each slot kept busy until it generated max_tokens tokens: a constrained
// request its grammar ends early is replaced (see the header).
absl::StatusOr<ConstraintStepRun> RunBatch(engine::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                           int max_tokens, std::shared_ptr<const engine::TokenGrammar> grammar,
                                           std::mt19937_64& rng, int vocab, uint64_t seed) {
  struct Request {
    int slot = 0;
    int tokens = 0;
  };
  struct Shared {
    std::mutex mu;
    std::condition_variable changed;
    std::map<uint64_t, Request> requests;
    std::vector<int> left;        // per slot: tokens still to generate
    std::deque<int> to_replace;   // slots whose request its grammar ended early
    int live = 0;
    int ended_by_grammar = 0;
    Clock::time_point last_end;
    absl::Status status;
  } shared;
  const int batch = static_cast<int>(prompts.size());
  shared.left.assign(batch, max_tokens);
  auto callback = [&shared](const engine::GenerateEvent& e) {
    std::lock_guard<std::mutex> lock(shared.mu);
    Request& r = shared.requests.at(e.request_id);
    r.tokens += static_cast<int>(e.tokens.size());
    if (!e.finish.has_value()) return;
    --shared.live;
    shared.left[r.slot] -= r.tokens;
    shared.last_end = Clock::now();
    if (!e.finish->status.ok()) {
      if (shared.status.ok()) shared.status = e.finish->status;
    } else if (e.finish->reason == engine::FinishReason::kStop) {
      ++shared.ended_by_grammar;
      if (shared.left[r.slot] > 0) shared.to_replace.push_back(r.slot);
    }
    shared.changed.notify_all();
  };
  uint64_t submitted = 0;
  // Called with shared.mu held: a request's first event waits for its entry.
  auto submit = [&](int slot, std::vector<int32_t> prompt, int tokens) -> absl::Status {
    engine::GenerateParams g;
    g.prompt = std::move(prompt);
    g.max_tokens = tokens;
    g.ignore_eos = true;
    g.sampling.temperature = 1.0f;
    g.sampling.seed = seed * 1000003 + submitted++;
    g.sampling.grammar = grammar;
    EXL3_ASSIGN_OR_RETURN(const uint64_t id, engine.Submit(std::move(g), callback));
    shared.requests[id] = {slot, 0};
    ++shared.live;
    return absl::OkStatus();
  };
  const Clock::time_point t0 = Clock::now();
  std::unique_lock<std::mutex> lock(shared.mu);
  absl::Status submitting;
  for (int b = 0; b < batch && submitting.ok(); ++b) submitting = submit(b, prompts[b], max_tokens);
  for (;;) {
    shared.changed.wait(lock, [&] {
      return shared.live == 0 || (!shared.to_replace.empty() && submitting.ok() && shared.status.ok());
    });
    // After a failure no request is added; the callbacks' state lives here until the last ends.
    if (!submitting.ok() || !shared.status.ok()) {
      if (shared.live == 0) break;
      continue;
    }
    if (shared.to_replace.empty()) break;  // live == 0: done
    while (!shared.to_replace.empty() && submitting.ok()) {
      const int slot = shared.to_replace.front();
      shared.to_replace.pop_front();
      std::vector<int32_t> prompt(prompts[slot].size());
      for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
      submitting = submit(slot, std::move(prompt), shared.left[slot]);
    }
  }
  EXL3_RETURN_IF_ERROR(submitting);
  EXL3_RETURN_IF_ERROR(shared.status);
  ConstraintStepRun run;
  run.constrained = grammar != nullptr;
  run.max_tokens = max_tokens;
  run.requests = static_cast<int>(shared.requests.size());
  run.ended_by_grammar = shared.ended_by_grammar;
  run.tokens_min = max_tokens;
  int64_t total = 0;
  for (const auto& [id, r] : shared.requests) {
    run.tokens_min = std::min(run.tokens_min, r.tokens);
    run.tokens_max = std::max(run.tokens_max, r.tokens);
    total += r.tokens;
  }
  run.tokens_mean = static_cast<double>(total) / run.requests;
  run.seconds = Seconds(shared.last_end - t0);
  return run;
}

}  // namespace

std::optional<double> ConstraintStepBenchRow::Share() const {
  if (plain.full_batch_steps == 0 || constrained.full_batch_steps == 0 || plain.step_s <= 0) return std::nullopt;
  return (constrained.step_s - plain.step_s) / plain.step_s;
}

int ConstraintStepMaxTokens(int batch, int prompt_tokens, int steps, int token_budget) {
  const int64_t per_step = std::max(1, token_budget - batch);
  const int64_t prefill_steps = (int64_t{batch} * prompt_tokens + per_step - 1) / per_step;
  return static_cast<int>(steps + prefill_steps + 1);
}

absl::Status CheckConstraintTokenizer(const std::string& path, const std::string& text, int vocab_size) {
  absl::StatusOr<std::unique_ptr<engine::TokenGrammarCompiler>> compiler =
      engine::TokenGrammarCompiler::FromTokenizerJson(text, vocab_size, {});
  if (compiler.ok()) return absl::OkStatus();
  return absl::Status(compiler.status().code(), absl::StrCat(path, " for the model's vocab_size ", vocab_size, ": ",
                                                             compiler.status().message()));
}

absl::StatusOr<ConstraintStepBenchResult> RunConstraintStepBench(
    const ConstraintStepBenchOptions& o, const std::function<std::unique_ptr<engine::ModelRunner>()>& open_runner) {
  if (o.batches.empty()) return absl::InvalidArgumentError("constraint step bench: no batch sizes");
  for (int b : o.batches)
    if (b < 1) return absl::InvalidArgumentError(absl::StrCat("constraint step bench: batch ", b, " (>= 1)"));
  if (o.prompt_tokens < 1 || o.steps < 1)
    return absl::InvalidArgumentError("constraint step bench: prompt_tokens and steps >= 1");
  if (o.tokenizer_json.empty()) return absl::InvalidArgumentError("constraint step bench: no tokenizer.json");
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  // Fewer tokens per step than sequences: no step would hold the whole batch.
  if (o.engine.scheduler.max_num_batched_tokens < max_batch)
    return absl::InvalidArgumentError(absl::StrCat("constraint step bench: a step's token budget ",
                                                   o.engine.scheduler.max_num_batched_tokens,
                                                   " is below the largest batch ", max_batch));

  std::unique_ptr<engine::ModelRunner> runner = open_runner();
  if (runner == nullptr) return absl::FailedPreconditionError("constraint step bench: no model runner");
  const engine::ModelInfo info = runner->info();
  ConstraintStepBenchResult result;
  result.prompt_tokens = o.prompt_tokens;
  result.vocab_size = info.vocab_size;
  // As the router builds its compiler (services/router/generation.cc) and compiles a request's
  // response_format.
  const Clock::time_point t0 = Clock::now();
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<engine::TokenGrammarCompiler> compiler,
                        engine::TokenGrammarCompiler::FromTokenizerJson(o.tokenizer_json, info.vocab_size,
                                                                        info.eos_token_ids));
  const Clock::time_point t1 = Clock::now();
  engine::ConstraintSpec spec;
  spec.kind = engine::ConstraintKind::kJsonSchema;
  spec.text = o.schema.empty() ? std::string(kBenchJsonSchema) : o.schema;
  EXL3_ASSIGN_OR_RETURN(std::shared_ptr<const engine::TokenGrammar> grammar, compiler->Compile(spec));
  result.compiler_s = Seconds(t1 - t0);
  result.schema_compile_s = Seconds(Clock::now() - t1);

  std::vector<int> max_tokens;
  for (int b : o.batches) {
    max_tokens.push_back(
        ConstraintStepMaxTokens(b, o.prompt_tokens, o.steps, o.engine.scheduler.max_num_batched_tokens));
    if (info.max_context > 0 && o.prompt_tokens + max_tokens.back() > info.max_context)
      return absl::InvalidArgumentError(absl::StrCat("constraint step bench: prompts of ", o.prompt_tokens,
                                                     " tokens and ", max_tokens.back(), " tokens to generate at batch ",
                                                     b, " exceed the model's context of ", info.max_context));
  }

  StepLog log;
  engine::EngineOptions eo = o.engine;
  eo.scheduler.enable_prefix_caching = false;
  eo.scheduler.max_num_seqs = std::max(eo.scheduler.max_num_seqs, max_batch);
  eo.observer = &log;
  engine::Engine engine(eo, std::move(runner));
  EXL3_RETURN_IF_ERROR(engine.Start());
  std::mt19937_64 rng(o.seed);
  int64_t finished = 0;  // requests, over the runs
  absl::Status failed;
  for (size_t i = 0; i < o.batches.size() && failed.ok(); ++i) {
    const int batch = o.batches[i];
    std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(o.prompt_tokens));
    for (std::vector<int32_t>& p : prompts)
      for (int32_t& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(info.vocab_size));
    ConstraintStepBenchRow& row = result.rows.emplace_back();
    row.batch = batch;
    for (ConstraintStepRun* run : {&row.plain, &row.constrained}) {
      log.Take();
      absl::StatusOr<ConstraintStepRun> r =
          RunBatch(engine, prompts, max_tokens[i], run == &row.constrained ? grammar : nullptr, rng,
                   info.vocab_size, o.seed + i);
      if (!r.ok()) {
        failed = r.status();
        break;
      }
      *run = *std::move(r);
      // The last step's metrics are published just after the last request's final event.
      finished += run->requests;
      while (engine.Stats().requests_finished < finished) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      FillSteps(log.Take(), batch, *run);
    }
  }
  engine.Stop();
  EXL3_RETURN_IF_ERROR(failed);
  return result;
}

void PrintConstraintStepBench(const ConstraintStepBenchResult& result, FILE* out, FILE* json,
                              const std::string& label) {
  auto tokens_per_s = [](int batch, const ConstraintStepRun& r) { return r.step_s > 0 ? batch / r.step_s : 0.0; };
  std::fprintf(out,
               "vocab_size %d: grammar compiler %.1f ms, schema compile %.1f ms; prompts of %d tokens\n"
               "| batch | run | requests | max_tokens | ended by grammar | tokens per request min/mean/max | "
               "decode steps | full-batch steps | step ms | forward ms | sample ms | decode tokens/s |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
               result.vocab_size, result.compiler_s * 1e3, result.schema_compile_s * 1e3, result.prompt_tokens);
  for (const ConstraintStepBenchRow& row : result.rows) {
    for (const ConstraintStepRun* r : {&row.plain, &row.constrained}) {
      std::fprintf(out, "| %d | %s | %d | %d | %d | %d / %.1f / %d | %lld | %lld | %.3f | %.3f | %.3f | %.1f |\n",
                   row.batch, r->constrained ? "constrained" : "unconstrained", r->requests, r->max_tokens,
                   r->ended_by_grammar, r->tokens_min, r->tokens_mean, r->tokens_max,
                   static_cast<long long>(r->decode_steps), static_cast<long long>(r->full_batch_steps),
                   r->step_s * 1e3, r->forward_s * 1e3, r->sample_s * 1e3, tokens_per_s(row.batch, *r));
    }
  }
  std::fprintf(out, "\n| batch | unconstrained step ms | constrained step ms | difference ms | "
                    "share of the unconstrained step |\n|---|---|---|---|---|\n");
  for (const ConstraintStepBenchRow& row : result.rows) {
    const std::optional<double> share = row.Share();
    const double difference_s = row.constrained.step_s - row.plain.step_s;
    std::fprintf(out, "| %d | %.3f | %.3f | %s | %s |\n", row.batch, row.plain.step_s * 1e3,
                 row.constrained.step_s * 1e3, share ? absl::StrFormat("%+.3f", difference_s * 1e3).c_str() : "-",
                 share ? absl::StrFormat("%+.1f %%", *share * 100).c_str() : "- (a run had no full-batch step)");
    if (json == nullptr) continue;
    std::string fields;
    if (!label.empty()) absl::StrAppend(&fields, ",\"experts\":\"", label, "\"");
    absl::StrAppendFormat(&fields, ",\"context\":%d,\"batch\":%d,\"vocab_size\":%d,\"max_tokens\":%d",
                          result.prompt_tokens, row.batch, result.vocab_size, row.plain.max_tokens);
    for (const ConstraintStepRun* r : {&row.plain, &row.constrained}) {
      const char* run = r->constrained ? "constrained" : "plain";
      auto add = [&](const char* key, const std::string& value) {
        absl::StrAppend(&fields, ",\"", run, "_", key, "\":", value);
      };
      add("step_s", absl::StrFormat("%.6f", r->step_s));
      add("forward_s", absl::StrFormat("%.6f", r->forward_s));
      add("sample_s", absl::StrFormat("%.6f", r->sample_s));
      add("tokens_per_s", absl::StrFormat("%.1f", tokens_per_s(row.batch, *r)));
      add("decode_steps", absl::StrCat(r->decode_steps));
      add("full_batch_steps", absl::StrCat(r->full_batch_steps));
      add("requests", absl::StrCat(r->requests));
      add("ended_by_grammar", absl::StrCat(r->ended_by_grammar));
      add("tokens_min", absl::StrCat(r->tokens_min));
      add("tokens_mean", absl::StrFormat("%.2f", r->tokens_mean));
      add("tokens_max", absl::StrCat(r->tokens_max));
      add("seconds", absl::StrFormat("%.3f", r->seconds));
    }
    std::fprintf(json, "{\"bench\":\"engine_constraint_step\"%s,\"difference_s\":%s,\"share\":%s}\n", fields.c_str(),
                 share ? absl::StrFormat("%.6f", difference_s).c_str() : "null",
                 share ? absl::StrFormat("%.4f", *share).c_str() : "null");
  }
}

}  // namespace exl3::bench

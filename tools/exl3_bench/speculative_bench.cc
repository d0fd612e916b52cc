#include "tools/exl3_bench/speculative_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "tools/exl3_bench/recorded_drafter.h"

namespace exl3::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The step times of one run (EngineObserver: called on the engine's loop thread).
class StepTimes final : public engine::EngineObserver {
 public:
  void OnStep(const engine::StepMetrics& s) override {
    // Decode and verify steps only: a step that also prefills a prompt is another cost.
    if (s.num_decode_tokens == 0 || s.num_prefill_tokens > 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    const double t = s.forward_s + s.sample_s;
    ++steps_;
    step_s_ += t;
    if (s.num_verify_chunks > 0) {
      ++verify_steps_;
      verify_s_ += t;
    }
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    steps_ = verify_steps_ = 0;
    step_s_ = verify_s_ = 0;
  }
  void Fill(SpeculativeBenchRow& row) {
    std::lock_guard<std::mutex> lock(mu_);
    row.steps = steps_;
    row.verify_steps = verify_steps_;
    row.mean_step_s = steps_ > 0 ? step_s_ / steps_ : 0;
    row.mean_verify_step_s = verify_steps_ > 0 ? verify_s_ / verify_steps_ : 0;
  }

 private:
  std::mutex mu_;
  int64_t steps_ = 0, verify_steps_ = 0;
  double step_s_ = 0, verify_s_ = 0;
};

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;  // per request
  std::vector<std::vector<float>> gaps;      // per request and token: top-1 minus top-2 logprob
  double decode_tokens_per_s = 0;
  double seconds = 0;
};

// Decode tokens/s while every request decodes: from the last request's first token (every prompt
// prefilled) to the first request's last token, the tokens delivered in between over that time.
// Where that window is empty (one request: its first to its last token), the whole span.
double DecodeTokensPerSecond(const std::vector<std::vector<std::pair<Clock::time_point, int>>>& deliveries) {
  Clock::time_point start = Clock::time_point::min(), end = Clock::time_point::max();
  for (const auto& d : deliveries) {
    if (d.empty()) return 0;
    start = std::max(start, d.front().first);
    end = std::min(end, d.back().first);
  }
  if (end <= start) {
    start = Clock::time_point::max();
    end = Clock::time_point::min();
    for (const auto& d : deliveries) {
      start = std::min(start, d.front().first);
      end = std::max(end, d.back().first);
    }
  }
  int64_t tokens = 0;
  for (const auto& d : deliveries) {
    for (const auto& [when, count] : d) tokens += when > start && when <= end ? count : 0;
  }
  const double window = Seconds(end - start);
  return window > 0 ? tokens / window : 0;
}

// SpeculativeBenchRow::modeled_tokens_per_s from the row's measured steps.
double ModeledTokensPerSecond(const SpeculativeBenchRow& row, engine::DraftLengthPolicy policy) {
  if (row.k == 0) return row.mean_step_s > 0 ? row.batch / row.mean_step_s : 0;
  if (policy != engine::DraftLengthPolicy::kFixed || row.mean_verify_step_s <= 0) return 0;
  const double p = row.acceptance;
  // Tokens a verify chunk yields: accepted drafts until the first rejection, plus the target's own.
  const double tokens = p >= 1 ? row.k + 1 : (1 - std::pow(p, row.k + 1)) / (1 - p);
  return row.batch * tokens / row.mean_verify_step_s;
}

// Every prompt at once, greedy, decode_tokens each, with the request's draft cap k.
absl::StatusOr<RunResult> RunAll(engine::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                 int decode_tokens, int k) {
  struct Shared {
    std::mutex mu;
    std::condition_variable done;
    std::map<uint64_t, size_t> index;  // request id -> prompt index
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<float>> gaps;
    std::vector<std::vector<std::pair<Clock::time_point, int>>> deliveries;  // per request: when, how many tokens
    size_t finished = 0;
    absl::Status status;
  } shared;
  const size_t n = prompts.size();
  shared.tokens.resize(n);
  shared.gaps.resize(n);
  shared.deliveries.resize(n);
  std::vector<uint64_t> ids;
  auto callback = [&shared](const engine::GenerateEvent& e) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(shared.mu);
    const size_t i = shared.index.at(e.request_id);
    if (!e.tokens.empty()) {
      shared.deliveries[i].emplace_back(now, static_cast<int>(e.tokens.size()));
      for (const engine::SampledToken& t : e.tokens) {
        shared.tokens[i].push_back(t.token);
        shared.gaps[i].push_back(t.top_logprobs.size() >= 2 ? t.top_logprobs[0].logprob - t.top_logprobs[1].logprob
                                                            : -1.0f);
      }
    }
    if (e.finish.has_value()) {
      if (!e.finish->status.ok() && shared.status.ok()) shared.status = e.finish->status;
      ++shared.finished;
      shared.done.notify_all();
    }
  };
  const Clock::time_point t0 = Clock::now();
  {
    // Held while submitting: a request's first event waits for its index.
    std::lock_guard<std::mutex> lock(shared.mu);
    for (size_t i = 0; i < n; ++i) {
      engine::GenerateParams g;
      g.prompt = prompts[i];
      g.max_tokens = decode_tokens;
      g.ignore_eos = true;
      g.sampling.temperature = 0;
      g.sampling.logprobs = 2;  // in every run alike: the top-2 gap where a request differs
      g.num_speculative_tokens = k;
      EXL3_ASSIGN_OR_RETURN(const uint64_t id, engine.Submit(std::move(g), callback));
      shared.index[id] = i;
    }
  }
  std::unique_lock<std::mutex> lock(shared.mu);
  shared.done.wait(lock, [&] { return shared.finished == n; });
  EXL3_RETURN_IF_ERROR(shared.status);
  RunResult r;
  r.seconds = Seconds(Clock::now() - t0);
  r.decode_tokens_per_s = DecodeTokensPerSecond(shared.deliveries);
  r.tokens = std::move(shared.tokens);
  r.gaps = std::move(shared.gaps);
  return r;
}

}  // namespace

absl::StatusOr<std::vector<SpeculativeBenchRow>> RunSpeculativeBench(
    const SpeculativeBenchOptions& o, const std::function<std::unique_ptr<engine::ModelRunner>()>& open_runner) {
  if (o.batches.empty() || o.ks.empty() || o.acceptances.empty())
    return absl::InvalidArgumentError("speculative bench: batches, ks and acceptances must not be empty");
  for (int b : o.batches)
    if (b < 1) return absl::InvalidArgumentError(absl::StrCat("speculative bench: batch ", b, " (>= 1)"));
  for (int k : o.ks)
    if (k < 1) return absl::InvalidArgumentError(absl::StrCat("speculative bench: k ", k, " (>= 1)"));
  for (double p : o.acceptances)
    if (!(p >= 0 && p <= 1))
      return absl::InvalidArgumentError(absl::StrCat("speculative bench: acceptance ", p, " (in [0, 1])"));
  if (o.prompt_tokens < 1 || o.decode_tokens < 2)
    return absl::InvalidArgumentError("speculative bench: prompt_tokens >= 1 and decode_tokens >= 2");

  std::unique_ptr<engine::ModelRunner> runner = open_runner();
  if (runner == nullptr) return absl::FailedPreconditionError("speculative bench: no model runner");
  const int vocab = runner->info().vocab_size;
  auto drafter = std::make_shared<RecordedDrafter>(0.0, o.seed, vocab);
  StepTimes times;
  engine::EngineOptions eo = o.engine;
  // A prefix-cache hit would prefill the later runs' prompts in other chunks than the plain run's.
  eo.scheduler.enable_prefix_caching = false;
  eo.scheduler.max_num_seqs = std::max(eo.scheduler.max_num_seqs, *std::max_element(o.batches.begin(), o.batches.end()));
  engine::SpeculativeOptions& spec = eo.scheduler.speculative;
  spec = {};
  spec.method = engine::SpeculativeMethod::kProvided;
  spec.num_speculative_tokens = *std::max_element(o.ks.begin(), o.ks.end());
  spec.draft_length = o.draft_length;
  spec.proposer = drafter;
  eo.observer = &times;
  engine::Engine engine(eo, std::move(runner));
  EXL3_RETURN_IF_ERROR(engine.Start());

  std::mt19937_64 rng(o.seed);
  // Random prompt ids, never an image / video placeholder (the engine refuses them in prompts);
  // redrawn, so other models' prompts are the same draws as before.
  const std::vector<engine::MediaPlaceholder> media = engine.model_info().media_placeholders;
  auto random_token = [&]() {
    for (;;) {
      const int32_t t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
      if (std::none_of(media.begin(), media.end(), [t](const engine::MediaPlaceholder& m) { return m.token_id == t; }))
        return t;
    }
  };
  std::vector<SpeculativeBenchRow> rows;
  int64_t finished = 0;  // requests, over the runs
  for (int batch : o.batches) {
    std::vector<std::vector<int32_t>> prompts(batch);
    for (std::vector<int32_t>& p : prompts) {
      p.resize(o.prompt_tokens);
      for (int32_t& t : p) t = random_token();
    }
    auto run = [&](int k, double p, const RunResult* want) -> absl::StatusOr<RunResult> {
      drafter->set_acceptance(p);
      times.Reset();
      const engine::SpeculativeCounters before = engine.Stats().speculative;
      EXL3_ASSIGN_OR_RETURN(RunResult r, RunAll(engine, prompts, o.decode_tokens, k));
      // The stats (and the observer's last step) are published just after the last request's
      // final event.
      finished += batch;
      while (engine.Stats().requests_finished < finished) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      SpeculativeBenchRow& row = rows.emplace_back();
      row.batch = batch;
      row.k = k;
      row.acceptance = p;
      row.decode_tokens_per_s = r.decode_tokens_per_s;
      row.seconds = r.seconds;
      times.Fill(row);
      row.modeled_tokens_per_s = ModeledTokensPerSecond(row, o.draft_length);
      const engine::SpeculativeCounters after = engine.Stats().speculative;
      row.draft_tokens = after.num_draft_tokens - before.num_draft_tokens;
      row.accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens;
      if (want != nullptr) {
        for (size_t i = 0; i < r.tokens.size(); ++i) {
          const std::vector<int32_t>& a = r.tokens[i];
          const std::vector<int32_t>& b = want->tokens[i];
          if (a == b) continue;
          ++row.requests_differing;
          const size_t t = std::mismatch(a.begin(), a.end(), b.begin(), b.end()).second - b.begin();
          if (t < want->gaps[i].size())
            row.widest_gap_at_difference = std::max(row.widest_gap_at_difference, double{want->gaps[i][t]});
        }
      }
      return r;
    };
    EXL3_ASSIGN_OR_RETURN(const RunResult plain, run(0, 0.0, nullptr));
    for (int i = 0; i < batch; ++i) EXL3_RETURN_IF_ERROR(drafter->Record(prompts[i], plain.tokens[i]));
    for (double p : o.acceptances) {
      for (int k : o.ks) EXL3_RETURN_IF_ERROR(run(k, p, &plain).status());
    }
  }
  engine.Stop();
  return rows;
}

void PrintSpeculativeBench(const std::vector<SpeculativeBenchRow>& rows, FILE* out, FILE* json) {
  std::fprintf(out, "| batch | k | acceptance p | decode tokens/s | vs plain | steps | mean step ms | verify steps | "
                    "mean verify step ms | draft tokens | accepted | accepted/drafted | tokens differ | "
                    "widest top-2 gap where one differs | tokens/s if p held (from the steps) | vs plain |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  double plain_rate = 0, plain_modeled = 0;
  for (const SpeculativeBenchRow& r : rows) {
    if (r.k == 0) {
      plain_rate = r.decode_tokens_per_s;
      plain_modeled = r.modeled_tokens_per_s;
    }
    const std::string modeled = r.modeled_tokens_per_s > 0 ? absl::StrFormat("%.1f", r.modeled_tokens_per_s) : "-";
    const std::string modeled_ratio = r.modeled_tokens_per_s > 0 && plain_modeled > 0
                                          ? absl::StrFormat("%.2fx", r.modeled_tokens_per_s / plain_modeled)
                                          : "-";
    const double ratio = r.draft_tokens > 0 ? static_cast<double>(r.accepted_tokens) / r.draft_tokens : 0;
    const std::string gap = r.requests_differing > 0 ? absl::StrFormat("%.2e", r.widest_gap_at_difference) : "-";
    std::fprintf(out, "| %d | %s | %s | %.1f | %.2fx | %lld | %.3f | %lld | %.3f | %lld | %lld | %.3f | %d | %s | %s | %s |\n",
                 r.batch,
                 r.k == 0 ? "plain" : std::to_string(r.k).c_str(),
                 r.k == 0 ? "-" : absl::StrCat(r.acceptance).c_str(), r.decode_tokens_per_s,
                 plain_rate > 0 ? r.decode_tokens_per_s / plain_rate : 0.0, static_cast<long long>(r.steps),
                 r.mean_step_s * 1e3, static_cast<long long>(r.verify_steps), r.mean_verify_step_s * 1e3,
                 static_cast<long long>(r.draft_tokens), static_cast<long long>(r.accepted_tokens), ratio,
                 r.requests_differing, gap.c_str(), modeled.c_str(), modeled_ratio.c_str());
    if (json != nullptr) {
      std::fprintf(json,
                   "{\"bench\":\"engine_speculative\",\"batch\":%d,\"k\":%d,\"acceptance\":%.3f,"
                   "\"decode_tokens_per_s\":%.2f,\"steps\":%lld,\"mean_step_s\":%.6f,\"verify_steps\":%lld,"
                   "\"mean_verify_step_s\":%.6f,\"draft_tokens\":%lld,\"accepted_tokens\":%lld,"
                   "\"requests_differing\":%d,\"widest_gap_at_difference\":%.6g,\"modeled_tokens_per_s\":%.2f}\n",
                   r.batch, r.k, r.acceptance, r.decode_tokens_per_s, static_cast<long long>(r.steps), r.mean_step_s,
                   static_cast<long long>(r.verify_steps), r.mean_verify_step_s,
                   static_cast<long long>(r.draft_tokens), static_cast<long long>(r.accepted_tokens),
                   r.requests_differing, r.widest_gap_at_difference, r.modeled_tokens_per_s);
    }
  }
}

}  // namespace exl3::bench

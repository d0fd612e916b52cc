// The engine's Prometheus metrics (docs/metrics.md, "Engine"), fed by the engine's observer hooks
// (engine/core/engine.h) on its loop thread, and its gauges refreshed from Engine::Stats by Refresh().
// Names follow vLLM's where users know them (time to first token, inter-token latency, end-to-end
// latency, queue time, prompt/generation tokens, running/waiting, KV usage, prefix cache,
// speculative decoding's drafts and acceptance).
#pragma once

#include <string>
#include <vector>

#include "engine/core/engine.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace exl3::router {

class EngineMetrics final : public engine::EngineObserver {
 public:
  explicit EngineMetrics(prometheus::Registry& registry);
  void OnStep(const engine::StepMetrics& step) override;
  void OnRequestFinished(std::string_view tag, const engine::FinishInfo& finish) override;
  // Gauges from the engine's snapshot (call before each scrape or periodically).
  void Refresh(const engine::EngineStats& stats);
  // exl3_engine_first_token_write_seconds{stage="started"|"done"}, observed by the Generator
  // service (GeneratorOptions::first_write_*).
  prometheus::Histogram& first_write_started() { return first_write_started_; }
  prometheus::Histogram& first_write_done() { return first_write_done_; }

 private:
  prometheus::Histogram& ttft_;
  prometheus::Histogram& itl_;
  prometheus::Histogram& e2e_;
  prometheus::Histogram& queue_;
  prometheus::Histogram& prefill_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& generation_tokens_;
  prometheus::Counter& cached_tokens_;
  prometheus::Family<prometheus::Counter>& finished_fam_;
  prometheus::Family<prometheus::Histogram>& phase_fam_;
  prometheus::Histogram* phase_[9];
  prometheus::Family<prometheus::Histogram>& moe_stage_fam_;
  prometheus::Family<prometheus::Histogram>& first_write_fam_;
  prometheus::Histogram& first_write_started_;
  prometheus::Histogram& first_write_done_;
  prometheus::Histogram& moe_gate_;
  prometheus::Histogram& moe_experts_;
  prometheus::Histogram& moe_wait_;
  prometheus::Histogram& moe_to_host_;
  prometheus::Histogram& moe_to_device_;
  prometheus::Histogram& step_tokens_;
  prometheus::Counter& failed_steps_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& kv_usage_;
  prometheus::Counter& preemptions_;
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_hits_;
  prometheus::Counter& spec_drafts_;
  prometheus::Counter& spec_draft_tokens_;
  prometheus::Counter& spec_accepted_tokens_;
  prometheus::Family<prometheus::Counter>& spec_accepted_per_pos_fam_;
  std::vector<prometheus::Counter*> spec_accepted_per_pos_;  // by draft position, added as seen
  prometheus::Histogram& spec_verify_step_;
  prometheus::Gauge& spec_mean_draft_length_;
  engine::EngineStats last_{};
};

}  // namespace exl3::router

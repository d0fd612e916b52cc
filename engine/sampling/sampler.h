// Turns one row of model logits into the next token of a sequence.
//
//   Sampler sampler(vocab_size);                       // holds scratch buffers: one per thread
//   SamplingParams p; p.temperature = 0.7f; p.top_p = 0.9f; p.logprobs = 5;
//   SequenceHistory h{prompt_tokens, output_tokens, /*banned_tokens=*/{}};
//   SampledToken t = sampler.Sample(row, p, seed, h);  // row: vocab_size floats, overwritten
//
// Processing order: the constraint's mask (tokens it does not allow: -inf) → logit_bias (added)
// → banned tokens (-inf) → repetition, presence and frequency penalties → temperature → top-k →
// top-p → min-p → draw. Temperature 0 (or below kGreedyBelowTemperature) is greedy: the arg max
// after the penalties, the lowest token id on ties.
//
// Logprobs are the log_softmax of the model logits after the constraint's mask and before
// everything else (logit_bias, penalties, temperature, truncation), as vLLM reports them (its
// default logprobs mode, raw_logprobs, is taken after the grammar's bitmask, which its model
// runner applies before the sampler, and before its logit-bias processor): the model's own
// distribution over the tokens the constraint allows. Without a constraint: the raw logits.
//
// Randomness is counter-based: the draw for a sequence's output token i is a pure function of
// (seed, i), so the same seed gives the same tokens whatever else runs in the batch, and also
// after the sequence was preempted and recomputed. The draw is defined so that another
// implementation (the GPU's, engine/cuda/sampling_kernels.h) can match it token for token: the
// kept tokens are a head of the candidates in Higher order (top-k: the k first; top-p: the
// shortest head holding top_p of the mass, in double; min-p: logit >= max + log(min_p), in
// float); u = UniformDraw(seed, i); the chosen token is the first kept token in ASCENDING TOKEN
// ID order whose running mass (double sums of the float weights exp(logit - max)) exceeds
// u * the kept mass, the highest kept id when rounding leaves none.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace exl3::engine {

class TokenGrammar;  // engine/sampling/token_grammar.h

// Temperatures below this sample greedily, as vLLM's do: the distribution is one token long
// before that, and 1 / T overflows a float below about 3e-39.
inline constexpr float kGreedyBelowTemperature = 1e-5f;

struct TokenBias {
  int32_t token = 0;
  float bias = 0;
};

// A logit_bias entry's largest magnitude (OpenAI's range).
inline constexpr float kMaxLogitBias = 100.0f;

struct SamplingParams {
  float temperature = 1.0f;         // below kGreedyBelowTemperature (0 included): greedy
  int top_k = 0;                    // 0: off
  float top_p = 1.0f;               // 1: off; in (0, 1]
  float min_p = 0.0f;               // 0: off; in [0, 1]
  // HF semantics: the logit of every token seen in the prompt or the output is divided by it when
  // positive, multiplied when negative. 1: off.
  float repetition_penalty = 1.0f;
  // OpenAI semantics over the output tokens: logit -= presence * (count > 0) + frequency * count.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;     // unset: the engine seeds the request from a random device
  std::optional<int> logprobs;      // unset: none; N: the chosen token's logprob and the top N
  // OpenAI semantics: added to the token's logit (after the constraint's mask, before the rest).
  std::vector<TokenBias> logit_bias;
  // Set: the output must match it (engine/sampling/token_constraint.h gives each step's mask).
  std::shared_ptr<const TokenGrammar> grammar;

  bool greedy() const { return temperature < kGreedyBelowTemperature; }
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct SampledToken {
  int32_t token = 0;
  // Set when SamplingParams::logprobs is: the chosen token's logprob, then the top N.
  std::optional<float> logprob;
  std::vector<TokenLogprob> top_logprobs;  // highest first, lowest token id first on ties
  // Sampler::PromptLogprobs only (0 elsewhere): 1 + how many tokens have a higher raw logit
  // (vLLM's rank of a prompt token).
  int rank = 0;
};

// What the penalties and bans look at; every field initialised, so that brace initialisers may
// stop after any of them.
struct SequenceHistory {
  std::span<const int32_t> prompt{};
  std::span<const int32_t> output{};         // tokens generated so far; its size is the draw index
  std::span<const int32_t> banned_tokens{};  // get -inf (e.g. EOS before min_tokens)
  // Empty: every token; else the constraint's mask of allowed tokens (engine/sampling/token_constraint.h:
  // bit t % 32 of word t / 32), the others get -inf.
  std::span<const uint32_t> allowed_tokens{};
};

// Everything Sampler::Sample takes besides the logits: one logit row's sampling, as the
// scheduler hands it to a runner that samples on its own device (engine/core/model_runner.h). The
// history's spans point into the caller's token histories.
struct RowSampling {
  SamplingParams params;
  uint64_t seed = 0;
  SequenceHistory history;
};

class Sampler {
 public:
  explicit Sampler(int vocab_size);

  // Picks the next token from `logits` (vocab_size floats, overwritten as scratch).
  SampledToken Sample(std::span<float> logits, const SamplingParams& params, uint64_t seed,
                      const SequenceHistory& history);

  // As Sample, for a row whose constraint has the last word: while `accepts` refuses the drawn
  // token (it takes the token when it accepts it), that token leaves history.allowed_tokens and
  // the row is drawn again from `logits` as they came, at most `max_refusals` times. nullopt:
  // refused that often, or no allowed token left. (xgrammar 0.2.9's mask can allow a token its
  // matcher refuses: a byte-level token that ends in part of a UTF-8 character, such as "-\xE0"
  // where an integer starts; bench/results/structured-output.md.)
  std::optional<SampledToken> SampleAccepted(std::span<float> logits, const SamplingParams& params, uint64_t seed,
                                             const SequenceHistory& history,
                                             const std::function<bool(int32_t)>& accepts, int max_refusals);

  // A prompt position's logprobs (prompt logprobs): `token`'s (the prompt's next token) and the
  // top N of `logits`, as Sample reports them for a sampled token (the raw logits' log_softmax).
  SampledToken PromptLogprobs(std::span<const float> logits, int32_t token, int top_n);

  // The uniform draw in (0, 1) of a sequence's output token `draw_index` (exposed for tests).
  static double UniformDraw(uint64_t seed, uint64_t draw_index);

 private:
  // out.logprob (of out.token) and out.top_logprobs (the best top_n) from the raw logits.
  void FillLogprobs(std::span<const float> raw, int top_n, SampledToken& out);
  void ApplyPenalties(std::span<float> logits, const SamplingParams& params,
                      const SequenceHistory& history);
  // -inf for every token whose bit in `allowed` is 0 (words past its end: none allowed).
  static void ApplyAllowedMask(std::span<float> logits, std::span<const uint32_t> allowed);
  // Applies temperature, top-k, top-p and min-p, and draws.
  int32_t Draw(std::span<float> logits, const SamplingParams& params, double uniform);
  // Moves to the front of candidates_[0, n) its smallest head in Higher order that holds
  // max_count tokens or mass_fraction of their mass (weights_), and returns the head's size.
  // Their logits lie in [lowest, highest], highest being the largest.
  size_t SelectHead(std::span<const float> logits, size_t n, float highest, float lowest,
                    size_t max_count, double mass_fraction);
  // Higher logit first, lower token id first on ties.
  static bool Higher(std::span<const float> logits, int32_t a, int32_t b);

  const int vocab_size_;
  std::vector<float> raw_;                  // the raw row, kept when logprobs are wanted
  std::vector<float> row_as_given_;         // SampleAccepted: the row before Sample's first pass
  std::vector<uint32_t> allowed_;           // SampleAccepted: the mask less the refused tokens
  std::vector<int32_t> candidates_;         // token ids still in the running
  std::vector<float> weights_;              // per token: exp(logit - max) of candidates
  std::vector<int> bucket_count_;           // SelectHead's histogram
  std::vector<double> bucket_mass_;
  std::vector<int32_t> boundary_;           // SelectHead's last bucket
  std::vector<int32_t> output_counts_;      // per token, zero between calls
  std::vector<uint8_t> seen_;               // per token, zero between calls
  std::vector<int32_t> touched_;            // tokens whose counts / seen flags to reset
};

}  // namespace exl3::engine

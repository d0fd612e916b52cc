// The per-step sampling inputs and results as a device sampler reads and writes them: plain
// structs shared by the host-side packer (engine/sampling/sampling_pack.h) and the GPU kernels
// (engine/cuda/sampling_kernels.h), so this header is C++17 and includes nothing but <cstdint>.
//
// One PackedSamplingRow per logit row, and per row a range of PackedPenaltyEntry: every distinct
// token the row's penalties or bans touch, with its count among the sequence's output tokens
// (engine/sampling/sampler.h ApplyPenalties defines what is touched). The results come back as
// OutputWordsPerRow(max_top) 32-bit words per row (SampledRowWords says which is which).
#pragma once

#include <cstdint>

namespace exl3::engine {

// The most top logprobs one row may ask of a device sampler (the top list is sorted in shared
// memory); rows asking more are sampled on the host.
constexpr int kMaxDeviceTopLogprobs = 1024;

// PackedSamplingRow::flags.
enum PackedSamplingFlag : uint32_t {
  kPackedGreedy = 1u << 0,      // temperature 0: the arg max after the penalties
  kPackedTopP = 1u << 1,        // top_p < 1
  kPackedMinP = 1u << 2,        // min_p > 0
  kPackedRepetition = 1u << 3,  // repetition_penalty != 1
  kPackedAdditive = 1u << 4,    // presence_penalty or frequency_penalty != 0
};

struct PackedSamplingRow {
  double uniform = 0;               // Sampler::UniformDraw(seed, output tokens so far)
  float inv_temperature = 1;        // 1.0f / temperature, as the CPU sampler computes it
  float top_p = 1;
  float log_min_p = 0;              // std::log(min_p) in float, as the CPU sampler computes it
  float repetition_penalty = 1;
  float presence_penalty = 0;
  float frequency_penalty = 0;
  int32_t top_k = 0;                // 0: off
  int32_t num_logprobs = -1;        // -1: none; else the chosen token's and the top N raw logprobs
  int32_t entries_begin = 0;        // this row's entries: [entries_begin, entries_end)
  int32_t entries_end = 0;
  uint32_t flags = 0;               // PackedSamplingFlag bits
  int32_t reserved = 0;
};
static_assert(sizeof(PackedSamplingRow) == 56, "the kernels read this layout");

struct PackedPenaltyEntry {
  int32_t token = 0;
  int32_t output_count = 0;  // occurrences among the output tokens (0: prompt only)
  int32_t banned = 0;        // 1: the token gets -inf whatever its history
  float raw_logit = 0;       // written by the device: the row's logit before the penalties
};
static_assert(sizeof(PackedPenaltyEntry) == 16, "the kernels read this layout");

// Word offsets within one row's results.
enum SampledRowWords : int {
  kSampledToken = 0,     // int32
  kSampledLogprob = 1,   // float bits: the chosen token's raw logprob (when asked)
  kSampledNumTop = 2,    // int32: entries of the top list that follow
  kSampledTopBegin = 3,  // (token int32, logprob float bits) pairs, highest first
};

constexpr int OutputWordsPerRow(int max_top) { return kSampledTopBegin + 2 * max_top; }

}  // namespace exl3::engine

// Sampling on the GPU: each logit row to its next token exactly as the CPU sampler
// (engine/sampling/sampler.h) picks it, with the logprobs it reports. Host launcher only: this header
// includes no CUDA header. Every pointer is device memory; the launch goes on `stream` and does
// not synchronise.
//
// One block of 1024 threads per row, in passes over the row (which stays in global memory, L2 at
// these sizes):
//   1. logprobs (when asked): max and log-sum-exp of the RAW row, its top N by a radix select of
//      the N-th largest (Higher order: logit, then lower id) and a bitonic sort of those N;
//   2. bans and penalties from the row's PackedPenaltyEntry list, in place (each entry keeps its
//      raw logit for the chosen token's logprob);
//   3. greedy: the arg max, lowest id on ties. Otherwise, x = logit * (1 / temperature) and
//      w = exp(x - max x) by the CPU sampler's own polynomial (engine/sampling/sampler.cc ExpNonPositive;
//      every float operation rounded as the CPU's, no fused multiply-adds), then
//      top-k: the k-th candidate in Higher order by a radix select over the ordered float bits
//      (four 8-bit passes with per-warp histograms) and a scan over the tied values in id order;
//      top-p: the same select by mass (double) over what top-k left; min-p: x >= max + log(min_p);
//      the draw: a block-wide prefix sum of w over the kept tokens in ascending id order to the
//      first one past u * their mass (u from the host: Sampler::UniformDraw).
// The result can differ from the CPU's only where double sums taken in another order round to
// the other side of a threshold (top-p's mass, the draw's target): far below fp32 resolution.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/sampling/packed_sampling.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t

// Samples rows [0, num_rows) of `logits` ([num_rows, vocab] fp32, overwritten where bans and
// penalties apply) with rows[r] and its entries (entries' raw_logit written), into `out`
// (OutputWordsPerRow(max_top) words per row; max_top >= every row's num_logprobs, at most
// kMaxDeviceTopLogprobs).
absl::Status SampleRows(float* logits, int vocab, int num_rows, const PackedSamplingRow* rows,
                        PackedPenaltyEntry* entries, int max_top, uint32_t* out,
                        StreamHandle stream);

// Constrained rows: row row_ids[m] of `logits` ([rows, vocab] fp32) gets -inf wherever bit t % 32 of
// word t / 32 of masks[m] ([num_masked, words] uint32, words >= ceil(vocab / 32)) is 0, in place,
// and the masked row is also written to saved[m] ([num_masked, vocab] fp32) for a host redraw
// (engine/cuda/device_sampler.h MaskedRow). row_ids [num_masked] int32.
absl::Status MaskRows(float* logits, int vocab, int num_masked, const int32_t* row_ids, const uint32_t* masks,
                      int words, float* saved, StreamHandle stream);

}  // namespace exl3::engine::cuda

#include "engine/cuda/mtp_drafting.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/load_cuda_mtp_drafter.h"
#include "kernels/cuda/cuda_status.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

absl::Status CudaMtpDrafting::Check() const {
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TensorSource> src, TensorSource::Open(dir_));
  return CheckCudaMtpDrafter(cfg_, *src);
}

absl::Status CudaMtpDrafting::Enable() {
  if (enabled()) return absl::OkStatus();
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TensorSource> src, TensorSource::Open(dir_));
  if (cfg_.dsv4 != nullptr) {  // DeepSeek-V4's mtp.*: the DSPARK block drafter (docs/dspark.md)
    EXL3_RETURN_IF_ERROR(CheckCudaMtpDrafter(cfg_, *src));
    EXL3_ASSIGN_OR_RETURN(dspark_, CudaDsparkDrafter::Load(cfg_, *src, parts_));
    return absl::OkStatus();
  }
  EXL3_ASSIGN_OR_RETURN(drafter_, LoadCudaMtpDrafter(cfg_, *src, parts_));
  sampler_ = std::make_unique<DeviceSampler>(cfg_.vocab_size);
  return absl::OkStatus();
}

CudaMtpDrafting::Kept CudaMtpDrafting::kept() const {
  if (dspark_ != nullptr) return Kept::kTaps;
  return drafter_->input() == MtpInput::kStreams ? Kept::kStreams : Kept::kHeadInput;
}

int CudaMtpDrafting::TapSlot(int layer) const {
  if (dspark_ == nullptr) return -1;
  const std::vector<int>& layers = dspark_->tap_layers();
  const auto it = std::find(layers.begin(), layers.end(), layer);
  return it == layers.end() ? -1 : static_cast<int>(it - layers.begin());
}

absl::Status CudaMtpDrafting::AllocateCache(const KvCacheShape& shape, StreamHandle stream) {
  if (dspark_ != nullptr) return dspark_->AllocateCache(shape, stream);
  return drafter_ == nullptr ? absl::OkStatus() : drafter_->AllocateCache(shape, stream);
}

absl::Status CudaMtpDrafting::ReserveKept(int T) {
  const size_t t = static_cast<size_t>(T);
  const size_t n = t * static_cast<size_t>(state_width());
  if (kept_.rows.size() < n) EXL3_RETURN_IF_ERROR(kept_.rows.Reserve(n));
  if (kept() != Kept::kHeadInput || all_rows_.size() >= t) return absl::OkStatus();
  std::vector<int32_t> rows(t);
  for (int r = 0; r < T; ++r) rows[r] = r;
  EXL3_RETURN_IF_ERROR(all_rows_.Reserve(t));
  // On the model's stream, before the step's launches (a pageable source is staged before the call returns).
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all_rows_.get(), rows.data(), t * sizeof(int32_t), cudaMemcpyHostToDevice,
                                            static_cast<cudaStream_t>(device_->stream())));
  return absl::OkStatus();
}

void CudaMtpDrafting::RecordKept(const StepBatch& batch) { kept_.chunks.Record(batch); }

absl::Status CudaMtpDrafting::BatchOf(std::span<const MtpSpan> spans, StepBatch* batch) {
  EXL3_RETURN_IF_ERROR(kept_.chunks.CheckSpans(spans));
  const size_t W = static_cast<size_t>(drafter_->state_width());
  size_t rows = 0;
  for (const MtpSpan& s : spans) rows += static_cast<size_t>(s.num_positions);
  if (in_.size() < rows * W) EXL3_RETURN_IF_ERROR(in_.Reserve(rows * W));
  const cudaStream_t stream = static_cast<cudaStream_t>(device_->stream());
  size_t row = 0;
  for (const MtpSpan& s : spans) {
    batch->chunks.push_back(MtpChunkOf(s));
    // The span's kept positions are its chunk's first rows.
    const float* first = kept_.rows.get() + static_cast<size_t>(kept_.chunks.first_row(s.chunk_index)) * W;
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(in_.get() + row * W, first,
                                              static_cast<size_t>(s.num_positions) * W * sizeof(float),
                                              cudaMemcpyDeviceToDevice, stream));
    row += static_cast<size_t>(s.num_positions);
  }
  return absl::OkStatus();
}

absl::Status CudaMtpDrafting::RunStep(const StepBatch& batch, const KvCacheShape& shape, StepTokens* step_tokens,
                                      std::vector<int32_t>* tokens) {
  const int V = cfg_.vocab_size;
  const size_t W = static_cast<size_t>(drafter_->state_width());
  EXL3_RETURN_IF_ERROR(FlattenStep(batch, V, shape, cfg_.max_position_embeddings, step_tokens));
  const size_t T = static_cast<size_t>(step_tokens->num_tokens), R = step_tokens->logit_tokens.size();
  if (out_.size() < T * W) EXL3_RETURN_IF_ERROR(out_.Reserve(T * W));
  if (logits_.size() < R * V) EXL3_RETURN_IF_ERROR(logits_.Reserve(R * V));
  EXL3_RETURN_IF_ERROR(drafter_->Forward(*step_tokens, in_.get(), out_.get(), logits_.get()));
  // Greedy: the arg max of each row, lowest id on ties (as the CPU model's drafts).
  std::vector<RowSampling> rows(R);
  for (RowSampling& r : rows) r.params.temperature = 0.0f;
  if (R > 0) EXL3_RETURN_IF_ERROR(sampler_->Launch(logits_.get(), rows, device_->stream()));
  EXL3_RETURN_IF_ERROR(device_->Synchronize());
  EXL3_RETURN_IF_ERROR(drafter_->EndStep(batch));
  std::vector<SampledToken> sampled(R);
  if (R > 0) sampler_->Collect(std::span<SampledToken>(sampled));
  tokens->clear();
  for (const SampledToken& t : sampled) tokens->push_back(t.token);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<int32_t>>> CudaMtpDrafting::ProposeBlockDrafts(std::span<const MtpSpan> spans) {
  EXL3_RETURN_IF_ERROR(kept_.chunks.CheckSpans(spans));
  const size_t W = static_cast<size_t>(dspark_->tap_width());
  std::vector<DsparkRowWrite> writes;
  std::vector<DsparkDraftCall> calls;
  std::vector<size_t> owners;  // the span of each call
  for (size_t k = 0; k < spans.size(); ++k) {
    const MtpSpan& s = spans[k];
    // 1. The kept positions' main-kv rows, from their taps (the span's chunk's first rows).
    DsparkRowWrite& w = writes.emplace_back();
    w.taps = kept_.rows.get() + static_cast<size_t>(kept_.chunks.first_row(s.chunk_index)) * W;
    w.start_position = s.start_position;
    w.num_positions = s.num_positions;
    w.block_table = &s.block_table;
    if (s.num_drafts <= 0) continue;
    // 2. One block draft after the last kept position, seeded with the token there.
    if (s.next_tokens.empty())
      return absl::InvalidArgumentError(absl::StrCat("MTP span of sequence ", s.sequence_id, ": no next tokens"));
    DsparkDraftCall& c = calls.emplace_back();
    c.seed = s.next_tokens.back();
    c.p0 = s.start_position + s.num_positions;
    c.block_table = &s.block_table;
    owners.push_back(k);
  }
  EXL3_ASSIGN_OR_RETURN(const std::vector<DsparkDraft> blocks, dspark_->Run(writes, calls, /*want_logits=*/false));
  std::vector<std::vector<int32_t>> drafts(spans.size());
  for (size_t c = 0; c < blocks.size(); ++c) {
    const int n = std::min(spans[owners[c]].num_drafts, blocks[c].length);
    drafts[owners[c]].assign(blocks[c].drafts.begin(), blocks[c].drafts.begin() + n);
  }
  return drafts;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> CudaMtpDrafting::ProposeDrafts(std::span<const MtpSpan> spans,
                                                                                  const KvCacheShape& shape) {
  if (dspark_ != nullptr) return ProposeBlockDrafts(spans);
  if (drafter_ == nullptr) return absl::FailedPreconditionError("MTP drafting is not enabled");
  const size_t W = static_cast<size_t>(drafter_->state_width());
  std::vector<std::vector<int32_t>> drafts(spans.size());
  // 1. Every span's kept positions, from the model's kept states; a decoding span's last position
  // gives its first draft. 2. Chained: each further draft from the drafter's own output at the
  // position before and the draft just made.
  StepBatch batch;
  EXL3_RETURN_IF_ERROR(BatchOf(spans, &batch));
  std::vector<int> owners;  // the span of each logit row, in order
  for (size_t i = 0; i < spans.size(); ++i)
    if (spans[i].num_drafts > 0) owners.push_back(static_cast<int>(i));
  const cudaStream_t stream = static_cast<cudaStream_t>(device_->stream());
  while (!batch.chunks.empty()) {
    StepTokens tokens;
    std::vector<int32_t> greedy;
    EXL3_RETURN_IF_ERROR(RunStep(batch, shape, &tokens, &greedy));
    if (greedy.size() != owners.size())
      return absl::InternalError(absl::StrCat("MTP step: ", greedy.size(), " rows for ", owners.size(), " drafting spans"));
    StepBatch next;
    std::vector<int> next_owners, next_rows;  // next_rows: the rows of out_ the chained drafts run on
    for (size_t r = 0; r < owners.size(); ++r) {
      const int i = owners[r];
      drafts[i].push_back(greedy[r]);
      const MtpSpan& s = spans[i];
      if (static_cast<int>(drafts[i].size()) >= s.num_drafts) continue;
      SequenceChunk& chunk = next.chunks.emplace_back();
      chunk.sequence_id = s.sequence_id;
      chunk.tokens = {greedy[r]};
      // Draft d (1-based) sits at position p + 1 + d, p the last kept position; the head predicts
      // it at position p + d - 1 + 1 from the draft before.
      chunk.start_position = s.start_position + s.num_positions - 1 + static_cast<int>(drafts[i].size());
      chunk.block_table = s.block_table;
      chunk.wants_logits = true;
      chunk.state_slot = s.state_slot;
      next_owners.push_back(i);
      next_rows.push_back(tokens.logit_tokens[r]);
    }
    if (!next_rows.empty()) {
      if (in_.size() < next_rows.size() * W) EXL3_RETURN_IF_ERROR(in_.Reserve(next_rows.size() * W));
      for (size_t j = 0; j < next_rows.size(); ++j)
        EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(in_.get() + j * W, out_.get() + static_cast<size_t>(next_rows[j]) * W,
                                                  W * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    batch = std::move(next);
    owners = std::move(next_owners);
  }
  return drafts;
}

}  // namespace exl3::engine::cuda

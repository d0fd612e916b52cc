// The seam between the scheduler (which sequences run this step, which KV blocks they own) and the
// model (which runs the step's tokens through every layer). The scheduler side never sees a tensor;
// the model side never sees a request.
//
//   std::unique_ptr<ModelRunner> runner = ...;              // CPU model, CUDA model, or a test fake
//   const ModelInfo& info = runner->info();
//   EXL3_RETURN_IF_ERROR(runner->AllocateKvCache({/*num_blocks=*/512, /*block_size=*/16}));
//   StepBatch batch;                                         // filled by the scheduler
//   std::vector<float> logits(batch.NumLogitRows() * info.vocab_size);
//   EXL3_RETURN_IF_ERROR(runner->Forward(batch, logits.data()));
//   // or, where runner->SamplesRows(params) for every row's params (the CUDA model):
//   EXL3_RETURN_IF_ERROR(runner->ForwardSampled(batch, rows, tokens));
//
// A step is a list of chunks, one per sequence: a prompt chunk (prefill), the one token sampled
// last step (decode), or, with speculative decoding, that token followed by draft tokens whose
// logits are all wanted (a verify chunk: num_logit_rows = 1 + drafts). Chunk c runs tokens [start_position, start_position + num_tokens) of its
// sequence; the keys and values of positions [0, start_position) are already in the cache blocks
// its block table names (block b holds positions [b * block_size, (b + 1) * block_size)), and the
// step writes those of its own tokens there too. The block table covers every position up to
// start_position + num_tokens.
//
// Models with recurrent layers (Qwen3-Next's gated DeltaNet) also keep a fixed-size state per
// sequence (ModelInfo::state_bytes_per_sequence > 0): every running sequence holds one state slot
// of [0, num_sequence_slots) from admission to finish or preemption (SequenceChunk::state_slot).
// A chunk starting at position 0 starts its state afresh; any later chunk continues the state its
// slot holds, which must cover exactly positions [0, start_position) of that sequence. A state
// cannot be rebuilt from cached KV blocks, so such models run without prefix-cache hits. A verify
// chunk of R logit rows leaves its slot holding the state after each of those R positions, and the
// sequence's next chunk continues the one its start_position names (the positions the scheduler
// kept once it knew the accepted drafts; engine/cpu/sequence_state.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/sampling/sampler.h"

namespace exl3::engine {

// A token id that stands for an image or video input in a multimodal checkpoint's vocabulary
// (Glm5Next, Qwen4Exp). The engines run the text model only: the engine refuses it in prompts;
// generated or drafted, it is an ordinary token (transformers embeds it as text when no pixels come).
struct MediaPlaceholder {
  int32_t token_id = 0;
  std::string kind;  // "image" or "video"
};

// What the scheduler needs to know of the model.
struct ModelInfo {
  std::string name;                  // served model name (the directory's base name by default)
  std::string architecture;          // config.json "architectures"[0]
  int vocab_size = 0;
  int max_context = 0;               // max_position_embeddings
  std::vector<int32_t> eos_token_ids;  // config.json / generation_config.json eos_token_id
  // Bytes of KV cache one token takes over all layers (the cache's unit of capacity).
  int64_t kv_bytes_per_token = 0;
  // Bytes of fixed-size state one running sequence holds beside its KV blocks (recurrent layers;
  // 0 for models without them), allocated once per state slot.
  int64_t state_bytes_per_sequence = 0;
  std::vector<MediaPlaceholder> media_placeholders;  // refused in prompts
};

struct KvCacheShape {
  int num_blocks = 0;
  int block_size = 16;  // tokens per block
  // Per-sequence state slots (the most sequences running at once); used by models whose
  // state_bytes_per_sequence > 0.
  int num_sequence_slots = 0;
  // The most logit rows a chunk asks for (SequenceChunk::num_logit_rows): 1, or with speculative
  // decoding 1 + num_speculative_tokens. Models with per-sequence state keep that many states
  // per slot for a verify chunk.
  int max_logit_rows_per_chunk = 1;
};

// What a chunk's logit rows are for.
enum class LogitRowsUse {
  // The rows predict tokens to sample: the last token's (plain), or a verify chunk's last
  // token and drafts, whose recurrent states are kept per row (engine/cpu/sequence_state.h).
  kNextTokens,
  // Prompt logprobs: a prompt chunk wants every one of its positions' rows (the last may also be
  // the sequence's next token's). Its positions are all kept, so a model with recurrent state
  // keeps only the state after its last token, as for a plain chunk.
  kPromptPositions,
};

struct SequenceChunk {
  int64_t sequence_id = 0;
  std::vector<int32_t> tokens;        // the tokens to run (prompt chunk, or the last sampled token)
  int start_position = 0;             // position of tokens[0] in its sequence
  std::vector<int32_t> block_table;   // cache blocks of positions [0, start_position + tokens.size())
  bool wants_logits = false;          // logits of the chunk's last token are wanted
  // With wants_logits: the logits of the chunk's last num_logit_rows tokens are wanted, one row
  // each in position order (1 but for a verify chunk; at most tokens.size()). Only runners whose
  // CheckDraftVerification is OK get chunks of more than 1.
  int num_logit_rows = 1;
  LogitRowsUse logit_rows_use = LogitRowsUse::kNextTokens;
  int state_slot = 0;                 // the sequence's state slot, in [0, num_sequence_slots)
};

struct StepBatch {
  std::vector<SequenceChunk> chunks;
  // Speculative method mtp: the runner keeps every token's final hidden state of this step (the
  // input of the model's head, after its final norm) for the ProposeMtpDrafts call after it.
  bool keep_hidden_states = false;

  int NumTokens() const {
    int n = 0;
    for (const SequenceChunk& c : chunks) n += static_cast<int>(c.tokens.size());
    return n;
  }
  int NumLogitRows() const {
    int n = 0;
    for (const SequenceChunk& c : chunks) n += c.wants_logits ? c.num_logit_rows : 0;
    return n;
  }
};

// MTP drafting (engine/cpu/mtp/mtp_head.h): one sequence's part of the step just run. Its chunk's first
// num_positions tokens were kept (a prompt chunk: all; a verify chunk: the last sampled token
// and its accepted drafts); the MTP layer runs over those positions p = start_position + j,
// each from the model's hidden state at p and the sequence's token at p + 1 (next_tokens[j]),
// writing its own KV there. With num_drafts > 0 the sequence is decoding: the MTP's prediction
// at its last kept position is draft 1 (for position start_position + num_positions + 1), and
// each further draft comes from the MTP run again at the next position on its own output hidden
// state and the draft before (positions up to start_position + num_positions + num_drafts - 2,
// which block_table must cover).
struct MtpSpan {
  int64_t sequence_id = 0;
  int chunk_index = 0;                // the chunk of the last Forward's batch
  int start_position = 0;             // that chunk's start_position
  int num_positions = 0;              // >= 1
  std::vector<int32_t> next_tokens;   // [num_positions]
  std::vector<int32_t> block_table;
  int state_slot = 0;
  int num_drafts = 0;
};

// Time spent per phase in the last Forward, for the engine's step metrics.
struct StepPhaseTimes {
  double embed_s = 0, attention_s = 0, moe_s = 0, dense_mlp_s = 0, head_s = 0;
  double sample_s = 0;  // sampling on the runner's device (ForwardSampled)
  // Within moe_s, the stages of experts run in this process (MoeExecutor::TakeStageTimes): the
  // gate's routing and the experts. Zero where the executor reports none (experts on workers).
  double moe_gate_s = 0, moe_experts_s = 0;
  // Experts on workers (a MoeExecutor whose calls run elsewhere): the step's calls (MoE layers x
  // micro-batches), the time the forward pass was blocked waiting for their answers (within
  // moe_s), and on the GPU engine the copies of the hidden states to the host's staging and of
  // the answers back (device time; they overlap other work where micro-batches alternate).
  int remote_moe_calls = 0;
  double remote_moe_wait_s = 0, remote_moe_to_host_s = 0, remote_moe_to_device_s = 0;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelInfo& info() const = 0;
  // Allocates the cache once (every block of every layer); called before the first Forward.
  virtual absl::Status AllocateKvCache(const KvCacheShape& shape) = 0;
  // Runs one step. `logits` receives [batch.NumLogitRows(), vocab_size] fp32: per chunk that
  // wants logits, in chunk order, the rows of its last num_logit_rows tokens in position order. An error fails the whole step (the engine then fails the
  // step's sequences and goes on) and leaves every sequence's state slot as it was before it, so
  // the step's chunks may run again.
  virtual absl::Status Forward(const StepBatch& batch, float* logits) = 0;
  virtual StepPhaseTimes LastPhaseTimes() const { return {}; }

  // Whether Forward takes verify chunks (num_logit_rows > 1) for this model, and leaves the model
  // as if positions past what the scheduler later keeps were never run: OK, or why not (the
  // engine refuses speculative decoding at start with this status). A runner that keeps nothing
  // per sequence but the KV of each position can say OK once its head computes several rows per
  // chunk.
  virtual absl::Status CheckDraftVerification() const {
    return absl::FailedPreconditionError(
        "this model runner does not verify draft tokens (speculative decoding) yet");
  }

  // Whether Forward returns every position's row for a prompt chunk (num_logit_rows up to the
  // chunk's size, LogitRowsUse::kPromptPositions): OK, or why not (the engine refuses requests
  // for prompt logprobs with this status).
  virtual absl::Status CheckPromptLogitRows() const {
    return absl::FailedPreconditionError(
        "this model runner does not return the logits of every prompt position (prompt logprobs) yet");
  }

  // Whether this runner drafts with the model's MTP head (speculative method mtp): OK, or why not
  // (the engine refuses the method at start with this status). Then AllocateKvCache gives the
  // MTP layer a cache layer of its own (ModelInfo::kv_bytes_per_token counts it only after
  // EnableMtpDrafting).
  virtual absl::Status CheckMtpDrafting() const {
    return absl::FailedPreconditionError("this model runner does not draft with an MTP head");
  }
  // Called once before AllocateKvCache when the engine drafts with the MTP head; updates info().
  virtual absl::Status EnableMtpDrafting() { return CheckMtpDrafting(); }
  // Runs the MTP layer over `spans` (parts of the last Forward's batch, which had
  // keep_hidden_states) and returns each span's num_drafts greedy drafts (argmax of the MTP's
  // logits), in span order.
  virtual absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeMtpDrafts(
      std::span<const MtpSpan> /*spans*/) {
    return absl::UnimplementedError("this model runner does not draft with an MTP head");
  }

  // Sampling where the logits are (the GPU), so that only tokens come back to the host. A runner
  // that can sample rows of `params` itself says so here; the engine then runs every step whose
  // rows it can all sample through ForwardSampled, and any other step through Forward and the
  // host's Sampler (engine/core/engine.cc Engine::RunForward is the one place that decides).
  virtual bool SamplesRows(const SamplingParams& /*params*/) const { return false; }
  // Runs one step as Forward does, then samples logit row i as Sampler::Sample would with
  // rows[i] (the same tokens for the same logits, and the logprobs it reports) into tokens[i];
  // rows.size() == tokens.size() == batch.NumLogitRows(). A constrained row's mask
  // (rows[i].history.allowed_tokens) may still be being filled on another thread until
  // `masks_ready` returns: the runner calls it once, after queuing the forward pass and before
  // it reads any row's mask (so the masks fill while the device works).
  virtual absl::Status ForwardSampled(const StepBatch& /*batch*/,
                                      std::span<const RowSampling> /*rows*/,
                                      std::span<SampledToken> /*tokens*/,
                                      const std::function<void()>& /*masks_ready*/) {
    return absl::UnimplementedError("this model runner does not sample");
  }
  // After ForwardSampled: logit row `row` as its sampling saw it after the constraint's mask and
  // before anything else (logit_bias, bans, penalties), for a row that had a mask. The engine
  // draws such a row again on the host in the rare case its constraint refuses the token the
  // mask allowed (engine/sampling/sampler.h SampleAccepted). logits.size() == vocab_size.
  virtual absl::Status MaskedRowLogits(int /*row*/, std::span<float> /*logits*/) {
    return absl::UnimplementedError("this model runner does not sample");
  }
};

}  // namespace exl3::engine

#include "engine/cuda/deltanet_mixer.h"

#include <algorithm>

#include "base/status_macros.h"
#include "engine/cuda/cuda_gated_deltanet.h"
#include "engine/cuda/device_sequence_states.h"
#include "engine/sequence_state.h"

namespace exl3::engine::cuda {
namespace {

struct DeltaNetShared {
  DeltaNetShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  std::unique_ptr<DeviceSequenceStates> states;  // made by AllocateCache
  DeltaNetWorkspace ws;
  // The step's chunk facts (device) and each chunk's first row, in order (host).
  const int32_t* chunk_of = nullptr;
  const int32_t* chunk_table = nullptr;
  std::vector<int> chunk_first;
  size_t facts_at = 0;  // where PackStep put them in the step's array

  // The chunks of rows [first, first + n) (whole chunks).
  DeltaNetStep StepFor(int first, int n) const {
    DeltaNetStep step;
    step.chunks.chunk_of = chunk_of;
    step.chunks.table = chunk_table;
    step.chunks.row_floats = states->row_floats();
    step.store = states->layer(0);
    const auto begin = std::lower_bound(chunk_first.begin(), chunk_first.end(), first);
    const auto end = std::lower_bound(chunk_first.begin(), chunk_first.end(), first + n);
    step.first_chunk = static_cast<int>(begin - chunk_first.begin());
    step.num_chunks = static_cast<int>(end - begin);
    return step;
  }
};

class DeltaNetMixer final : public CudaMixer {
 public:
  DeltaNetMixer(DeltaNetShared& shared, std::unique_ptr<CudaGatedDeltaNet> layer)
      : s_(shared), layer_(std::move(layer)) {}

  absl::Status Forward(const CudaStep&, const float* x, int first, int n, float* out) override {
    return layer_->Forward(x, first, n, s_.StepFor(first, n), s_.ws, s_.linear, out);
  }
  int64_t weight_bytes() const override { return layer_->weight_bytes(); }
  std::vector<const CudaLinear*> linears() const override { return layer_->linears(); }

 private:
  DeltaNetShared& s_;
  std::unique_ptr<CudaGatedDeltaNet> layer_;
};

class DeltaNetKind final : public CudaMixerKind {
 public:
  DeltaNetKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    // The layer's state within a store row: every earlier layer's before it.
    int64_t state_offset = 0;
    for (int l = 0; l < layer; ++l) state_offset += s_.cfg.StateFloats(l);
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaGatedDeltaNet> net,
                          CudaGatedDeltaNet::Load(s_.cfg, src, layer, state_offset));
    return std::make_unique<DeltaNetMixer>(s_, std::move(net));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    s_.states.reset();
    EXL3_ASSIGN_OR_RETURN(std::vector<int64_t> floats, StateFloatsPerLayer(s_.cfg, shape.num_sequence_slots));
    EXL3_ASSIGN_OR_RETURN(s_.states, DeviceSequenceStates::Create(std::move(floats), shape.num_sequence_slots));
    return absl::OkStatus();
  }
  int64_t KvBytesPerToken() const override { return 0; }  // a state per sequence, not per token

  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream) override {
    return s_.states->BeginStep(batch, stream);
  }
  absl::Status EndStep(const StepBatch& batch, StreamHandle) override {
    s_.states->CommitStep(batch);
    return absl::OkStatus();
  }

  absl::Status Reserve(int rows, int, bool* moved) override {
    bool ws_moved = false;
    EXL3_RETURN_IF_ERROR(s_.ws.Reserve(s_.cfg.linear_attention, rows, &ws_moved));
    *moved |= ws_moved;
    return absl::OkStatus();
  }

  absl::Status PackStep(const StepTokens& tokens, int rows, std::vector<int32_t>* facts) override {
    const DeviceSequenceStates& states = *s_.states;
    std::vector<int32_t> chunk_of(rows), table;
    s_.chunk_first.clear();
    for (int t = 0; t < rows; ++t) {
      const bool real = t < tokens.num_tokens;
      if (!real || t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) {
        int32_t read = states.padding_read_row(), write = states.padding_write_row();
        if (real) {
          const int slot = tokens.batch->chunks[tokens.chunk_of[t]].state_slot;
          read = states.ReadRow(slot);
          write = states.WriteRow(slot);
        }
        s_.chunk_first.push_back(t);
        table.insert(table.end(), {t, 0, read, write});
      }
      table[table.size() - kDeltaNetChunkInts + 1] += 1;
      chunk_of[t] = static_cast<int32_t>(s_.chunk_first.size()) - 1;
    }
    s_.facts_at = facts->size();
    facts->insert(facts->end(), chunk_of.begin(), chunk_of.end());
    facts->insert(facts->end(), table.begin(), table.end());
    return absl::OkStatus();
  }

  absl::Status BindStep(const CudaStep& step, const StepTokens&, const int32_t* device_facts, StreamHandle) override {
    s_.chunk_of = device_facts + s_.facts_at;
    s_.chunk_table = s_.chunk_of + step.rows;
    return absl::OkStatus();
  }

 private:
  DeltaNetShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeDeltaNetKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<DeltaNetKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda

// The plumbing of one gRPC bidi stream of protobuf messages, both ends alike: the router's engine
// streams (services/router/engine_stream.h) and the worker's streams
// (services/expert_worker/worker_server.cc) are its server end, the router's session with each
// worker (services/router/worker_pool.cc) its client end. Messages travel as raw bytes
// (services/common/raw_message.h): a message that does not parse ends the stream with
// INVALID_ARGUMENT saying why, instead of passing for the end of the stream.
//
// What it does, so that its users only say what a message means:
// - Writes: queued, one outstanding at a time, the next started by OnWriteDone; a writer (any
//   thread) only queues and at most starts a write, never waits.
// - Back-pressure: reading pauses while `pause_reads_at` messages wait to be written and resumes
//   below half of it (a peer that stops reading its answers stops being read from); a client end
//   bounds its unwritten bytes instead (HasRoomLocked), its writes being requests it can refuse.
// - The end: a server end finishes once the peer half-closed (or FinishWhenIdle asked) and the
//   user owes no answer (OwesAnswersLocked) and nothing is left to write; End, a failed write, a
//   message that does not parse or the peer's cancel end it at once (what is queued is dropped,
//   OnAbandoned withdraws the user's work). A client end ends when either side does.
// - A shared-memory side channel (services/common/shm_side_channel.h): messages read from it are
//   handled like the stream's, writes go through it when it has room. It shares the stream's
//   fate: the stream's end closes it and joins its reader, and its end (closed by the peer, or
//   broken) ends the stream.
//
// Locking: the stream's state is guarded by mutex() (a user's own state may be too: the user's
// *Locked hooks run with it held). Every gRPC operation (StartRead, StartWrite, StartCall, Finish)
// and every write into the side channel is started with mutex() held: gRPC never runs a reaction
// inline from a Start call, so this cannot deadlock, and it orders every operation against the
// end (none is started after Finish or OnDone) and keeps the side channel's writer single.
// Cancelling a client's call (TryCancel) is done with it released. OnMessage, OnAbandoned and
// OnEnded run with it released.
//
// Lifetime: the user keeps the stream alive until OnEnded has returned (a registry, or a
// reference of its own); OnEnded runs once, after gRPC's OnDone and after the side channel's
// reader has returned.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"
#include "base/logging.h"
#include "services/common/raw_message.h"
#include "services/common/shm_channel.h"
#include "services/common/shm_side_channel.h"

namespace exl3::svc {

// Where a message came from, or which way a write should go.
enum class Path { kStream, kSideChannel };

struct BidiStreamOptions {
  // Reading pauses while this many messages wait to be written; none: it never pauses.
  std::optional<size_t> pause_reads_at;
  // HasRoomLocked's bound on the bytes waiting to be written; none: no bound.
  std::optional<size_t> max_unwritten_bytes;
  // Names the stream in log lines ("worker a", "engine stream").
  std::string name = "stream";
};

// The two ends' gRPC reactions, passed on to BidiStream under one set of names: PeerCancelled
// (a server end's OnCancel) and Done (OnDone, with gRPC's final status of a client end's call; a
// server end passes OK, its status being the one it finished with).
class ServerSide : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static constexpr bool kServer = true;

 protected:
  virtual void PeerCancelled() = 0;
  virtual void Done(const grpc::Status& status) = 0;

 private:
  void OnCancel() final { PeerCancelled(); }
  void OnDone() final { Done(grpc::Status::OK); }
};

class ClientSide : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static constexpr bool kServer = false;
  grpc::ClientContext& context() { return context_; }

 protected:
  virtual void PeerCancelled() {}  // a client learns of it from its final status
  virtual void Done(const grpc::Status& status) = 0;

 private:
  void OnDone(const grpc::Status& s) final { Done(s); }
  grpc::ClientContext context_;
};

template <class Side, class In, class Out>
class BidiStream : public Side {
 public:
  using Options = BidiStreamOptions;

  explicit BidiStream(Options opt) : BidiStream(own_mu_, std::move(opt)) {}
  // Guarded by `mu`, a mutex of the user's that outlives the stream.
  BidiStream(std::mutex& mu, Options opt) : mu_(mu), opt_(std::move(opt)) {}
  ~BidiStream() override = default;
  BidiStream(const BidiStream&) = delete;
  BidiStream& operator=(const BidiStream&) = delete;

  std::mutex& mutex() const { return mu_; }

  // A server end starts reading.
  void Begin() {
    static_assert(Side::kServer, "a client end begins with BeginCall");
    std::lock_guard<std::mutex> l(mu_);
    StartReadLocked();
  }
  // A client end starts the call `method` ("/package.Service/Method") on `stub`'s channel.
  void BeginCall(grpc::GenericStub& stub, const std::string& method) {
    static_assert(!Side::kServer, "a server end begins with Begin");
    stub.PrepareBidiStreamingCall(&this->context(), method, grpc::StubOptions(), this);
    std::lock_guard<std::mutex> l(mu_);
    StartReadLocked();
    this->StartCall();
  }

  // ---- writing (mutex() held) ----
  // The stream takes writes (it is not ending).
  bool WritableLocked() const { return phase_ == Phase::kOpen; }
  // `bytes` more fit under max_unwritten_bytes.
  bool HasRoomLocked(size_t bytes) const {
    return !opt_.max_unwritten_bytes || unwritten_bytes_ + bytes <= *opt_.max_unwritten_bytes;
  }
  // Queues `m` (dropped when the stream is ending). kSideChannel: through the side channel when
  // one is attached and has room for it, else on the stream.
  void WriteLocked(Out m, Path path) {
    if (phase_ == Phase::kOpen) {
      if (path == Path::kSideChannel && side_ != nullptr && side_->TryWrite(m)) {
        SideWrittenLocked(m);
        return MaybeFinishLocked();
      }
      const size_t bytes = m.ByteSizeLong();
      unwritten_bytes_ += bytes;
      queue_.push_back(Unwritten{std::move(m), bytes});
      if (!writing_) StartFrontWriteLocked();
    }
    MaybeFinishLocked();
  }
  // Drops the first message waiting to be written (not the one being written) for which
  // `match(const Out&)` is true; true when there was one.
  template <class Match>
  bool WithdrawLocked(Match match) {
    auto it = queue_.begin();
    if (writing_ && it != queue_.end()) ++it;
    for (; it != queue_.end(); ++it) {
      if (!match(it->msg)) continue;
      unwritten_bytes_ -= it->bytes;
      queue_.erase(it);
      return true;
    }
    return false;
  }
  size_t UnwrittenMessagesLocked() const { return queue_.size(); }
  size_t unwritten_messages() const {
    std::lock_guard<std::mutex> l(mu_);
    return queue_.size();
  }
  size_t unwritten_bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    return unwritten_bytes_;
  }

  // ---- the end ----
  // Ends the stream now with `why` (mutex() released): no more reads or writes, what is queued
  // is dropped, OnAbandoned runs; a server end finishes with `why` once no write is outstanding,
  // a client end's call is cancelled (OnEnded then gets `why`). Later calls change nothing.
  void End(const grpc::Status& why) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (phase_ != Phase::kOpen) return MaybeFinishLocked();
      phase_ = Phase::kEnding;
      end_status_ = why;
      DropQueueLocked();
      if (side_ != nullptr) side_->Close();
      MaybeFinishLocked();
    }
    OnAbandoned();
    CancelClientCall();
  }
  // A server end finishes with `st` once it owes nothing and has written everything (a half-close
  // first still finishes it OK).
  void FinishWhenIdle(const grpc::Status& st) {
    static_assert(Side::kServer, "only a server end finishes");
    std::lock_guard<std::mutex> l(mu_);
    if (!finish_when_idle_) finish_when_idle_ = st;
    MaybeFinishLocked();
  }
  // Finishes a server end that has become idle; the user calls it when OwesAnswersLocked may have
  // turned false (WriteLocked calls it too).
  void MaybeFinishLocked() {
    if constexpr (Side::kServer) {
      if (phase_ == Phase::kFinished || phase_ == Phase::kDone || writing_) return;
      if (phase_ == Phase::kEnding) return FinishLocked(*end_status_);
      if (!finish_when_idle_ || OwesAnswersLocked() || !queue_.empty()) return;
      FinishLocked(*finish_when_idle_);
    }
  }
  // Finished (or done), or owing nothing with nothing to write.
  bool IdleLocked() const {
    return phase_ == Phase::kFinished || phase_ == Phase::kDone ||
           (!OwesAnswersLocked() && queue_.empty() && !writing_);
  }

  // ---- the side channel (mutex() held) ----
  // Attaches `channel` and starts reading it; false (nothing attached) when the stream is ending
  // or has one already.
  bool AttachSideChannelLocked(std::shared_ptr<ShmChannel> channel) {
    if (phase_ != Phase::kOpen || side_ != nullptr) return false;
    side_ = std::make_unique<ShmSideChannel>(std::move(channel), ShmSideChannel::Reader{
        [this](const uint8_t* p, size_t n) { return ParseSideMessage(p, n); },
        [this] { HandleSideMessage(); },
        [this](const absl::Status& why) { SideChannelEnded(why); }});
    return true;
  }
  bool HasSideChannelLocked() const { return side_ != nullptr; }
  // A side channel is attached and open.
  bool SideChannelOpenLocked() const { return side_ != nullptr && !side_->closed(); }

 protected:
  // ---- the user's hooks ----
  // One message read from the stream or the side channel (mutex() released). `m` may be moved
  // from. Messages read on the side channel arrive on its reader thread, concurrently with the
  // stream's.
  virtual void OnMessage(In& m, Path from) = 0;
  // The user still owes the peer answers (mutex() held): a server end does not finish yet.
  virtual bool OwesAnswersLocked() const { return false; }
  // The stream ends before its answers could all be written: withdraw the work still in flight.
  virtual void OnAbandoned() {}
  // The stream is over: End's status or the server end's Finish status, else (a client end)
  // gRPC's final status. Runs once, last.
  virtual void OnEnded(const grpc::Status& st) = 0;
  // Buffer reuse on the side channel, where large messages otherwise cost a fresh allocation (a
  // page fault per 4 KiB under the services' 4 MiB mmap threshold) each. SideWrittenLocked: `m`
  // was written into the side channel and is dropped next (mutex() held); its buffers may be
  // taken. BeforeSideRead: on the reader thread, before a message is parsed into `m` (empty):
  // fields given buffers here are parsed into in place (the message is merged into `m`, so a
  // submessage created here stays present, if empty, when the peer sent none).
  virtual void SideWrittenLocked(Out& /*m*/) {}
  virtual void BeforeSideRead(In& /*m*/) {}

 private:
  // kOpen: reading and writing. kEnding: End decided (a server end waits for its outstanding
  // write to Finish). kFinished: Finish called. kDone: gRPC's OnDone ran.
  enum class Phase { kOpen, kEnding, kFinished, kDone };
  // kReading: a read is outstanding. kPaused: back-pressure. kStopped: no more reads.
  enum class ReadState { kReading, kPaused, kStopped };
  struct Unwritten {
    Out msg;
    size_t bytes;
  };

  // ---- gRPC's reactions ----
  void OnReadDone(bool ok) final {
    if (!ok) return ReadsEnded();
    if (absl::Status st = ParseRaw(&rbuf_, &in_); !st.ok()) {
      return End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat(st.message(), "; the stream ends")));
    }
    if (IsOpen()) OnMessage(in_, Path::kStream);
    in_.Clear();
    std::lock_guard<std::mutex> l(mu_);
    ContinueReadingLocked();
  }

  void OnWriteDone(bool ok) final {
    {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
      wbuf_.Clear();  // its slices: a large message's bytes would otherwise live until the next
      if (!queue_.empty()) {
        unwritten_bytes_ -= queue_.front().bytes;
        queue_.pop_front();
      }
      if (ok) return WriteDoneLocked();
    }
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the peer is gone (a write failed)"));
  }

  void PeerCancelled() final {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
  }

  void Done(const grpc::Status& status) final {
    std::unique_ptr<ShmSideChannel> side;
    grpc::Status st;
    {
      std::lock_guard<std::mutex> l(mu_);
      phase_ = Phase::kDone;
      read_ = ReadState::kStopped;
      queue_.clear();
      unwritten_bytes_ = 0;
      if (side_ != nullptr) side_->Close();
      side = std::move(side_);
      st = end_status_ ? *end_status_ : Side::kServer ? finished_with_ : status;
    }
    if (side != nullptr) side->Join();
    side.reset();
    OnEnded(st);
  }

  // ---- reading ----
  void StartReadLocked() {
    read_ = ReadState::kReading;
    this->StartRead(&rbuf_);
  }
  void ContinueReadingLocked() {
    if (phase_ != Phase::kOpen) {
      read_ = ReadState::kStopped;
    } else if (opt_.pause_reads_at && queue_.size() >= *opt_.pause_reads_at) {
      read_ = ReadState::kPaused;  // resumed by WriteDoneLocked
    } else {
      StartReadLocked();
    }
  }
  // The peer half-closed (or the call is over). A server end finishes once idle; a client end's
  // call ends, even with a write stuck (gRPC's final status says why).
  void ReadsEnded() {
    {
      std::lock_guard<std::mutex> l(mu_);
      read_ = ReadState::kStopped;
      if constexpr (Side::kServer) {
        finish_when_idle_ = grpc::Status::OK;
        return MaybeFinishLocked();
      }
      if (phase_ == Phase::kOpen) phase_ = Phase::kEnding;
      DropQueueLocked();
      if (side_ != nullptr) side_->Close();
    }
    CancelClientCall();
  }
  bool IsOpen() const {
    std::lock_guard<std::mutex> l(mu_);
    return phase_ == Phase::kOpen;
  }

  // ---- writing ----
  void StartFrontWriteLocked() {
    writing_ = true;
    if (absl::Status st = SerializeRaw(queue_.front().msg, &wbuf_); !st.ok()) {
      LogError("%s: message not sent: %s", opt_.name.c_str(), std::string(st.message()).c_str());
    }
    this->StartWrite(&wbuf_);
  }
  void WriteDoneLocked() {
    if (read_ == ReadState::kPaused && phase_ == Phase::kOpen &&
        queue_.size() < *opt_.pause_reads_at / 2) {
      StartReadLocked();
    }
    if (!queue_.empty() && phase_ == Phase::kOpen) return StartFrontWriteLocked();
    MaybeFinishLocked();
  }
  // Drops what waits to be written (the message being written stays until OnWriteDone).
  void DropQueueLocked() {
    auto keep = queue_.begin();
    if (writing_ && keep != queue_.end()) ++keep;
    for (auto it = keep; it != queue_.end(); ++it) unwritten_bytes_ -= it->bytes;
    queue_.erase(keep, queue_.end());
  }
  void FinishLocked(const grpc::Status& st) {
    phase_ = Phase::kFinished;
    finished_with_ = st;
    this->Finish(st);
  }
  void CancelClientCall() {
    if constexpr (!Side::kServer) this->context().TryCancel();
  }

  // ---- the side channel's reader (its own thread) ----
  absl::Status ParseSideMessage(const uint8_t* p, size_t n) {
    side_in_.Clear();
    BeforeSideRead(side_in_);
    google::protobuf::io::CodedInputStream in(p, static_cast<int>(n));
    if (side_in_.MergeFromCodedStream(&in) && in.ConsumedEntireMessage()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("a message of ", n, " bytes does not parse as ",
                                                   side_in_.GetTypeName()));
  }
  void HandleSideMessage() {
    if (IsOpen()) OnMessage(side_in_, Path::kSideChannel);
    side_in_.Clear();
  }
  void SideChannelEnded(const absl::Status& why) {
    if (!why.ok()) {
      LogWarning("%s: shared-memory channel: %s; the stream ends", opt_.name.c_str(),
                 std::string(why.message()).c_str());
    }
    End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                     why.ok() ? std::string("shared-memory channel closed")
                              : absl::StrCat("shared-memory channel: ", why.message())));
  }

  std::mutex own_mu_;  // the mutex when the user gives none
  std::mutex& mu_;
  const Options opt_;
  grpc::ByteBuffer rbuf_;  // the read buffer
  In in_;                  // rbuf_ parsed
  In side_in_;             // the side channel reader's message
  grpc::ByteBuffer wbuf_;  // guarded by mu_: queue_.front() serialized, while writing_
  Phase phase_ = Phase::kOpen;                     // guarded by mu_
  ReadState read_ = ReadState::kStopped;           // guarded by mu_
  std::list<Unwritten> queue_;                     // guarded by mu_: the front is written first
  size_t unwritten_bytes_ = 0;                     // guarded by mu_
  bool writing_ = false;                           // guarded by mu_: a write is outstanding
  std::optional<grpc::Status> finish_when_idle_;   // guarded by mu_
  std::optional<grpc::Status> end_status_;         // guarded by mu_: End's
  grpc::Status finished_with_;                     // guarded by mu_
  std::unique_ptr<ShmSideChannel> side_;           // guarded by mu_
};

}  // namespace exl3::svc

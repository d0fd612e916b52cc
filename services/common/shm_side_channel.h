// A shared-memory channel (services/common/shm_channel.h) serving one stream as its side channel
// (services/common/bidi_stream.h): the one reader loop, on a thread of the side channel's own,
// and the write of one protobuf message into the channel.
//
//   ShmSideChannel side(channel, {.parse = ..., .handle = ..., .ended = ...});  // reader starts
//   side.TryWrite(msg);  // false: closed, no room now or too large -> send it on the stream
//   side.Close();        // wakes the reader: `ended` runs, then the thread returns
//   side.Join();
//
// The reader parses each message inside the channel's read (the bytes are valid only there) and
// handles it after the read returned, so the ring has the message's space back while the message
// is handled. A message that does not parse closes the channel. Writes are the caller's to
// serialise (the stream's mutex): the channel has one writer per direction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"
#include "services/common/shm_channel.h"

namespace exl3::svc {

class ShmSideChannel {
 public:
  struct Reader {
    // Parses one message (inside the read): OK, or INVALID_ARGUMENT saying what does not parse.
    std::function<absl::Status(const uint8_t* data, size_t size)> parse;
    // Handles the message just parsed (after the read).
    std::function<void()> handle;
    // Runs once, last, on the reader thread: OK when a side closed the channel, else what broke
    // it (a malformed record, a message that does not parse).
    std::function<void(const absl::Status& why)> ended;
  };

  // Starts the reader thread on `channel`.
  ShmSideChannel(std::shared_ptr<ShmChannel> channel, Reader reader);
  ~ShmSideChannel();  // Close, then Join
  ShmSideChannel(const ShmSideChannel&) = delete;
  ShmSideChannel& operator=(const ShmSideChannel&) = delete;

  // Writes `m` into the channel and wakes the peer's reader; false (nothing written) when the
  // channel is closed, has no room for it now, or `m` is larger than the channel takes.
  bool TryWrite(const google::protobuf::MessageLite& m);
  // Closes both directions (the peer's reader wakes too). Idempotent; never blocks.
  void Close();
  // Waits for the reader thread to return. Called on the reader thread itself (which then is
  // returning), it lets the thread go instead.
  void Join();
  bool closed() const { return channel_->closed(); }
  size_t ring_bytes() const { return channel_->ring_bytes(); }

 private:
  void Run();

  const std::shared_ptr<ShmChannel> channel_;
  const Reader reader_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace exl3::svc

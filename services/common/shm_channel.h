// A same-host message channel in shared memory: two single-producer single-consumer byte rings
// (one per direction) in one POSIX shared-memory object, with futex wake-ups after a bounded spin.
// The router uses it for its Forward stream to a worker on the same host: a message through it
// costs two memcpy-sized writes and, while the peer is spinning, no system call at all, where a
// loopback gRPC message costs a TCP round through the kernel and a thread wake-up on each side.
//
//   // creator (router): makes the object, offers (name, nonce) to the peer over gRPC
//   auto ch = ShmChannel::Create(8 << 20, /*spin_us=*/50);
//   // peer (worker): opens it; fails unless the object exists here with that nonce
//   auto peer = ShmChannel::Attach((*ch)->name(), (*ch)->nonce(), 50);
//   (*ch)->Unlink();                      // once the peer has it open (or refused)
//   bool sent = (*ch)->TryWrite(n, [&](uint8_t* dst) { msg.SerializeWithCachedSizesToArray(dst); });
//   // false: no room now or larger than the ring allows -> the caller sends it another way
//   (*peer)->Read([&](const uint8_t* p, size_t n) { ... });  // waits; false once closed
//   (*ch)->Close();                       // either side: wakes both readers, later reads fail
//
// Each ring has one writer and one reader at a time; callers serialise their own writes (and
// reads). Records are 8-byte aligned and never wrap (a skip record fills the tail of the ring),
// so both sides serialise into and parse from the mapping in place. Everything read from the
// mapping is checked: a peer that writes garbage closes the channel, it cannot crash the reader.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3::svc {

class ShmChannel {
 public:
  // Creates a fresh object "/exl3-<pid>-<random>" (mode 0600) with two rings of `ring_bytes`
  // (rounded up to 4 KiB; at least 64 KiB). The creator writes ring 0 and reads ring 1.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Create(size_t ring_bytes, int spin_us);
  // Opens the object `name` made by Create on this host; fails (NOT_FOUND, PERMISSION_DENIED,
  // FAILED_PRECONDITION) unless it exists with a valid header and `nonce`. Writes ring 1, reads 0.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Attach(const std::string& name, uint64_t nonce,
                                                            int spin_us);
  ~ShmChannel();  // Close, unmap (and Unlink when the creator had not)

  const std::string& name() const { return name_; }
  uint64_t nonce() const { return nonce_; }
  size_t ring_bytes() const { return ring_bytes_; }
  // The largest message TryWrite takes (a quarter of the ring).
  size_t max_message_bytes() const { return ring_bytes_ / 4; }

  // Removes the name (the mapping stays valid for both sides). Either side; idempotent. The peer
  // calls it as soon as it has attached, so a creator that dies right after its offer leaves
  // nothing behind in /dev/shm; the creator calls it too once answered (the peer may have refused).
  void Unlink();

  // Writes one message of `len` bytes, filled in place by `fill`, and wakes the reader if it
  // sleeps. Returns false (writing nothing) when the message is over max_message_bytes(), the ring
  // has no room for it now, or the channel is closed.
  bool TryWrite(size_t len, const std::function<void(uint8_t*)>& fill);

  // Waits for the next message and passes it (valid only during the call) to `consume`. Spins
  // while this side read or wrote a message within spin_us (the first 10 µs busy, then yielding
  // the core to anything else runnable), then sleeps on a futex; a write on this side wakes it to
  // spin for the answer. Returns false once the channel is closed (by either side) or
  // the peer wrote a malformed record (then the channel is closed and error() says why).
  bool Read(const std::function<void(const uint8_t*, size_t)>& consume);

  // Closes both directions and wakes both readers (in either process). Idempotent.
  void Close();
  bool closed() const;
  absl::Status error() const;

 private:
  struct Segment;
  struct Ring;
  ShmChannel() = default;
  Ring ring(int i) const;

  std::string name_;
  uint64_t nonce_ = 0;
  size_t ring_bytes_ = 0;
  int spin_us_ = 0;
  bool creator_ = false;
  bool unlinked_ = false;
  int out_ = 0, in_ = 1;  // ring indices written / read by this side
  void* base_ = nullptr;
  size_t map_bytes_ = 0;
  Segment* seg_ = nullptr;
  absl::Status error_;  // written by the reader only, before it closes the channel
  std::atomic<int64_t> last_write_ns_{0};  // steady clock of this side's last TryWrite
};

// This host's identity for deciding whether a peer may share memory with us: the kernel's boot id
// ("" when unreadable). Containers on one host share it but not always /dev/shm: Attach then fails
// and the caller keeps using gRPC.
std::string HostId();

}  // namespace exl3::svc

#include "services/common/shm_channel.h"

#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <chrono>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EXL3_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define EXL3_CPU_RELAX() asm volatile("yield")
#else
#define EXL3_CPU_RELAX() ((void)0)
#endif

namespace exl3::svc {

namespace {

constexpr uint64_t kMagic = 0x314c4e48434d4853ull;  // "SHMCHNL1"
constexpr uint32_t kVersion = 1;
constexpr uint32_t kSkip = 0xffffffffu;  // record header: the rest of the ring is unused
constexpr size_t kRecordHeader = 8;      // u32 length, u32 reserved

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Shared (not FUTEX_PRIVATE): the waiter and the waker are in different processes.
void FutexWait(std::atomic<uint32_t>* addr, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

// The state of one ring, each hot word on its own cache line.
struct RingState {
  alignas(64) std::atomic<uint64_t> head;  // bytes ever written (the writer's)
  alignas(64) std::atomic<uint64_t> tail;  // bytes ever consumed (the reader's)
  alignas(64) std::atomic<uint32_t> seq;   // futex word: bumped when a sleeping reader is woken
  std::atomic<uint32_t> waiting;           // the reader is asleep or about to be
};

struct ShmChannel::Segment {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t nonce;
  uint64_t ring_bytes;
  alignas(64) std::atomic<uint32_t> closed;
  RingState rings[2];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

struct ShmChannel::Ring {
  RingState* st;
  uint8_t* data;
};

ShmChannel::Ring ShmChannel::ring(int i) const {
  const size_t header = RoundUp(sizeof(Segment), 4096);
  return Ring{&seg_->rings[i], static_cast<uint8_t*>(base_) + header + i * ring_bytes_};
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Create(size_t ring_bytes, int spin_us) {
  std::unique_ptr<ShmChannel> c(new ShmChannel());
  c->ring_bytes_ = RoundUp(std::max<size_t>(ring_bytes, 64 << 10), 4096);
  c->spin_us_ = std::max(0, spin_us);
  c->creator_ = true;
  c->out_ = 0;
  c->in_ = 1;
  std::random_device rd;
  c->nonce_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
              static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  c->name_ = absl::StrCat("/exl3-", getpid(), "-", c->nonce_ & 0xffffffffffull);
  const int fd = shm_open(c->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", c->name_, ": ", std::strerror(errno)));
  }
  c->map_bytes_ = RoundUp(sizeof(Segment), 4096) + 2 * c->ring_bytes_;
  // Allocated now, not on first touch: a full /dev/shm (a container's 64 MB default) must fail
  // here, not kill the process with SIGBUS when a ring page is first written.
  if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(c->map_bytes_)); e != 0) {
    close(fd);
    shm_unlink(c->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("allocating ", c->map_bytes_,
                                                     " bytes of shared memory for ", c->name_,
                                                     ": ", std::strerror(e), " (is /dev/shm full?)"));
  }
  if (ftruncate(fd, static_cast<off_t>(c->map_bytes_)) != 0) {
    const int e = errno;
    close(fd);
    shm_unlink(c->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("sizing shared memory ", c->name_, " to ",
                                                     c->map_bytes_, " bytes: ", std::strerror(e)));
  }
  // Populated now: a message's first pass through a ring page otherwise takes a page fault per
  // 4 KiB (a 16 MB message 4096 of them, milliseconds) until the ring has wrapped once.
  void* p = mmap(nullptr, c->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(c->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mapping ", c->name_, ": ", std::strerror(errno)));
  }
  c->base_ = p;
  c->seg_ = new (p) Segment();
  c->seg_->version = kVersion;
  c->seg_->nonce = c->nonce_;
  c->seg_->ring_bytes = c->ring_bytes_;
  c->seg_->closed.store(0);
  for (RingState& r : c->seg_->rings) {
    r.head.store(0);
    r.tail.store(0);
    r.seq.store(0);
    r.waiting.store(0);
  }
  // The magic last: a peer that attaches sees either no magic or a complete header.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  c->seg_->magic = kMagic;
  return c;
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Attach(const std::string& name, uint64_t nonce,
                                                               int spin_us) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat("bad shared-memory name '", name, "'"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int e = errno;
    const std::string why = absl::StrCat("shm_open ", name, ": ", std::strerror(e),
                                         " (not on the same host, or not the same /dev/shm)");
    return e == EACCES ? absl::PermissionDeniedError(why) : absl::NotFoundError(why);
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || static_cast<size_t>(sb.st_size) < RoundUp(sizeof(Segment), 4096)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat("shared memory ", name, " is too small"));
  }
  std::unique_ptr<ShmChannel> c(new ShmChannel());
  c->map_bytes_ = static_cast<size_t>(sb.st_size);
  void* p = mmap(nullptr, c->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping ", name, ": ", std::strerror(errno)));
  }
  c->base_ = p;
  c->seg_ = static_cast<Segment*>(p);
  c->name_ = name;
  c->spin_us_ = std::max(0, spin_us);
  c->out_ = 1;
  c->in_ = 0;
  const uint64_t rb = c->seg_->ring_bytes;
  if (c->seg_->magic != kMagic || c->seg_->version != kVersion || c->seg_->nonce != nonce ||
      rb < (64 << 10) || rb % 4096 != 0 ||
      c->map_bytes_ != RoundUp(sizeof(Segment), 4096) + 2 * rb) {
    c->seg_ = nullptr;  // not ours: the destructor must not close it, only unmap it
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory ", name, " is not the offered channel (magic, version, nonce or size differ)"));
  }
  c->ring_bytes_ = rb;
  c->nonce_ = nonce;
  return c;
}

ShmChannel::~ShmChannel() {
  if (seg_ != nullptr) Close();
  if (creator_) Unlink();
  if (base_ != nullptr) munmap(base_, map_bytes_);
}

void ShmChannel::Unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(name_.c_str());
}

bool ShmChannel::closed() const { return seg_->closed.load(std::memory_order_acquire) != 0; }

absl::Status ShmChannel::error() const { return error_; }

void ShmChannel::Close() {
  seg_->closed.store(1, std::memory_order_seq_cst);
  for (RingState& r : seg_->rings) {
    r.seq.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&r.seq);
  }
}

bool ShmChannel::TryWrite(size_t len, const std::function<void(uint8_t*)>& fill) {
  if (len > max_message_bytes() || closed()) return false;
  Ring r = ring(out_);
  const size_t need = kRecordHeader + RoundUp(len, 8);
  const uint64_t head = r.st->head.load(std::memory_order_relaxed);
  const uint64_t tail = r.st->tail.load(std::memory_order_acquire);
  const size_t pos = head % ring_bytes_;
  const size_t contiguous = ring_bytes_ - pos;
  const size_t skip = need > contiguous ? contiguous : 0;
  if (head + skip + need - tail > ring_bytes_) return false;  // no room now
  uint64_t at = head;
  if (skip > 0) {
    const uint32_t marker[2] = {kSkip, 0};
    std::memcpy(r.data + pos, marker, sizeof(marker));
    at += skip;
  }
  uint8_t* rec = r.data + at % ring_bytes_;
  const uint32_t header[2] = {static_cast<uint32_t>(len), 0};
  std::memcpy(rec, header, sizeof(header));
  fill(rec + kRecordHeader);
  r.st->head.store(at + need, std::memory_order_release);
  // Pairs with the reader's fence between raising `waiting` and re-reading `head`: either it sees
  // the new head or we see it waiting.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (r.st->waiting.load(std::memory_order_relaxed) != 0) {
    r.st->seq.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&r.st->seq);
  }
  // An answer to what we just wrote is likely soon: our own reader spins for it from now on, and
  // if it sleeps it is woken to do so (in parallel with the peer's work on our message).
  last_write_ns_.store(NowNs(), std::memory_order_relaxed);
  RingState& in = seg_->rings[in_];
  if (in.waiting.load(std::memory_order_relaxed) != 0) {
    in.seq.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&in.seq);
  }
  return true;
}

bool ShmChannel::Read(const std::function<void(const uint8_t*, size_t)>& consume) {
  Ring r = ring(in_);
  const int64_t spin_ns = static_cast<int64_t>(spin_us_) * 1000;
  int64_t spin_from = 0;
  bool spinning = false;
  for (;;) {
    if (closed()) return false;
    const uint64_t tail = r.st->tail.load(std::memory_order_relaxed);
    const uint64_t head = r.st->head.load(std::memory_order_acquire);
    if (head != tail) {
      const size_t pos = tail % ring_bytes_;
      const uint64_t avail = head - tail;
      uint32_t header[2];
      std::memcpy(header, r.data + pos, sizeof(header));
      const size_t contiguous = ring_bytes_ - pos;
      if (avail > ring_bytes_ || avail < kRecordHeader || pos % 8 != 0) {
        error_ = absl::DataLossError("shared-memory ring positions are inconsistent");
        Close();
        return false;
      }
      if (header[0] == kSkip) {
        if (avail < contiguous) {
          error_ = absl::DataLossError("shared-memory skip record past the written data");
          Close();
          return false;
        }
        r.st->tail.store(tail + contiguous, std::memory_order_release);
        continue;
      }
      const size_t len = header[0];
      const size_t rec = kRecordHeader + RoundUp(len, 8);
      if (rec > avail || rec > contiguous || len > max_message_bytes()) {
        error_ = absl::DataLossError(absl::StrCat("shared-memory record of ", len,
                                                  " bytes does not fit the written data"));
        Close();
        return false;
      }
      consume(r.data + pos + kRecordHeader, len);
      r.st->tail.store(tail + rec, std::memory_order_release);
      return true;
    }
    // Empty: spin while anything moved in either direction within spin_us (an answer to what we
    // sent, or the next request after our answer, is often only µs away), then sleep.
    if (!spinning) {
      spinning = true;
      spin_from = NowNs();
    }
    const int64_t now = NowNs();
    const int64_t since = now - std::max(spin_from, last_write_ns_.load(std::memory_order_relaxed));
    if (since < spin_ns) {
      if (since < 10000) {
        for (int i = 0; i < 16; ++i) EXL3_CPU_RELAX();
      } else {
        sched_yield();  // on a busy machine, let the threads that will answer us run
      }
      continue;
    }
    const uint32_t seq = r.st->seq.load(std::memory_order_acquire);
    r.st->waiting.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (r.st->head.load(std::memory_order_acquire) == tail && !closed()) {
      // The timeout only bounds how long a lost wake-up (none is expected) could stall us.
      FutexWait(&r.st->seq, seq, 100);
    }
    r.st->waiting.store(0, std::memory_order_relaxed);
    spinning = false;
  }
}

std::string HostId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

}  // namespace exl3::svc

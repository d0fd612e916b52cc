#include "services/common/shm_channel.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::svc {
namespace {

std::string Payload(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

bool Write(ShmChannel& ch, const std::string& m) {
  return ch.TryWrite(m.size(), [&](uint8_t* dst) { std::memcpy(dst, m.data(), m.size()); });
}

bool ReadOne(ShmChannel& ch, std::string* out) {
  return ch.Read([&](const uint8_t* p, size_t n) { out->assign(reinterpret_cast<const char*>(p), n); });
}

TEST(ShmChannel, BothDirectionsInOrderAcrossWrapAround) {
  auto a = ShmChannel::Create(64 << 10, 20);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = ShmChannel::Attach((*a)->name(), (*a)->nonce(), 20);
  ASSERT_TRUE(b.ok()) << b.status();
  (*a)->Unlink();
  // Sizes that do not divide the ring, so records wrap (skip records) many times; zero-length too.
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const std::string m = Payload(rng() % ((*a)->max_message_bytes() + 1), i);
    ASSERT_TRUE(Write(**a, m)) << i;
    std::string got;
    ASSERT_TRUE(ReadOne(**b, &got));
    ASSERT_EQ(got, m) << i;
    const std::string r = Payload(rng() % 3000, i + 1);
    ASSERT_TRUE(Write(**b, r));
    ASSERT_TRUE(ReadOne(**a, &got));
    ASSERT_EQ(got, r);
  }
}

TEST(ShmChannel, FullRingAndOversizedMessagesAreRefusedNotBlocked) {
  auto a = ShmChannel::Create(64 << 10, 0);
  ASSERT_TRUE(a.ok());
  auto b = ShmChannel::Attach((*a)->name(), (*a)->nonce(), 0);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(Write(**a, std::string((*a)->max_message_bytes() + 1, 'x')));
  int written = 0;
  while (Write(**a, Payload(1000, written))) ++written;
  EXPECT_GT(written, 50);
  EXPECT_LT(written, 66);  // 64 KiB of 1008-byte records
  for (int i = 0; i < written; ++i) {
    std::string got;
    ASSERT_TRUE(ReadOne(**b, &got));
    ASSERT_EQ(got, Payload(1000, i));
  }
  EXPECT_TRUE(Write(**a, "room again"));
}

TEST(ShmChannel, AttachChecksNameAndNonce) {
  auto a = ShmChannel::Create(64 << 10, 0);
  ASSERT_TRUE(a.ok());
  auto wrong = ShmChannel::Attach((*a)->name(), (*a)->nonce() + 1, 0);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_FALSE((*a)->closed());  // a refused attach leaves the creator's channel alone
  EXPECT_EQ(ShmChannel::Attach("/exl3-no-such-channel", 1, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ShmChannel::Attach("../etc/passwd", 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  (*a)->Unlink();
  EXPECT_EQ(ShmChannel::Attach((*a)->name(), (*a)->nonce(), 0).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ShmChannel, CloseWakesASleepingReader) {
  auto a = ShmChannel::Create(64 << 10, 0);
  ASSERT_TRUE(a.ok());
  auto b = ShmChannel::Attach((*a)->name(), (*a)->nonce(), 0);
  ASSERT_TRUE(b.ok());
  std::thread reader([&] {
    std::string got;
    EXPECT_FALSE(ReadOne(**b, &got));  // returns only when closed
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t0 = std::chrono::steady_clock::now();
  (*a)->Close();
  reader.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_FALSE(Write(**b, "after close"));
}

TEST(ShmChannel, CorruptRecordClosesTheChannelWithAnError) {
  auto a = ShmChannel::Create(64 << 10, 0);
  ASSERT_TRUE(a.ok());
  auto b = ShmChannel::Attach((*a)->name(), (*a)->nonce(), 0);
  ASSERT_TRUE(b.ok());
  // A record whose length claims more than was written.
  ASSERT_TRUE((*a)->TryWrite(16, [](uint8_t* dst) {
    const uint32_t bogus = 1u << 30;
    std::memcpy(dst - 8, &bogus, 4);  // overwrite the record header the channel wrote
  }));
  std::string got;
  EXPECT_FALSE(ReadOne(**b, &got));
  EXPECT_EQ((*b)->error().code(), absl::StatusCode::kDataLoss) << (*b)->error();
  EXPECT_TRUE((*a)->closed());
}

// Two processes: ping-pong with the reader spinning, then with it sleeping (futex wake-ups);
// prints the round-trip medians (not asserted: this is a functional test on a shared machine).
TEST(ShmChannel, PingPongAcrossProcesses) {
  for (int spin_us : {200, 0}) {
    auto a = ShmChannel::Create(1 << 20, spin_us);
    ASSERT_TRUE(a.ok());
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto b = ShmChannel::Attach((*a)->name(), (*a)->nonce(), spin_us);
      if (!b.ok()) _exit(2);
      std::string m;
      while (ReadOne(**b, &m)) {
        if (!Write(**b, m)) _exit(3);
      }
      _exit(0);
    }
    std::vector<double> us;
    const std::string msg = Payload(4096, 3);
    for (int i = 0; i < 400; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_TRUE(Write(**a, msg));
      std::string got;
      ASSERT_TRUE(ReadOne(**a, &got));
      ASSERT_EQ(got, msg);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    (*a)->Close();
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    std::sort(us.begin(), us.end());
    std::printf("shm ping-pong 4 KiB, spin %d us: p50 %.1f us, p90 %.1f us\n", spin_us,
                us[us.size() / 2], us[us.size() * 9 / 10]);
  }
}

}  // namespace
}  // namespace exl3::svc

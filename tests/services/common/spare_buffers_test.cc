// services/common/spare_buffers.h: what is kept, what is handed out, the bounds.
#include "services/common/spare_buffers.h"

#include <string>

#include "gtest/gtest.h"

namespace exl3::svc {
namespace {

TEST(SpareBuffersTest, HandsBackTheLargestKeptBufferEmpty) {
  SpareBuffers s;
  EXPECT_EQ(s.Take().capacity(), std::string().capacity());  // none kept: a fresh one
  std::string a(100u << 10, 'a'), b(300u << 10, 'b');
  const size_t cap_b = b.capacity();
  s.Give(std::move(a));
  s.Give(std::move(b));
  EXPECT_EQ(s.kept(), 2u);
  std::string t = s.Take();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.capacity(), cap_b);
  EXPECT_EQ(s.kept(), 1u);
}

TEST(SpareBuffersTest, KeepsOnlyBuffersWithinTheBounds) {
  SpareBuffers s;
  s.Give(std::string(16, 'x'));                                      // under kMinBufferBytes
  s.Give(std::string(SpareBuffers::kMaxBufferBytes + 4096, 'x'));    // over kMaxBufferBytes
  EXPECT_EQ(s.kept(), 0u);
  for (size_t i = 0; i < SpareBuffers::kMaxBuffers + 2; ++i) {
    s.Give(std::string(SpareBuffers::kMinBufferBytes, 'x'));
  }
  EXPECT_EQ(s.kept(), SpareBuffers::kMaxBuffers);
}

}  // namespace
}  // namespace exl3::svc

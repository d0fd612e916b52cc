#include "services/common/wire.h"

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "services/common/flags.h"
#include "services/common/server.h"
#include "services/common/status.h"

namespace exl3::svc {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

TEST(Wire, EveryHalfValueDecodesExactly) {
  // All 65536 bit patterns (the fast F16C path where the CPU has it, the scalar one otherwise)
  // against the reference conversion; an odd count so the scalar tail runs too.
  pb::Tensor t;
  t.set_dtype(pb::DTYPE_FP16);
  t.add_shape(65537);
  std::string& d = *t.mutable_data();
  for (uint32_t i = 0; i <= 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    d.append(reinterpret_cast<const char*>(&h), 2);
  }
  std::vector<float> out(65537);
  ASSERT_TRUE(TensorToFloat(t, "x", /*require_finite=*/false, out.data()).ok());
  for (uint32_t i = 0; i <= 65536; ++i) {
    const float ref = HalfBitsToFloat(static_cast<uint16_t>(i));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(out[i])) << i;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(ref)) << i;
    }
  }
}

TEST(Wire, RoundTripAllDtypes) {
  const std::vector<float> x = Random(6 * 32, 1);
  for (pb::DType dt : {pb::DTYPE_FP32, pb::DTYPE_FP16, pb::DTYPE_BF16}) {
    pb::Tensor t;
    EncodeTensor(x.data(), {6, 32}, dt, &t);
    ASSERT_EQ(t.data().size(), x.size() * WireDTypeSize(dt));
    std::vector<float> back;
    int64_t rows = 0;
    ASSERT_TRUE(DecodeMatrix(t, "hidden", 32, &back, &rows).ok());
    EXPECT_EQ(rows, 6);
    const float tol = dt == pb::DTYPE_FP32 ? 0.0f : dt == pb::DTYPE_FP16 ? 1.0f / 1024 : 1.0f / 128;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_LE(std::fabs(back[i] - x[i]), tol * std::fabs(x[i]) + 1e-7f) << WireDTypeName(dt) << " " << i;
    }
  }
}

TEST(Wire, EncodeTensorReplacesWhatTheTensorHeld) {
  // The in-process executor encodes into a kept buffer (services/common/spare_buffers.h): stale
  // bytes, shape and dtype of another size must not survive, in any dtype.
  const std::vector<float> x = Random(3 * 8, 2);
  for (pb::DType dt : {pb::DTYPE_FP32, pb::DTYPE_FP16, pb::DTYPE_BF16}) {
    pb::Tensor fresh, reused;
    EncodeTensor(x.data(), {3, 8}, dt, &fresh);
    reused.set_dtype(pb::DTYPE_BF16);
    reused.add_shape(99);
    reused.mutable_data()->assign(4096, '\x55');
    EncodeTensor(x.data(), {3, 8}, dt, &reused);
    EXPECT_EQ(reused.SerializeAsString(), fresh.SerializeAsString()) << WireDTypeName(dt);
  }
}

TEST(Wire, CheckFiniteFindsWhatTensorToFloatFindsWithTheSameMessage) {
  // Every dtype, the bad value at each end and in the middle (row 2 of [3, 40]: past a vector
  // width), as +Inf, -Inf and NaN.
  const std::vector<float> x = Random(3 * 40, 7);
  const float bad[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (pb::DType dt : {pb::DTYPE_FP32, pb::DTYPE_FP16, pb::DTYPE_BF16}) {
    pb::Tensor good;
    EncodeTensor(x.data(), {3, 40}, dt, &good);
    EXPECT_TRUE(CheckFinite(good, "hidden").ok()) << WireDTypeName(dt);
    for (size_t at : {size_t{0}, size_t{97}, x.size() - 1}) {
      for (float v : bad) {
        std::vector<float> y = x;
        y[at] = v;
        pb::Tensor t;
        EncodeTensor(y.data(), {3, 40}, dt, &t);
        std::vector<float> out(y.size());
        const absl::Status want = TensorToFloat(t, "hidden", /*require_finite=*/true, out.data());
        const absl::Status got = CheckFinite(t, "hidden");
        ASSERT_FALSE(want.ok());
        EXPECT_EQ(got, want) << WireDTypeName(dt) << " at " << at;
      }
    }
  }
  // The largest finite values pass.
  const float big[2] = {65504.0f, -3.0e38f};
  pb::Tensor t16, t32;
  EncodeTensor(big, {1}, pb::DTYPE_FP16, &t16);
  EncodeTensor(big + 1, {1}, pb::DTYPE_FP32, &t32);
  EXPECT_TRUE(CheckFinite(t16, "x").ok());
  EXPECT_TRUE(CheckFinite(t32, "x").ok());
}

TEST(Wire, WireToFloatConvertsPartsOfATensor) {
  const std::vector<float> x = Random(2 * 24, 3);
  for (pb::DType dt : {pb::DTYPE_FP32, pb::DTYPE_FP16, pb::DTYPE_BF16}) {
    pb::Tensor t;
    EncodeTensor(x.data(), {2, 24}, dt, &t);
    std::vector<float> all(x.size()), row(24);
    ASSERT_TRUE(TensorToFloat(t, "t", false, all.data()).ok());
    WireToFloat(dt, t.data().data() + 24 * WireDTypeSize(dt), 24, row.data());
    for (int i = 0; i < 24; ++i) EXPECT_EQ(row[i], all[24 + i]) << WireDTypeName(dt) << " " << i;
  }
}

TEST(Wire, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to even -> 1.0.
  const float x[2] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256};
  pb::Tensor t;
  EncodeTensor(x, {2}, pb::DTYPE_BF16, &t);
  float back[2];
  ASSERT_TRUE(TensorToFloat(t, "t", true, back).ok());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f + 4.0f / 256);
}

TEST(Wire, RejectsMalformedTensorsNamingTheProblem) {
  const std::vector<float> x = Random(4 * 8, 2);
  pb::Tensor good;
  EncodeTensor(x.data(), {4, 8}, pb::DTYPE_FP32, &good);
  std::vector<float> out;
  int64_t rows;

  pb::Tensor t = good;
  t.set_dtype(static_cast<pb::DType>(9));
  absl::Status s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype unknown(9)"), std::string::npos) << s;

  t = good;
  t.set_dtype(pb::DTYPE_UNSPECIFIED);
  EXPECT_EQ(DecodeMatrix(t, "hidden", 8, &out, &rows).code(), absl::StatusCode::kInvalidArgument);

  t = good;
  t.clear_shape();
  t.add_shape(32);
  s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;

  t = good;
  t.set_shape(1, 16);
  s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_NE(s.message().find("dim 1 is 16, must be 8"), std::string::npos) << s;

  t = good;
  t.set_shape(0, 0);
  s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_NE(s.message().find("must be >= 1"), std::string::npos) << s;

  t = good;
  t.mutable_data()->resize(t.data().size() - 2);
  s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_NE(s.message().find("data has 126 bytes"), std::string::npos) << s;

  t = good;
  t.set_shape(0, int64_t{1} << 62);
  s = DecodeMatrix(t, "hidden", 8, &out, &rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(Wire, RejectsNonFiniteWithPosition) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = Random(3 * 8, 3);
    x[2 * 8 + 5] = bad;
    for (pb::DType dt : {pb::DTYPE_FP32, pb::DTYPE_FP16, pb::DTYPE_BF16}) {
      pb::Tensor t;
      EncodeTensor(x.data(), {3, 8}, dt, &t);
      std::vector<float> out;
      int64_t rows;
      absl::Status s = DecodeMatrix(t, "hidden", 8, &out, &rows);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("at [2, 5]"), std::string::npos) << s;
    }
  }
}

// FirstNonFinite scans in blocks of 64 (services/common/wire.cc): every position of lengths
// around the block size, in the blocks and in the tail, is found, the first of two too.
TEST(Wire, FirstNonFiniteFindsEveryPositionAroundTheBlocks) {
  for (size_t n : {0, 1, 63, 64, 65, 127, 128, 200}) {
    std::vector<float> x = Random(n, 4);
    EXPECT_EQ(FirstNonFinite(x.data(), n), -1) << n;
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> y = x;
      y[i] = std::numeric_limits<float>::quiet_NaN();
      if (i + 70 < n) y[i + 70] = std::numeric_limits<float>::infinity();
      EXPECT_EQ(FirstNonFinite(y.data(), n), static_cast<int64_t>(i)) << n << " " << i;
    }
  }
}

TEST(Wire, OutputDType) {
  pb::DType d;
  EXPECT_TRUE(ResolveOutputDType(0, "output_dtype", &d).ok());
  EXPECT_EQ(d, pb::DTYPE_FP32);
  EXPECT_TRUE(ResolveOutputDType(pb::DTYPE_BF16, "output_dtype", &d).ok());
  EXPECT_EQ(d, pb::DTYPE_BF16);
  EXPECT_EQ(ResolveOutputDType(5, "output_dtype", &d).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Status, OneMappingBothWays) {
  for (int c = 0; c <= 16; ++c) {
    const absl::Status a = c == 0 ? absl::OkStatus()
                                  : absl::Status(static_cast<absl::StatusCode>(c), "msg");
    const grpc::Status g = ToGrpcStatus(a);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(FromGrpcStatus(g), a);
    pb::RequestStatus rs;
    SetRequestStatus(a, &rs);
    EXPECT_EQ(static_cast<int>(rs.code()), c);
    EXPECT_EQ(FromRequestStatus(rs), a);
  }
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(AllStatusCodeNames().size(), 17u);
}

TEST(Status, RetryableCodesAreTheWorkersRefusals) {
  int retryable = 0;
  for (int c = 0; c <= 16; ++c) retryable += IsRetryable(static_cast<absl::StatusCode>(c)) ? 1 : 0;
  EXPECT_EQ(retryable, 4);
  for (absl::StatusCode c : {absl::StatusCode::kUnavailable, absl::StatusCode::kResourceExhausted,
                             absl::StatusCode::kCancelled, absl::StatusCode::kAborted}) {
    EXPECT_TRUE(IsRetryable(c)) << StatusCodeName(c);
  }
  // The request's own outcome: the same answer from any worker.
  EXPECT_FALSE(IsRetryable(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(IsRetryable(absl::StatusCode::kDeadlineExceeded));
}

TEST(Wire, RequestTimeoutIsClampedToAYear) {
  EXPECT_EQ(RequestTimeout(1500).count(), 1500);
  const int64_t year_us = 365ll * 24 * 3600 * 1000000;
  for (uint64_t t : {uint64_t{1} << 60, ~uint64_t{0}}) {
    EXPECT_EQ(RequestTimeout(t).count(), year_us);
    // Added to now, it stays in the future (an overflow wrapped into the past).
    EXPECT_GT(std::chrono::steady_clock::now() + RequestTimeout(t), std::chrono::steady_clock::now());
  }
}

TEST(Server, LoopbackDetection) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:50061"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:1"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:5"));
  EXPECT_TRUE(IsLoopbackAddress("unix:/tmp/x.sock"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50061"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50061"));
  EXPECT_FALSE(IsLoopbackAddress("10.1.2.3:50061"));
}

TEST(Flags, DashesBecomeUnderscoresInNamesOnly) {
  const char* argv[] = {"prog", "--max-queue=3", "--tls-cert", "a-b.pem", "-x", "--", "--keep-me"};
  std::vector<char*> args = DashesToUnderscores(7, const_cast<char**>(argv));
  ASSERT_EQ(args.size(), 7u);
  EXPECT_STREQ(args[1], "--max_queue=3");
  EXPECT_STREQ(args[2], "--tls_cert");
  EXPECT_STREQ(args[3], "a-b.pem");
  EXPECT_STREQ(args[6], "--keep-me");
}

}  // namespace
}  // namespace exl3::svc

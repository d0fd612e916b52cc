#include "services/common/status.h"

namespace exl3::svc {
namespace {

constexpr int kMaxCode = 16;  // UNAUTHENTICATED

int ClampCode(int c) { return (c < 0 || c > kMaxCode) ? 2 /* UNKNOWN */ : c; }

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(ClampCode(static_cast<int>(s.code()))),
                      std::string(s.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(ClampCode(static_cast<int>(s.error_code()))),
                      s.error_message());
}

void SetRequestStatus(const absl::Status& s, ::exl3serve::v1::RequestStatus* out) {
  out->set_code(static_cast<::exl3serve::v1::StatusCode>(ClampCode(static_cast<int>(s.code()))));
  out->set_message(std::string(s.message()));
}

absl::Status FromRequestStatus(const ::exl3serve::v1::RequestStatus& s) {
  if (s.code() == ::exl3serve::v1::OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(ClampCode(s.code())), s.message());
}

bool IsRetryable(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

std::string StatusCodeName(absl::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(ClampCode(static_cast<int>(code))));
}

std::vector<std::string> AllStatusCodeNames() {
  std::vector<std::string> names;
  for (int c = 0; c <= kMaxCode; ++c) names.push_back(StatusCodeName(static_cast<absl::StatusCode>(c)));
  return names;
}

const char* CancelReasonName(int reason) {
  switch (reason) {
    case ::exl3serve::v1::CANCEL_REASON_CLIENT: return "client";
    case ::exl3serve::v1::CANCEL_REASON_DEADLINE: return "deadline";
    case ::exl3serve::v1::CANCEL_REASON_STREAM_CLOSED: return "stream_closed";
    case ::exl3serve::v1::CANCEL_REASON_FAILED: return "failed";
    default: return "unspecified";
  }
}

std::vector<int> AllCancelReasons() {
  return {::exl3serve::v1::CANCEL_REASON_CLIENT, ::exl3serve::v1::CANCEL_REASON_DEADLINE,
          ::exl3serve::v1::CANCEL_REASON_STREAM_CLOSED, ::exl3serve::v1::CANCEL_REASON_FAILED};
}

}  // namespace exl3::svc

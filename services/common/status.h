// The one place where status codes cross between absl::Status (inside the libraries),
// grpc::Status (a stream's or unary call's final status) and exl3serve.v1.RequestStatus (the
// in-band status of one request on a stream). The numeric code values are identical in all three
// (gRPC's canonical codes); the mapping only guards the range.
//
//   grpc::Status g = ToGrpcStatus(absl::NotFoundError("layer 99 is not an MoE layer"));
//   SetRequestStatus(status, resp.mutable_status());
//   absl::Status back = FromRequestStatus(resp.status());
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "grpcpp/support/status.h"

namespace exl3::svc {

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

void SetRequestStatus(const absl::Status& s, ::exl3serve::v1::RequestStatus* out);
absl::Status FromRequestStatus(const ::exl3serve::v1::RequestStatus& s);

// Whether a sub-request that failed with `code` is sent again to another worker holding the same
// experts (the router's failover): the worker could not take it (UNAVAILABLE: down, draining,
// loading; RESOURCE_EXHAUSTED: queue full; ABORTED) or the stream to it was cut (CANCELLED).
// Any other code is the request's own outcome and is returned as is.
bool IsRetryable(absl::StatusCode code);

// "OK", "CANCELLED", ..., "UNAUTHENTICATED" (the label value of the `code` metric label).
std::string StatusCodeName(absl::StatusCode code);
// All 17 canonical code names, for pre-registering metric series.
std::vector<std::string> AllStatusCodeNames();

// The label value / message word of a CancelReason: "client", "deadline", "stream_closed",
// "failed" or "unspecified" (also for values this build does not know).
const char* CancelReasonName(int reason);
// The four reasons a caller sets (not "unspecified"), for pre-registering metric series.
std::vector<int> AllCancelReasons();

}  // namespace exl3::svc

// gRPC client helpers for the service tests: a loopback channel without message limits and the
// standard health check (grpc.health.v1.Health/Check) through a generic stub, so the tests need
// no generated health stubs.
#pragma once

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"

namespace exl3::testing {

std::shared_ptr<grpc::Channel> LoopbackChannel(const std::string& address);

// 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN, 0 UNKNOWN; -1 when the call failed.
int HealthCheck(const std::shared_ptr<grpc::Channel>& ch, const std::string& service);

}  // namespace exl3::testing

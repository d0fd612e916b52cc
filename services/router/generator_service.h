// The Generator gRPC service (proto/exl3serve/v1/exl3serve.proto): Generate streams one request's
// tokens from the engine (engine/core/engine.h); GenerateStream carries many requests on one call
// (services/router/generate_stream.h); DescribeModel states the served model and the KV
// capacity; EngineStats the engine's running/waiting requests, KV usage and totals. One write in flight per call: tokens sampled while a write is pending are sent
// together in the next message, so a slow client never holds the engine's loop; and writes are
// started on a writer thread (`writer`), not on the engine's loop (a gRPC write costs tens of
// microseconds, which the loop would otherwise pay per sequence per step). The calls' writes are
// queued on it quietly (TaskQueue::PostQuietly) as the engine delivers a step's events; the
// engine's EngineOptions::after_events wakes it once for all of them (services/router/generation.cc).
// Woken per event instead, the writer took the loop's core and the calls' locks in the middle
// of each step's delivery: on the 2-core development VM, 100-200 µs of a 3 ms step at 8 streams
// in which the loop thread ran for about 10 (bench/results/engine-cpu.md).
// A call's first tokens are the exception: their write starts at once, on the engine's loop, as
// the step's events are delivered. Through the writer they waited for it to get a core from the
// forward pass's threads (which take all the engine's cores) and behind the step's other writes:
// with the engine on one core of the development VM, 1.3-2.9 ms mean from the event to the write
// started at 8-64 streams even with first tokens queued ahead of the other writes (0.00 on the
// loop; to gRPC's write done 1.6-3.3 ms, then 0.1-0.8 ms), none of it in the engine's time to
// first token, which stops when the token is sampled (bench/results/frontend.md). A new request
// costs the loop one write start (tens of microseconds) once. The time from a call's first tokens
// reaching it to gRPC's write of them is measured (GeneratorOptions::first_write_*, the engine's
// metrics).
#pragma once

#include <atomic>
#include <chrono>
#include <string>

#include "engine/core/engine.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "services/common/task_queue.h"
#include "services/router/generate_stream.h"
#include "services/router/generator_options.h"

namespace exl3::router {

class GeneratorService final : public ::exl3serve::v1::Generator::CallbackService {
 public:
  // `engine` must outlive the service (and be started); `writer`, the thread that starts the
  // Generate calls' writes, must outlive the service and be woken after each batch of the
  // engine's events (TaskQueue::Wake from EngineOptions::after_events), as must `streams` be
  // flushed (GenerateStreams::Flush); both must outlive the service.
  GeneratorService(engine::Engine& engine, GeneratorOptions options, svc::TaskQueue& writer,
                   GenerateStreams& streams);

  grpc::ServerWriteReactor<::exl3serve::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const ::exl3serve::v1::GenerateRequest* req) override;
  grpc::ServerBidiReactor<::exl3serve::v1::GenerateStreamRequest,
                          ::exl3serve::v1::GenerateStreamResponse>*
  GenerateStream(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* DescribeModel(grpc::CallbackServerContext* ctx,
                                          const ::exl3serve::v1::DescribeModelRequest* req,
                                          ::exl3serve::v1::DescribeModelResponse* resp) override;
  grpc::ServerUnaryReactor* EngineStats(grpc::CallbackServerContext* ctx,
                                        const ::exl3serve::v1::EngineStatsRequest* req,
                                        ::exl3serve::v1::EngineStatsResponse* resp) override;

  // Set once draining starts (DescribeModel's state).
  void SetDraining() { draining_ = true; }

 private:
  engine::Engine& engine_;
  GeneratorOptions options_;
  std::atomic<bool> draining_{false};
  svc::TaskQueue& writer_;  // starts the Generate calls' writes
  GenerateStreams& streams_;
};

}  // namespace exl3::router

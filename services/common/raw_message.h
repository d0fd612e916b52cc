// Messages of the services' raw (grpc::ByteBuffer) stream and unary methods. gRPC's typed
// reactors report a message that does not parse exactly like the end of the stream
// (OnReadDone(false)), and a typed unary method answers a request that does not parse with a
// status of gRPC's choosing; reading the bytes and parsing them here tells the two apart, so a
// service can end the stream (or answer the call) with INVALID_ARGUMENT saying why.
//
//   grpc::ByteBuffer in;  ... OnReadDone(true):
//   absl::Status st = svc::ParseRaw(&in, &req);          // INVALID_ARGUMENT naming type and size
//   grpc::ByteBuffer out; svc::SerializeRaw(resp, &out);  // then StartWrite(&out)
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "services/common/status.h"

namespace exl3::svc {

// Parses `bb` (which is consumed) into `m`.
template <class M>
absl::Status ParseRaw(grpc::ByteBuffer* bb, M* m) {
  const size_t n = bb->Length();
  if (grpc::SerializationTraits<M>::Deserialize(bb, m).ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("a message of ", n, " bytes does not parse as ",
                                                 m->GetTypeName()));
}

// Serializes `m` into `bb` (replacing what it held).
template <class M>
absl::Status SerializeRaw(const M& m, grpc::ByteBuffer* bb) {
  bb->Clear();  // gRPC's writer wants an empty buffer
  bool own = false;
  grpc::Status st = grpc::SerializationTraits<M>::Serialize(m, bb, &own);
  if (st.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cannot serialize ", m.GetTypeName(), ": ",
                                          st.error_message()));
}

// A raw unary method: parses the request as Req and answers what fill(const Req&, Resp*) puts in
// the response; a request that does not parse is answered INVALID_ARGUMENT saying so.
template <class Req, class Resp, class Fill>
grpc::ServerUnaryReactor* AnswerUnaryRaw(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
                                         Fill fill) {
  grpc::ByteBuffer bytes = *in;  // shares its slices; ParseRaw consumes it
  Req req;
  absl::Status st = ParseRaw(&bytes, &req);
  if (st.ok()) {
    Resp resp;
    fill(req, &resp);
    st = SerializeRaw(resp, out);
  }
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(st));
  return r;
}

}  // namespace exl3::svc

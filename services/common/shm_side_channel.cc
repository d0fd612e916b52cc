#include "services/common/shm_side_channel.h"

#include <utility>

namespace exl3::svc {

ShmSideChannel::ShmSideChannel(std::shared_ptr<ShmChannel> channel, Reader reader)
    : channel_(std::move(channel)), reader_(std::move(reader)), thread_([this] { Run(); }) {}

ShmSideChannel::~ShmSideChannel() {
  Close();
  Join();
}

bool ShmSideChannel::TryWrite(const google::protobuf::MessageLite& m) {
  const size_t n = m.ByteSizeLong();
  return channel_->TryWrite(n, [&](uint8_t* dst) { m.SerializeWithCachedSizesToArray(dst); });
}

void ShmSideChannel::Close() { channel_->Close(); }

void ShmSideChannel::Join() {
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void ShmSideChannel::Run() {
  absl::Status why;
  for (;;) {
    absl::Status parsed;
    if (!channel_->Read([&](const uint8_t* p, size_t n) { parsed = reader_.parse(p, n); })) break;
    if (!parsed.ok()) {
      why = parsed;
      channel_->Close();
      break;
    }
    reader_.handle();
  }
  if (why.ok()) why = channel_->error();
  reader_.ended(why);
}

}  // namespace exl3::svc

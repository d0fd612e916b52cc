#include "services/common/signals.h"

#include <pthread.h>
#include <signal.h>

#include <cerrno>

#include "base/logging.h"

namespace exl3::svc {
namespace {
sigset_t ShutdownSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}
}  // namespace

std::unique_ptr<ShutdownSignals> ShutdownSignals::Install(Callback cb) {
  const sigset_t set = ShutdownSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::unique_ptr<ShutdownSignals> s(new ShutdownSignals());
  s->cb_ = std::move(cb);
  s->thread_ = std::thread([p = s.get()] { p->Run(); });
  return s;
}

ShutdownSignals::~ShutdownSignals() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void ShutdownSignals::Run() {
  const sigset_t set = ShutdownSet();
  int count = 0;
  while (!stop_.load()) {
    timespec timeout{0, 100 * 1000 * 1000};
    const int sig = sigtimedwait(&set, nullptr, &timeout);
    if (sig < 0) continue;  // EAGAIN (timeout) or EINTR
    ++count;
    LogInfo("received %s (%d)", sig == SIGTERM ? "SIGTERM" : "SIGINT", count);
    if (cb_) cb_(sig, count);
  }
}

}  // namespace exl3::svc

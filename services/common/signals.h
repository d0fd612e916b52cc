// SIGTERM/SIGINT handling for graceful drain, without async-signal-safety traps: the signals
// are blocked in every thread and one watcher thread receives them with sigtimedwait and calls
// a plain callback.
//
//   int main(int argc, char** argv) {
//     auto signals = ShutdownSignals::Install([&](int signo, int count) { ... });  // FIRST,
//     ...                                        // before any thread (gRPC, pools) is created
//   }
//
// `count` is 1 for the first signal, 2 for the second, ...: a service drains on the first and
// may exit at once on the second.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

namespace exl3::svc {

class ShutdownSignals {
 public:
  using Callback = std::function<void(int signo, int count)>;
  // Blocks SIGTERM and SIGINT in the calling thread (inherited by threads created later) and
  // starts the watcher.
  static std::unique_ptr<ShutdownSignals> Install(Callback cb);
  ~ShutdownSignals();  // stops the watcher (signals stay blocked)

 private:
  ShutdownSignals() = default;
  void Run();
  Callback cb_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace exl3::svc

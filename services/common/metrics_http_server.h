// A minimal HTTP/1.1 server for Prometheus scrapes: one thread, GET /metrics answered with the
// text the callback returns, everything else 404, one request per connection.
//
// Why not prometheus-cpp's Exposer (civetweb): in binaries that also link CUDA's cuBLAS, Debian's
// civetweb fails to start ("null context when constructing CivetServer") on every machine tried,
// which would leave GPU workers without metrics. Scrapes are small and rare, so a plain
// accept loop is all that is needed.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace exl3::svc {

class MetricsHttpServer {
 public:
  // Binds `listen` (HOST:PORT or [V6HOST]:PORT; port 0 picks a free one) and starts serving.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> scrape);
  ~MetricsHttpServer();  // stops accepting and joins the thread
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Serve();
  void Answer(int fd);

  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: written by the destructor to end Serve()
  int port_ = 0;
  std::function<std::string()> scrape_;
  std::thread thread_;
};

}  // namespace exl3::svc

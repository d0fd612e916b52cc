#include "services/common/flags.h"

#include <cstring>
#include <deque>
#include <filesystem>

#include "absl/flags/parse.h"
#include "base/command_line.h"

namespace exl3::svc {

std::vector<char*> DashesToUnderscores(int argc, char** argv) {
  static std::deque<std::string> storage;  // argv must outlive absl's parsing
  std::vector<char*> out;
  bool rest = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && !rest) {
      if (a == "--") {
        rest = true;
      } else if (a.size() > 2 && a[0] == '-' && a[1] == '-') {
        const size_t eq = a.find('=');
        for (size_t k = 2; k < (eq == std::string::npos ? a.size() : eq); ++k) {
          if (a[k] == '-') a[k] = '_';
        }
      }
    }
    storage.push_back(std::move(a));
    out.push_back(storage.back().data());
  }
  return out;
}

void ParseServiceFlags(int argc, char** argv, const char* usage) {
  ConfigureFlagsUsage(std::filesystem::path(argv[0]).filename().string(), usage, "services/");
  std::vector<char*> args = DashesToUnderscores(argc, argv);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
}

}  // namespace exl3::svc

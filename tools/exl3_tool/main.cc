// exl3-tool: inspect, decode, run and make EXL3 layers and models. See `exl3-tool --help`.
#include <cstdio>
#include <cstring>
#include <string>

#include "base/command_line.h"
#include "tools/exl3_tool/subcommand.h"

namespace exl3::tool {

std::vector<Subcommand>& Registry() {
  static std::vector<Subcommand> registry;
  return registry;
}

bool RegisterSubcommand(Subcommand cmd) {
  Registry().push_back(std::move(cmd));
  return true;
}

const std::vector<Subcommand>& Subcommands() { return Registry(); }

int Fail(const std::string& subcommand, const std::string& message) {
  std::fprintf(stderr, "exl3-tool %s: %s\n", subcommand.c_str(), message.c_str());
  return 1;
}

}  // namespace exl3::tool

static void PrintUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: exl3-tool <subcommand> [flags]\n"
               "       exl3-tool <subcommand> --help\n\nsubcommands:\n");
  for (const auto& c : exl3::tool::Subcommands()) {
    std::fprintf(out, "  %-18s %s\n", c.name.c_str(), c.summary.c_str());
  }
}

int main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-tool")) return 0;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : exl3::tool::Subcommands()) {
    if (c.name == argv[1]) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "exl3-tool: unknown subcommand '%s' (see exl3-tool --help)\n", argv[1]);
  return 2;
}

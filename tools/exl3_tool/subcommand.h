// exl3-tool subcommands register themselves here; main.cc dispatches on the first argument.
// Each subcommand lives in its own file in tools/exl3_tool/ and is listed in tools/CMakeLists.txt.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace exl3::tool {

struct Subcommand {
  std::string name;
  std::string summary;  // one line for `exl3-tool --help`
  // Runs with argv[0] = the subcommand name. Returns the process exit status.
  std::function<int(int argc, char** argv)> run;
};

// Called from a static initialiser in each subcommand's file.
bool RegisterSubcommand(Subcommand cmd);
const std::vector<Subcommand>& Subcommands();

// Prints "exl3-tool <subcommand>: <message>" on stderr and returns 1: the one clear line that bad
// arguments and bad files produce.
int Fail(const std::string& subcommand, const std::string& message);

}  // namespace exl3::tool

#define EXL3_TOOL_SUBCOMMAND(var, name, summary, fn) \
  static const bool var = ::exl3::tool::RegisterSubcommand({name, summary, fn})

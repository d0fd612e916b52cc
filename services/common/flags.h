// Command-line flags with dashes: absl flags are named with underscores (--max_queue); the
// services document and accept dashes (--max-queue). DashesToUnderscores rewrites the flag-name
// part of every "--name[=value]" argument before absl::ParseCommandLine.
//
//   int main(int argc, char** argv) {
//     std::vector<char*> args = exl3::svc::DashesToUnderscores(argc, argv);
//     absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
#pragma once

#include <string>
#include <vector>

namespace exl3::svc {

// The returned pointers stay valid for the life of the process. Stops at a bare "--".
std::vector<char*> DashesToUnderscores(int argc, char** argv);

// What the service binaries do with their command line: sets `usage` as the program's usage
// message, limits --help to the flags defined under services/ (not absl's own), --version as
// base/command_line.h prints it, accepts dashed flag names and parses. Exits on --help,
// --version or a bad flag, as absl does.
void ParseServiceFlags(int argc, char** argv, const char* usage);

}  // namespace exl3::svc

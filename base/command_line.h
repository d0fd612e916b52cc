// What every binary of the project does with its command line: `--version` prints
// "<program> <version> (<git describe>)" and exits 0; `--help` prints the usage message and the
// program's own flags (not absl's).
//
//   absl-flag binaries, before parsing:
//     exl3::ConfigureFlagsUsage("exl3-foo", "exl3-foo --bar N\nWhat it does.", "tools/");
//     absl::ParseCommandLine(argc, argv);
//   binaries that read argv themselves, first thing in main:
//     if (exl3::PrintVersionIfAsked(argc, argv, "exl3-foo")) return 0;
#pragma once

#include <string>
#include <string_view>

namespace exl3 {

std::string_view ProjectVersion();  // CMake's PROJECT_VERSION
// `git describe --always --dirty` of the checkout at configure time; empty outside a checkout.
std::string_view GitDescribe();
std::string VersionLine(std::string_view program);

// Sets absl's usage message and --version line; --help and --helpshort list the flags defined in
// source files whose path contains `flags_under` (e.g. "services/").
void ConfigureFlagsUsage(std::string_view program, const char* usage, std::string_view flags_under);

// True, after printing VersionLine(program) to stdout, when an argument before a bare "--" is
// --version.
bool PrintVersionIfAsked(int argc, char** argv, std::string_view program);

}  // namespace exl3

#include "base/command_line.h"

#include <cstdio>
#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"

namespace exl3 {

std::string_view ProjectVersion() { return EXL3_PROJECT_VERSION; }
std::string_view GitDescribe() { return EXL3_GIT_DESCRIBE; }

std::string VersionLine(std::string_view program) {
  std::string line = std::string(program) + " " + std::string(ProjectVersion());
  if (!GitDescribe().empty()) line += " (" + std::string(GitDescribe()) + ")";
  return line;
}

void ConfigureFlagsUsage(std::string_view program, const char* usage, std::string_view flags_under) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const std::string under(flags_under);
  config.contains_help_flags = [under](absl::string_view file) { return file.find(under) != absl::string_view::npos; };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [line = VersionLine(program)] { return line + "\n"; };
  absl::SetFlagsUsageConfig(config);
}

bool PrintVersionIfAsked(int argc, char** argv, std::string_view program) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") return false;
    if (a == "--version") {
      std::printf("%s\n", VersionLine(program).c_str());
      return true;
    }
  }
  return false;
}

}  // namespace exl3

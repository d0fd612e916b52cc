#include "base/command_line.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace exl3 {
namespace {

TEST(CommandLineTest, VersionLineNamesTheProgramAndTheProjectVersion) {
  const std::string line = VersionLine("exl3-foo");
  EXPECT_EQ(line.rfind("exl3-foo " + std::string(ProjectVersion()), 0), 0u) << line;
  EXPECT_FALSE(ProjectVersion().empty());
  if (!GitDescribe().empty()) {
    EXPECT_NE(line.find("(" + std::string(GitDescribe()) + ")"), std::string::npos);
  }
}

TEST(CommandLineTest, PrintVersionIfAskedLooksBeforeABareDoubleDash) {
  auto asked = [](std::vector<std::string> args) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return PrintVersionIfAsked(static_cast<int>(argv.size()), argv.data(), "exl3-foo");
  };
  EXPECT_TRUE(asked({"exl3-foo", "--version"}));
  EXPECT_TRUE(asked({"exl3-foo", "--model", "m", "--version"}));
  EXPECT_FALSE(asked({"exl3-foo"}));
  EXPECT_FALSE(asked({"exl3-foo", "--", "--version"}));
  EXPECT_FALSE(asked({"exl3-foo", "--versions"}));
}

}  // namespace
}  // namespace exl3

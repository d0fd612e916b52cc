// exl3-tool digest: records the content digest of every tensor of a model directory
// (weights.digest.json, model/weight_digest.h), for a model converted before exl3-tool quantize
// recorded them. The model fingerprint then covers the weights.
#include <cstdio>
#include <string>

#include "model/weight_digest.h"
#include "model/write_weight_digests.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool digest --model DIR\n"
    "\n"
    "Hashes every tensor of the model directory DIR and writes DIR/weights.digest.json. Routers and\n"
    "workers then include the digests in the model fingerprint and check each tensor they read\n"
    "against its digest. Run it again after changing any weight file on purpose.\n";

int Run(int argc, char** argv) {
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv, {"model"}, {}, &err)) return Fail("digest", err);
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"model"}, &err)) return Fail("digest", err);
  absl::Status s = WriteWeightDigests(args.Get("model"));
  if (!s.ok()) return Fail("digest", std::string(s.message()));
  std::printf("wrote %s/%s\n", args.Get("model").c_str(), kWeightDigestFile);
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kDigestRegistered, "digest",
                     "record the content digest of every tensor of a model (weights.digest.json)",
                     exl3::tool::Run);

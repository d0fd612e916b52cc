#include "model/checkpoint_naming.h"

namespace exl3 {
namespace {

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

std::string_view CheckpointNamingName(CheckpointNaming n) {
  return n == CheckpointNaming::kDeepseekRelease ? "deepseek-release" : "transformers";
}

CheckpointNaming DetectCheckpointNaming(const std::vector<std::string>& stored_names) {
  bool embed = false, layers = false;
  for (const std::string& name : stored_names) {
    if (StartsWith(name, "model.")) return CheckpointNaming::kTransformers;
    embed = embed || StartsWith(name, "embed.");
    layers = layers || StartsWith(name, "layers.");
  }
  return embed && layers ? CheckpointNaming::kDeepseekRelease : CheckpointNaming::kTransformers;
}

std::string ProjectTensorName(CheckpointNaming n, std::string_view stored_view) {
  const std::string stored(stored_view);
  if (n == CheckpointNaming::kTransformers) return stored;
  if (StartsWith(stored, "layers.")) {
    // exllamav3 names the attention's KV norm attn.kv_norm; the project reads it as attn.norm.
    const size_t kv = stored.find(".attn.kv_norm.");
    if (kv != std::string::npos) {
      return "model." + stored.substr(0, kv) + ".attn.norm." + stored.substr(kv + 14);
    }
    return "model." + stored;
  }
  if (StartsWith(stored, "embed.")) return "model.embed_tokens." + stored.substr(6);
  if (StartsWith(stored, "norm.")) return "model.norm." + stored.substr(5);
  for (const char* part : {"fn", "base", "scale"}) {
    if (stored == std::string("hc_head_") + part) return std::string("model.hc_head.hc_") + part;
  }
  // "head.*" (the output head), "mtp.*" (DeepSeek-V4's multi-token prediction blocks, which the
  // project does not run) and anything else keep their names.
  return stored;
}

}  // namespace exl3

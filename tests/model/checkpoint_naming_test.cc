// CheckpointNaming: which naming a checkpoint's tensor names follow, and the project's name for
// each stored name.
#include "model/checkpoint_naming.h"

#include "gtest/gtest.h"

namespace exl3 {
namespace {

TEST(CheckpointNaming, DetectsDeepseekReleaseNames) {
  EXPECT_EQ(DetectCheckpointNaming({"embed.weight", "layers.0.attn.wq_a.trellis", "head.trellis"}),
            CheckpointNaming::kDeepseekRelease);
  // A quantized embedding table has no .weight.
  EXPECT_EQ(DetectCheckpointNaming({"embed.trellis", "embed.signs", "layers.0.attn_norm.weight"}),
            CheckpointNaming::kDeepseekRelease);
  EXPECT_EQ(DetectCheckpointNaming({"model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"}),
            CheckpointNaming::kTransformers);
  // Any "model." name means transformers naming; so does a file without embed/layers.
  EXPECT_EQ(DetectCheckpointNaming({"embed.weight", "layers.0.x", "model.norm.weight"}),
            CheckpointNaming::kTransformers);
  EXPECT_EQ(DetectCheckpointNaming({"weight", "x"}), CheckpointNaming::kTransformers);
  EXPECT_EQ(DetectCheckpointNaming({}), CheckpointNaming::kTransformers);
}

TEST(CheckpointNaming, ProjectNamesOfReleaseTensors) {
  const CheckpointNaming r = CheckpointNaming::kDeepseekRelease;
  EXPECT_EQ(ProjectTensorName(r, "layers.3.ffn.experts.7.w2.trellis"),
            "model.layers.3.ffn.experts.7.w2.trellis");
  EXPECT_EQ(ProjectTensorName(r, "layers.0.hc_attn_fn"), "model.layers.0.hc_attn_fn");
  EXPECT_EQ(ProjectTensorName(r, "layers.2.attn.kv_norm.weight"), "model.layers.2.attn.norm.weight");
  EXPECT_EQ(ProjectTensorName(r, "layers.2.attn.compressor.norm.weight"),
            "model.layers.2.attn.compressor.norm.weight");
  EXPECT_EQ(ProjectTensorName(r, "embed.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(ProjectTensorName(r, "embed.trellis"), "model.embed_tokens.trellis");
  EXPECT_EQ(ProjectTensorName(r, "norm.weight"), "model.norm.weight");
  EXPECT_EQ(ProjectTensorName(r, "hc_head_fn"), "model.hc_head.hc_fn");
  EXPECT_EQ(ProjectTensorName(r, "hc_head_base"), "model.hc_head.hc_base");
  EXPECT_EQ(ProjectTensorName(r, "hc_head_scale"), "model.hc_head.hc_scale");
  EXPECT_EQ(ProjectTensorName(r, "head.trellis"), "head.trellis");
  EXPECT_EQ(ProjectTensorName(r, "mtp.0.ffn.experts.0.w1.trellis"), "mtp.0.ffn.experts.0.w1.trellis");
  EXPECT_EQ(ProjectTensorName(CheckpointNaming::kTransformers, "embed.weight"), "embed.weight");
  EXPECT_EQ(CheckpointNamingName(r), "deepseek-release");
}

}  // namespace
}  // namespace exl3

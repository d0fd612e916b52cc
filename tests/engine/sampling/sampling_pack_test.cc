// The host side of device sampling (engine/sampling/sampling_pack.h): what a row's packed form holds.
#include "engine/sampling/sampling_pack.h"

#include <bit>
#include <cmath>
#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

using V = std::vector<int32_t>;

std::map<int32_t, PackedPenaltyEntry> EntriesOf(const PackedSampling& p, int row) {
  std::map<int32_t, PackedPenaltyEntry> m;
  for (int i = p.rows[row].entries_begin; i < p.rows[row].entries_end; ++i) {
    EXPECT_FALSE(m.contains(p.entries[i].token)) << "token " << p.entries[i].token << " twice";
    m[p.entries[i].token] = p.entries[i];
  }
  return m;
}

TEST(SamplingPack, ParametersAsTheCpuSamplerComputesThem) {
  SamplingPacker packer(100);
  const V output = {5, 6, 5};
  RowSampling a;
  a.params.temperature = 0.7f;
  a.params.top_k = 40;
  a.params.top_p = 0.9f;
  a.params.min_p = 0.05f;
  a.params.logprobs = 3;
  a.seed = 1234;
  a.history.output = output;
  RowSampling greedy;
  greedy.params.temperature = 0;
  RowSampling tiny;  // issue 28: 1 / T overflows; the GPU sampler must take it as greedy too
  tiny.params.temperature = 1e-40f;
  PackedSampling p;
  packer.Pack(std::vector<RowSampling>{a, greedy, tiny}, &p);
  ASSERT_EQ(p.rows.size(), 3u);
  EXPECT_EQ(p.rows[2].flags, kPackedGreedy);
  const PackedSamplingRow& r = p.rows[0];
  EXPECT_EQ(r.uniform, Sampler::UniformDraw(1234, 3));  // the draw index is the output's size
  EXPECT_EQ(r.inv_temperature, 1.0f / 0.7f);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_EQ(r.top_p, 0.9f);
  EXPECT_EQ(r.log_min_p, std::log(0.05f));
  EXPECT_EQ(r.num_logprobs, 3);
  EXPECT_EQ(r.flags, kPackedTopP | kPackedMinP);
  EXPECT_EQ(r.entries_begin, r.entries_end);  // no penalty: nothing touched
  EXPECT_EQ(p.rows[1].flags, kPackedGreedy);
  EXPECT_EQ(p.rows[1].num_logprobs, -1);
  EXPECT_EQ(p.max_top, 3);
}

TEST(SamplingPack, PenaltyEntriesAreTheDistinctTokensTheCpuSamplerTouches) {
  SamplingPacker packer(50);
  const V prompt = {1, 2, 2, 3}, output = {3, 4, 4, 4, 7}, banned = {9, 4};
  RowSampling rep;
  rep.params.repetition_penalty = 1.2f;
  rep.history = {prompt, output, banned};
  RowSampling additive;
  additive.params.frequency_penalty = 0.5f;
  additive.history = {prompt, output, {}};
  RowSampling none;
  none.history = {prompt, output, banned};
  PackedSampling p;
  // Twice: the packer's scratch is clean between calls.
  for (int pass = 0; pass < 2; ++pass) {
    packer.Pack(std::vector<RowSampling>{rep, additive, none}, &p);
    const auto e0 = EntriesOf(p, 0);
    EXPECT_EQ(p.rows[0].flags, kPackedRepetition);
    ASSERT_EQ(e0.size(), 6u);  // 1 2 3 4 7 from the history, 9 banned (4 both)
    EXPECT_EQ(e0.at(1).output_count, 0);
    EXPECT_EQ(e0.at(3).output_count, 1);
    EXPECT_EQ(e0.at(4).output_count, 3);
    EXPECT_EQ(e0.at(4).banned, 1);
    EXPECT_EQ(e0.at(9).banned, 1);
    EXPECT_EQ(e0.at(9).output_count, 0);
    EXPECT_EQ(e0.at(2).banned, 0);
    // Presence and frequency penalties look at the output only.
    const auto e1 = EntriesOf(p, 1);
    EXPECT_EQ(p.rows[1].flags, kPackedAdditive);
    ASSERT_EQ(e1.size(), 3u);
    EXPECT_EQ(e1.at(4).output_count, 3);
    EXPECT_EQ(e1.at(7).output_count, 1);
    EXPECT_FALSE(e1.contains(1));
    // No penalty: the bans only.
    const auto e2 = EntriesOf(p, 2);
    ASSERT_EQ(e2.size(), 2u);
    EXPECT_EQ(e2.at(4).banned, 1);
    EXPECT_EQ(e2.at(4).output_count, 0);
  }
}

TEST(SamplingPack, UnpackReadsTheResultWords) {
  PackedSamplingRow row;
  row.num_logprobs = 2;
  std::vector<uint32_t> words(OutputWordsPerRow(3), 0);
  words[kSampledToken] = 17;
  words[kSampledLogprob] = std::bit_cast<uint32_t>(-0.5f);
  words[kSampledNumTop] = 2;
  words[kSampledTopBegin] = 17;
  words[kSampledTopBegin + 1] = std::bit_cast<uint32_t>(-0.5f);
  words[kSampledTopBegin + 2] = 3;
  words[kSampledTopBegin + 3] = std::bit_cast<uint32_t>(-1.25f);
  SampledToken t = UnpackSampledRow(words, row);
  EXPECT_EQ(t.token, 17);
  ASSERT_TRUE(t.logprob.has_value());
  EXPECT_EQ(*t.logprob, -0.5f);
  ASSERT_EQ(t.top_logprobs.size(), 2u);
  EXPECT_EQ(t.top_logprobs[1].token, 3);
  EXPECT_EQ(t.top_logprobs[1].logprob, -1.25f);
  row.num_logprobs = -1;
  t = UnpackSampledRow(words, row);
  EXPECT_FALSE(t.logprob.has_value());
  EXPECT_TRUE(t.top_logprobs.empty());
}

}  // namespace
}  // namespace exl3::engine

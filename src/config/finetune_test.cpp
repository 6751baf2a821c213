// --finetune's text: what each form parses to, its name reading back to the same setting, the
// globs of freeze:, and the refusals, each naming what is accepted.
#include "config/finetune.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(Finetune, ParsesEachFormAndNamesItBack) {
  EXPECT_TRUE(parse_finetune("full").full());
  const Finetune frozen = parse_finetune("freeze:embed_tokens.weight,layers.0.*");
  EXPECT_EQ(frozen.kind, Finetune::Kind::freeze);
  EXPECT_EQ(frozen.freeze, (std::vector<std::string>{"embed_tokens.weight", "layers.0.*"}));
  // peft's defaults: alpha 8, dropout 0, q and v.
  const Finetune lora = parse_finetune("lora:r=16");
  EXPECT_EQ(lora.lora.r, 16);
  EXPECT_EQ(lora.lora.alpha, 8);
  EXPECT_EQ(lora.lora.dropout, 0);
  EXPECT_EQ(lora.lora.targets, (std::vector<Projection>{Projection::q, Projection::v}));
  EXPECT_DOUBLE_EQ(lora.lora.scale(), 0.5);
  // targets as the issue writes them (commas) or joined by +, in any order: the same setting.
  const Finetune commas = parse_finetune("lora:r=8,alpha=16,dropout=0.05,targets=v,q,down");
  EXPECT_EQ(commas, parse_finetune("lora:targets=q+v+down,dropout=0.05,r=8,alpha=16"));
  EXPECT_EQ(commas.lora.targets, (std::vector<Projection>{Projection::q, Projection::v, Projection::down}));
  for (const Finetune& f : {lora, commas, frozen, parse_finetune("full")}) EXPECT_EQ(parse_finetune(f.name()), f);
}

TEST(Finetune, RefusalsSayWhatIsAccepted) {
  auto refusal = [](const std::string& text) {
    try {
      parse_finetune(text);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(refusal("lora"), HasSubstr("needs its rank: lora:r=R"));
  EXPECT_THAT(refusal("lora:alpha=4"), HasSubstr("needs its rank"));
  EXPECT_THAT(refusal("lora:r=0"), HasSubstr("r must be an integer from 1 to 65536"));
  EXPECT_THAT(refusal("lora:r=2.5"), HasSubstr("r must be an integer"));
  EXPECT_THAT(refusal("lora:r=8,dropout=1"), HasSubstr("dropout must be in [0, 1)"));
  EXPECT_THAT(refusal("lora:r=8,targets=q,x"), HasSubstr("target 'x'; accepted: q, k, v, o, gate, up, down"));
  EXPECT_THAT(refusal("lora:r=8,rank=4"), HasSubstr("unknown LoRA setting 'rank'"));
  EXPECT_THAT(refusal("lora:r=8,q"), HasSubstr("'q' is not key=value"));
  EXPECT_THAT(refusal("freeze:"), HasSubstr("an empty pattern"));
  EXPECT_THAT(refusal("qlora"), HasSubstr("accepted: full, freeze:PATTERN"));
}

TEST(Finetune, GlobsMatchWholeNames) {
  EXPECT_TRUE(glob_match("layers.0.*", "layers.0.attn.q_proj.weight"));
  EXPECT_FALSE(glob_match("layers.0.*", "layers.10.attn.q_proj.weight"));
  EXPECT_TRUE(glob_match("*.self_attn.*", "model.layers.3.self_attn.k_proj.weight"));
  EXPECT_TRUE(glob_match("layers.?.mlp.*", "layers.7.mlp.up_proj.weight"));
  EXPECT_FALSE(glob_match("layers.?.mlp.*", "layers.17.mlp.up_proj.weight"));
  EXPECT_FALSE(glob_match("embed_tokens", "embed_tokens.weight"));  // whole names, not prefixes
  EXPECT_TRUE(glob_match("*", "anything"));
  EXPECT_TRUE(glob_match("a*b*c", "aXXbYYc"));
  EXPECT_FALSE(glob_match("a*b*c", "aXXbYY"));
}

}  // namespace
}  // namespace headroom

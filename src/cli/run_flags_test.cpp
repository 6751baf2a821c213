// The field table writes what it reads: a configuration written as flags (run_args) or as a run
// file (run_toml) and read back by the CLI's own parser or the TOML reader is the same
// configuration; the doctor's and the planner's command lines and run files are made this way.
#include "cli/run_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "testing/temp_dir.h"

namespace headroom {
namespace {

using ::testing::ElementsAre;

// A value other than the default for every setting, as a person would type it. A setting added to
// the table without one here fails EveryFieldHasASample: give it one, and the round trips below
// hold it to writing what it reads.
const std::map<std::string, std::vector<std::string>>& samples() {
  static const std::map<std::string, std::vector<std::string>> s = {
      {"model", {"gpt2"}},
      {"set", {"n_layer=2", "n_embd=64"}},
      {"data", {"my corpus.txt"}},
      {"data-tokens", {"uint16:train.bin"}},
      {"weights", {"qwen3 base"}},
      {"save-weights", {"tuned out"}},
      {"merge-lora", {"true"}},
      {"adapter", {"my adapter"}},
      {"steps", {"300"}},
      {"batch", {"4"}},
      {"accum", {"2"}},
      {"seq", {"256"}},
      {"lr", {"0.0003"}},
      {"min-lr-ratio", {"0.05"}},
      {"warmup", {"10"}},
      {"optimizer", {"adafactor"}},
      {"optimizer-impl", {"torch"}},
      {"weight-decay", {"0.01"}},
      {"grad-clip", {"0.5"}},
      {"seed", {"7"}},
      {"device", {"cpu"}},
      {"threads", {"2"}},
      {"attention", {"math"}},
      {"moe-routing", {"1.75"}},
      {"finetune", {"lora:r=16,alpha=32,targets=q,k,v,o"}},
      {"precision", {"bf16-mixed"}},
      {"checkpointing", {"every:2"}},
      {"memory-budget", {"140MiB"}},
      {"allocator", {"caching"}},
      {"allocator-conf", {"expandable_segments:True,max_split_size_mb:128"}},
      {"memory-snapshot", {"snap.pickle"}},
      {"inject-oom", {"2:150@1"}},
      {"inject-leak", {"keep-graph"}},
      {"metrics", {"m.jsonl"}},
      {"checkpoint", {"it's here"}},
      {"checkpoint-every", {"50"}},
      {"stop-at", {"100"}},
      {"resume", {"old"}},
      {"eval-every", {"25"}},
      {"eval-rows", {"8"}},
      {"plan", {"auto"}},
      {"no-guard", {"true"}},
      {"shard", {"gradients"}},
      {"offload", {"optimizer"}},
      {"loss", {"chunked:512"}},
      {"base-weights", {"nf4"}},
      {"pipeline", {"2"}},
      {"pipeline-split", {"0:1,1:2"}},
      {"tensor-parallel", {"2"}},
      {"sequence-parallel", {"false"}},
      {"reshard-after-forward", {"false"}},
      {"world-size", {"2"}},
      {"dist-timeout", {"60"}},
      {"json", {"true"}},
      {"quiet", {"true"}},
  };
  return s;
}

RunConfig everything_set() {
  RunConfig c;
  for (const auto& [key, values] : samples()) {
    for (const std::string& v : values) find_run_field(key)->set(c, v);
  }
  return c;
}

// What `args` make of the defaults through the CLI's own parser (CLI11, as `headroom train` binds it).
RunConfig parsed(std::vector<std::string> args) {
  CLI::App app;
  const auto config = bind_run_flags(&app);
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector last argument first
  app.parse(args);
  return config();
}

TEST(RunFlags, EveryFieldHasASample) {
  for (const RunField& f : run_fields()) EXPECT_EQ(samples().count(f.key), 1u) << "no sample for --" << f.key;
  EXPECT_EQ(samples().size(), run_fields().size());
}

// --weights DIR brings its own config.json unless --model names another, in whatever order given.
TEST(RunFlags, WeightsGiveTheModelUnlessOneIsNamed) {
  EXPECT_EQ(parsed({"--weights", "ckpt"}).model, "ckpt");
  EXPECT_EQ(parsed({"--weights", "ckpt", "--model", "gpt2"}).model, "gpt2");
  EXPECT_EQ(parsed({"--model", "gpt2", "--weights", "ckpt"}).model, "gpt2");
  EXPECT_EQ(parsed({"--weights", "ckpt"}).weights, "ckpt");
  EXPECT_EQ(parsed({}).model, "tiny");
}

TEST(RunFlags, FlagsWrittenByTheTableReadBackToTheSameConfiguration) {
  const RunConfig c = everything_set();
  const std::vector<std::string> args = run_args(c);
  const RunConfig back = parsed(args);
  EXPECT_EQ(run_args(back), args);
  EXPECT_TRUE(run_args(back, c).empty());
  EXPECT_EQ(back.step(), c.step());
  EXPECT_EQ(back.memory_budget, int64_t{140} << 20);
  EXPECT_EQ(back.overrides, (std::vector<std::string>{"n_layer=2", "n_embd=64"}));
  EXPECT_EQ(back.checkpoint, "it's here");
  EXPECT_DOUBLE_EQ(back.lr, 3e-4);
  // Sizes are written as a person writes them, not as a byte count.
  const auto budget = std::find(args.begin(), args.end(), "--memory-budget");
  ASSERT_NE(budget, args.end());
  EXPECT_EQ(*(budget + 1), "140MiB");
  // Only what differs from the base is written, unless asked for.
  RunConfig small;
  small.batch = 2;
  small.memory_budget = int64_t{1198} * 1000 * 1000;
  EXPECT_THAT(run_args(small), ElementsAre("--batch", "2", "--memory-budget", "1198MB"));
  EXPECT_THAT(run_args(small, RunConfig{}, {"model", "batch"}),
              ElementsAre("--model", "tiny", "--batch", "2", "--memory-budget", "1198MB"));
  RunConfig quiet;
  quiet.quiet = true;
  EXPECT_THAT(run_args(RunConfig{}, quiet), ElementsAre("--quiet=false"));
  EXPECT_FALSE(parsed(run_args(RunConfig{}, quiet)).quiet);
}

TEST(RunFlags, AShellLineQuotesWhatTheShellWouldSplit) {
  EXPECT_EQ(shell_line({"--model", "gpt2", "--data", "my corpus.txt", "--checkpoint", "it's", "--set", "a=b"}),
            "--model gpt2 --data 'my corpus.txt' --checkpoint 'it'\\''s' --set a=b");
  EXPECT_EQ(shell_line({"--resume", ""}), "--resume ''");
}

TEST(RunFlags, ARunFileWrittenByTheTableReadsBackToTheSameConfiguration) {
  const RunConfig c = everything_set();
  testing::TempDir dir;
  const std::string path = dir.file("run.toml");
  std::ofstream(path) << run_toml(c);
  RunConfig back;
  apply_toml_file(back, path);
  EXPECT_EQ(run_args(back), run_args(c));
  EXPECT_EQ(back.memory_budget, int64_t{140} << 20);
  EXPECT_EQ(run_toml(RunConfig{}), "");
  RunConfig lr;
  lr.lr = 1;  // a float that prints as an integer is still written as TOML's float
  EXPECT_EQ(run_toml(lr), "lr = 1.0\n");
}

}  // namespace
}  // namespace headroom

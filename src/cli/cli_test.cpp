// The command line as a user meets it: exit codes, one-line errors, --json's single object.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "device/cuda_adapter.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

// `env`: variable assignments for the command's environment ("NAME=value ...", shell-quoted).
Result run(const std::string& args, const std::string& env = "") {
  TempDir dir;
  const std::string cmd =
      (env.empty() ? "" : "env " + env + " ") + HEADROOM_BINARY + " " + args + " 2>" + dir.file("err") + " </dev/null";
  Result r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(dir.file("err"));
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  return r;
}

size_t lines(const std::string& s) { return static_cast<size_t>(std::count(s.begin(), s.end(), '\n')); }

void expect_usage_error(const std::string& args, const std::string& says) {
  const Result r = run(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(lines(r.err), 1u) << "one line, no stack trace: " << r.err;
  EXPECT_THAT(r.err, HasSubstr(says)) << args;
}

// A bad allocator setting in the environment is bad input, stopped before LibTorch loads (whose
// CUDA library aborts on some while it is loaded, and refuses others at its first allocation).
TEST(Cli, ABadAllocatorSettingInTheEnvironmentIsBadInput) {
  struct Case {
    std::string env, says;
    bool lists_keys = false;  // a wrong key: the message lists the accepted ones
  };
  for (const Case& c : std::vector<Case>{
           {"PYTORCH_CUDA_ALLOC_CONF=garbage", "PYTORCH_CUDA_ALLOC_CONF: option 'garbage' has no value", true},
           {"PYTORCH_ALLOC_CONF=expandable_segments:True,foo:1", "PYTORCH_ALLOC_CONF: unknown option 'foo'", true},
           {"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:abc", "max_split_size_mb 'abc' is not a non-negative"},
           {"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:yes", "expandable_segments 'yes': accepted: True or False"},
       }) {
    const Result r = run("estimate --model tiny --json", "'" + c.env + "'");
    EXPECT_EQ(r.code, 2) << c.env << "\n" << r.err;
    EXPECT_EQ(lines(r.err), 1u) << "one line, no backtrace: " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.env;
    if (c.lists_keys) {
      EXPECT_THAT(r.err, HasSubstr("max_split_size_mb, max_non_split_rounding_mb")) << r.err;
    }
    const auto j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.out;
    EXPECT_EQ(j.value("exit_code", 0), 2);
  }
  // What PyTorch accepts runs, including what headroom's model of the allocator leaves alone.
  for (const char* env : {"PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync", "PYTORCH_CUDA_ALLOC_CONF=large_segment_size_mb:64",
                          "PYTORCH_ALLOC_CONF=expandable_segments:True,pinned_num_register_threads:4"}) {
    const Result r = run("estimate --model tiny --device cpu", std::string("'") + env + "'");
    EXPECT_EQ(r.code, 0) << env << "\n" << r.err;
  }
}

TEST(Cli, BadInputGivesOneLineAndExitCode2) {
  TempDir dir;
  {
    std::ofstream f(dir.file("bert.json"));
    f << R"({"model_type": "bert", "vocab_size": 30522})";
  }
  expect_usage_error("train --model " + dir.file("bert.json"), "model_type 'bert' is not native to headroom (native:");
  expect_usage_error("train --model nosuchpreset", "(not a preset name and not a readable file); presets:");
  expect_usage_error("train --batch -3", "--batch must be positive, got -3");
  expect_usage_error("train --seq 0", "--seq must be positive");
  expect_usage_error("train --steps many", "--steps: 'many' is not an integer");
  expect_usage_error("train --data /no/such.txt", "--data: cannot read '/no/such.txt'");
  expect_usage_error("train --set num_hidden_layers=-1", "number of layers must be positive, got -1");
  expect_usage_error("train --attention fast", "accepted: flash");
  expect_usage_error("train --resume " + dir.path(), "no checkpoint at");
  expect_usage_error("train --bogus", "bogus");
  expect_usage_error("train --device cuda:1abc", "cuda:1abc");
  expect_usage_error("train --data /tmp", "'/tmp' is a directory");
  {
    // A file name that is not UTF-8 must still give one line and one JSON object, not a crash.
    const Result r = run("train --json --model /tmp/\xff.json");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(lines(r.out), 1u);
    EXPECT_TRUE(nlohmann::json::accept(r.out)) << r.out;
  }
  expect_usage_error("frobnicate", "unknown command 'frobnicate'; commands: train");
  {
    std::ofstream f(dir.file("run.toml"));
    f << "steps = 3\nlearning_rate = 0.1\n";
  }
  expect_usage_error("train --config " + dir.file("run.toml"), "unknown key 'learning_rate'; accepted: model, set");
  {
    std::ofstream f(dir.file("broken.toml"));
    f << "steps = = 3\n";
  }
  expect_usage_error("train --config " + dir.file("broken.toml"), "broken.toml:1:");
}

// The inputs a new user got wrong messages for (issue 12): each now names what is wrong and what is
// accepted.
TEST(Cli, BadInputThatOnceMisledNowSaysWhatIsAccepted) {
  TempDir dir;
  {
    std::ofstream f(dir.file("numeric-type.json"));
    f << R"({"model_type": 5, "hidden_size": 64})";
  }
  expect_usage_error("estimate --model " + dir.file("numeric-type.json"),
                     "field 'model_type' must be a string naming the family, got 5; supported: gpt2");
  {
    std::ofstream f(dir.file("huge-vocab.json"));
    f << R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 1, "max_position_embeddings": 64, "vocab_size": 9223372036854775808})";
  }
  expect_usage_error("estimate --model " + dir.file("huge-vocab.json"),
                     "field 'vocab_size' is out of range: 9223372036854775808; accepted: an integer of at most 2^40");
  {
    std::ofstream f(dir.file("33.txt"));
    f << std::string(33, 'x');
  }
  // 33 bytes split 30/3: the message says so, and how long a text --seq 32 needs (330 bytes: 297/33).
  expect_usage_error("train --data " + dir.file("33.txt") + " --seq 32",
                     "33 bytes is too short for --seq 32: its train split (90%) holds 30 and its eval split (the "
                     "last 10%) 3, and each needs a window of 33 (seq + 1); accepted: at least 330 bytes");
  expect_usage_error("train --data /dev/zero", "'/dev/zero' is not a regular file");
  expect_usage_error("train --weights /no/such/checkpoint", "--weights '/no/such/checkpoint': not a directory");
  expect_usage_error("train --data-tokens " + dir.file("33.txt"), "shorter than llm.c's 1024-byte header");
  expect_usage_error("train --data-tokens uint32:" + dir.file("33.txt"), "33 bytes is not a whole number of uint32 ids");
  expect_usage_error("train --data x.txt --data-tokens y.bin", "--data and --data-tokens both given");
  expect_usage_error("train --finetune lora", "--finetune lora needs its rank: lora:r=R");
  expect_usage_error("train --merge-lora", "--merge-lora needs --finetune lora:... and --save-weights DIR");
  expect_usage_error("train --adapter somewhere", "--adapter needs --finetune lora:r=R");
  expect_usage_error("train --base-weights nf4", "--base-weights nf4 needs --finetune lora:r=R");
  expect_usage_error("train --base-weights int3", "--base-weights 'int3': accepted: dense or nf4");
  expect_usage_error("train --finetune lora:r=4 --base-weights nf4 --merge-lora --save-weights " + dir.file("m"),
                     "--merge-lora with --base-weights nf4: merging into a 4-bit base is not supported");
  expect_usage_error("estimate --offload optimizer --world-size 2", "--offload optimizer with 2 data-parallel ranks");
  expect_usage_error("train --offload gpu", "--offload 'gpu': accepted: none, optimizer, activations or optimizer,activations");
  expect_usage_error("plan --global-batch 8 --memory-budget 1GiB --allow everything", "--allow");
  expect_usage_error("train --finetune freeze:nothing.matches --steps 1", "'nothing.matches' matches no parameter of tiny");
  expect_usage_error("estimate --model qwen3-30b-a3b --finetune lora:r=8,targets=q,gate",
                     "LoRA on a mixture of experts' MLPs (gate, up, down) is not supported yet");
  expect_usage_error("estimate --finetune lora:r=8 --world-size 2", "with --world-size 2: not supported yet");
  expect_usage_error("estimate --model " + dir.path(), "a directory without a config.json");
  expect_usage_error("train --config /dev/urandom", "'/dev/urandom' is not a regular file");
  expect_usage_error("train --steps 4 --warmup 10", "--warmup 10 is longer than --steps 4");
  expect_usage_error("train --steps 4 --inject-oom 999:1", "--inject-oom 999:1: step 999 never runs");
  expect_usage_error("train --steps 4 --inject-oom 2:above:1TiB", "no allocation of a step is that large");
  expect_usage_error("train --checkpoint " + std::string(HEADROOM_BINARY), "is a file");
}

// The levers of the runs launched at scale (issue 48), where they do not combine: refused before any
// number is printed, in one line naming what is accepted.
TEST(Cli, LeversThatDoNotCombineAreRefusedWithWhatIsAccepted) {
  expect_usage_error("estimate --checkpointing ops --finetune lora:r=8",
                     "--checkpointing ops with --finetune lora:r=8,alpha=8,dropout=0,targets=q,v: not supported yet");
  expect_usage_error("train --checkpointing ops --finetune lora:r=8 --steps 1", "accepted: --checkpointing full");
  expect_usage_error("estimate --model qwen3-30b-a3b --checkpointing ops", "(a mixture of experts): not supported yet");
  expect_usage_error("estimate --checkpointing ops --offload activations", "--checkpointing ops with --offload");
  expect_usage_error("estimate --checkpointing ops --tensor-parallel 2 --world-size 2",
                     "--checkpointing ops with --tensor-parallel 2");
  expect_usage_error("estimate --precision bf16-params --shard gradients --world-size 2",
                     "--precision bf16-params with --shard gradients on 2 data-parallel ranks");
  expect_usage_error("train --precision bf16-params --finetune lora:r=8 --steps 1",
                     "--precision bf16-params with --finetune lora:r=8,");
  expect_usage_error("estimate --precision bf16-params --loss chunked", "--precision bf16-params with --loss chunked");
  expect_usage_error("estimate --reshard-after-forward=false", "accepted: --reshard-after-forward true here");
  expect_usage_error("estimate --tensor-parallel 2 --world-size 2 --seq 33",
                     "--seq 33 with --tensor-parallel 2 and sequence parallel");
  expect_usage_error("train --precision bf16-param", "bf16-params (FSDP2's");
  expect_usage_error("train --checkpointing op", "ops (per-op");
}

TEST(Cli, DeviceCudaIsAnErrorOnlyWithoutAGpu) {
  const Result r = run("train --device cuda --steps 1 --batch 1 --seq 8 --set num_hidden_layers=1 --quiet");
  if (cuda_available()) {
    EXPECT_EQ(r.code, 0) << r.err;
  } else {
    EXPECT_EQ(r.code, 2);
    EXPECT_THAT(r.err, HasSubstr("no CUDA device is available here; use --device cpu"));
  }
}

TEST(Cli, JsonPrintsExactlyOneObjectAndTomlIsOverriddenByFlags) {
  TempDir dir;
  {
    std::ofstream f(dir.file("run.toml"));
    f << "model = \"tiny\"\nset = [\"num_hidden_layers=1\"]\nsteps = 50\nbatch = 2\nseq = 16\ndevice = \"cpu\"\n";
  }
  const Result r = run("train --config " + dir.file("run.toml") + " --steps 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(lines(r.out), 1u);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["steps"], 2);  // the flag beat the file's 50
  for (const char* key : {"params", "steps", "final_loss", "eval_loss", "tokens_per_s", "peak_bytes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_THAT(r.err, HasSubstr("step     2/2"));  // progress goes to stderr
}

TEST(Cli, OutOfMemoryExitsWith3AndReportsInJson) {
  const Result r = run("train --steps 2 --memory-budget 100MiB --no-guard --json");
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(lines(r.out), 1u);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["oom"]["happened"], true);
  EXPECT_EQ(j["oom"]["step"], 1);
  EXPECT_EQ(j["oom"]["budget_bytes"], 100 << 20);
  EXPECT_THAT(r.err, HasSubstr("in use by category"));
  expect_usage_error("train --memory-budget lots", "--memory-budget: 'lots' is not a size");
  expect_usage_error("train --inject-oom 2", "expected STEP:N");
}

TEST(Cli, FitPrintsTheContractAndNeedsABudgetOnCpu) {
  const Result r = run("fit --set num_hidden_layers=2 --seq 64 --memory-budget 60MiB --device cpu --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(lines(r.out), 1u);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["max_batch"].get<int64_t>(), 1);
  EXPECT_EQ(j["trials"].get<size_t>(), j["log"].size());
  for (const auto& t : j["log"]) {
    EXPECT_TRUE(t.contains("batch") && t.contains("fits") && t.contains("peak_bytes"));
    EXPECT_EQ(t["fits"].get<bool>(), t["batch"].get<int64_t>() <= j["max_batch"].get<int64_t>());
  }
  expect_usage_error("fit --device cpu", "fit on cpu needs --memory-budget SIZE");
  const Result none = run("fit --model small --memory-budget 50MiB --device cpu --json --quiet");
  EXPECT_EQ(none.code, 3);
  EXPECT_EQ(nlohmann::json::parse(none.out)["max_batch"], 0);
}

TEST(Cli, EstimateAndPlanPrintTheirContracts) {
  const Result e = run("estimate --set num_hidden_layers=2 --seq 64 --batch 4 --device cpu --json --quiet");
  ASSERT_EQ(e.code, 0) << e.err;
  const auto est = nlohmann::json::parse(e.out);
  for (const char* key : {"model", "peak_bytes", "peak_phase", "breakdown", "items", "phases"}) {
    EXPECT_TRUE(est.contains(key)) << key;
  }
  EXPECT_EQ(est["model"]["params"].get<int64_t>(), 3'033'344 - 2 * 725'504);  // tiny less two layers
  const Result over = run("estimate --seq 64 --batch 4 --device cpu --memory-budget 10MiB --json --quiet");
  EXPECT_EQ(over.code, 3);
  EXPECT_FALSE(nlohmann::json::parse(over.out)["fits"].get<bool>());

  const Result p =
      run("plan --set num_hidden_layers=2 --seq 64 --global-batch 8 --memory-budget 60MiB --device cpu "
          "--no-calibrate --json --quiet");
  ASSERT_EQ(p.code, 0) << p.err;
  const auto plans = nlohmann::json::parse(p.out)["plans"];
  ASSERT_FALSE(plans.empty());
  for (const auto& plan : plans) {
    for (const char* key : {"batch", "accum", "precision", "checkpointing", "optimizer", "attention",
                            "predicted_peak_bytes", "predicted_step_time_ratio"}) {
      EXPECT_TRUE(plan.contains(key)) << key;
    }
  }
  EXPECT_DOUBLE_EQ(plans[0]["predicted_step_time_ratio"].get<double>(), 1.0);
  expect_usage_error("plan --memory-budget 60MiB --device cpu", "--global-batch is required");
  const Result none = run("plan --global-batch 8 --memory-budget 1MiB --device cpu --no-calibrate");
  EXPECT_EQ(none.code, 3);
  EXPECT_EQ(lines(none.err), 1u) << none.err;
  EXPECT_THAT(none.err, HasSubstr("no plan fits 1.00 MiB"));
  expect_usage_error("train --plan manual", "--plan 'manual': accepted: auto");
}

// plan --world-size N predicts for N ranks without launching them: its calibration times one
// process (it once tried to train as one of N and stopped), and every shard level is a lever, with
// adafactor too.
TEST(Cli, PlanForSeveralRanksCalibratesAloneAndWeighsEveryShardLevel) {
  const Result p =
      run("plan --seq 32 --global-batch 4 --memory-budget 64MiB --device cpu --world-size 2 "
          "--optimizer adafactor --json --quiet");
  ASSERT_EQ(p.code, 0) << p.err;
  std::set<std::string> shards;
  const auto result = nlohmann::json::parse(p.out);
  for (const auto& plan : result["plans"]) {
    EXPECT_EQ(plan["world_size"], 2);
    shards.insert(plan["shard"].get<std::string>());
  }
  EXPECT_EQ(shards, (std::set<std::string>{"none", "optimizer", "gradients", "full"}));
}

TEST(Cli, HelpListsTheFlagsAndExitCodes) {
  const Result top = run("--help");
  EXPECT_EQ(top.code, 0);
  EXPECT_THAT(top.out, HasSubstr("3 does not fit: out of memory"));
  const Result train = run("train --help");
  EXPECT_EQ(train.code, 0);
  for (const char* flag : {"--model", "--set", "--steps", "--checkpoint", "--resume", "--metrics", "--config"}) {
    EXPECT_THAT(train.out, HasSubstr(flag));
  }
}

// A shell script's output (stdout and stderr together), for the tests that need processes side by
// side or signals.
std::string shell(const std::string& script) {
  TempDir dir;
  {
    std::ofstream f(dir.file("script.sh"));
    f << "H=" << HEADROOM_BINARY << "\n" << script;
  }
  std::string out;
  FILE* pipe = ::popen(("bash " + dir.file("script.sh") + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  ::pclose(pipe);
  return out;
}

// Ctrl-C (or SIGTERM) during training: the step in flight finishes, its checkpoint is written, no
// temp file is left, the exit code is 128 + the signal, and --resume continues from it.
TEST(Cli, AnInterruptSavesACheckpointAndExits130Or143) {
  TempDir dir;
  for (const auto& [signal, code] : {std::pair{"INT", 130}, std::pair{"TERM", 143}}) {
    const std::string ck = dir.file(std::string("ck-") + signal), m = dir.file(std::string("m-") + signal);
    const std::string out = shell(fmt::format(
        "$H train --steps 500 --set num_hidden_layers=1 --batch 2 --seq 32 --checkpoint {} --metrics {} --quiet &\n"
        "pid=$!\n"
        "while [ ! -s {} ]; do sleep 0.05; done\n"
        "kill -{} $pid\nwait $pid\necho \"rc=$?\"\nls -a {}\n",
        ck, m, m, signal, ck));
    EXPECT_THAT(out, HasSubstr(fmt::format("rc={}", code))) << out;
    EXPECT_THAT(out, ::testing::ContainsRegex("interrupted by SIG" + std::string(signal) +
                                              ".* after step [0-9]+; "
                                              "checkpoint saved in"))
        << out;
    EXPECT_THAT(out, HasSubstr("checkpoint.hrc")) << out;
    EXPECT_THAT(out, ::testing::Not(HasSubstr("checkpoint.hrc.tmp"))) << out;
    std::smatch m_step;
    ASSERT_TRUE(std::regex_search(out, m_step, std::regex("after step ([0-9]+)"))) << out;
    const int64_t step = std::stoll(m_step[1].str());
    const Result resumed = run(fmt::format(
        "train --steps 500 --stop-at {} --set num_hidden_layers=1 --batch 2 --seq 32 --resume {} --json --eval-rows 0",
        step + 1, ck));
    ASSERT_EQ(resumed.code, 0) << resumed.err;
    EXPECT_EQ(nlohmann::json::parse(resumed.out).at("steps"), step + 1);
  }
}

// Two runs writing one checkpoint directory would race; the second is refused, naming the first.
TEST(Cli, ASecondRunOnTheSameCheckpointDirectoryIsRefused) {
  TempDir dir;
  const std::string ck = dir.file("ck"), m = dir.file("m.jsonl");
  const std::string out = shell(fmt::format(
      "$H train --steps 500 --set num_hidden_layers=1 --batch 2 --seq 32 --checkpoint {} --metrics {} --quiet &\n"
      "pid=$!\n"
      "while [ ! -s {} ]; do sleep 0.05; done\n"
      "$H train --steps 2 --checkpoint {} --quiet; echo \"second rc=$?\"\n"
      "kill -TERM $pid; wait $pid\necho \"holder=$pid\"\n",
      ck, m, m, ck));
  EXPECT_THAT(out, HasSubstr("second rc=2")) << out;
  EXPECT_THAT(out, ::testing::ContainsRegex("is in use by process ([0-9]+) \\(another headroom run")) << out;
}

// Training that diverges is not a success: exit code 5, one line naming the step and the causes.
TEST(Cli, DivergedTrainingExits5NamingTheStep) {
  const Result r = run("train --steps 20 --lr 1e6 --grad-clip 0 --set num_hidden_layers=1 --batch 2 --seq 32 --json");
  EXPECT_EQ(r.code, 5) << r.err;
  EXPECT_THAT(r.err,
              ::testing::ContainsRegex("training diverged: the loss or the gradient norm is (nan|inf) at step [0-9]+"));
  EXPECT_THAT(r.err, HasSubstr("a learning rate too high (--lr)"));
  EXPECT_EQ(lines(r.out), 1u);
  EXPECT_EQ(nlohmann::json::parse(r.out).at("kind"), "diverged");
  expect_usage_error("train --set rope_theta=0", "the rotary base (rope_theta) must be positive, got 0");
}

// The machine's own memory running out (here: a data-segment limit of 2.5 GB, which a step of
// qwen2.5-0.5b's first layer at batch 8 x 256 exceeds) is an out-of-memory with a diagnosis and exit
// code 3, as a budget's is, not an internal error.
TEST(Cli, TheMachineRunningOutOfMemoryIsAnOomNotAnInternalError) {
  const std::string out = shell(
      "ulimit -d 2500000\n"
      "$H train --model qwen2.5-0.5b --set num_hidden_layers=1 --steps 1 --batch 8 --seq 256 --no-guard --quiet "
      "--eval-rows 0\necho \"rc=$?\"\n");
  EXPECT_THAT(out, HasSubstr("rc=3")) << out;
  EXPECT_THAT(out, HasSubstr("CPU out of memory (the machine's memory)")) << out;
  // Weights that cannot fit the machine at all are refused before allocating: llama-3.1-70b's
  // 70.55B float32 weights (263 GiB, more than the machines this runs on have).
  const Result big = run("train --model llama-3.1-70b --steps 1 --device cpu");
  EXPECT_EQ(big.code, 3) << big.err;
  EXPECT_THAT(big.err, HasSubstr("llama-3.1-70b's weights alone need 263 GiB (70553706496 parameters in Float)"));
}

}  // namespace
}  // namespace headroom

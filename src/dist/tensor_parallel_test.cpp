// Tensor parallel: a model split over T shares computes what the whole model does (in one process,
// a thread per share, their sums through an in-process collective), and training on 2 and 4 cpu
// ranks under torchrun (Gloo over loopback) against one process on the same global batch.
#include "dist/tensor_parallel_group.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <map>
#include <thread>
#include <utility>

#include "config/model_config.h"
#include "dist/data_parallel_testing.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/step_ops.h"
#include "util/error.h"

namespace headroom {
namespace {

using data_parallel_testing::launch;
using data_parallel_testing::torchrun_launch;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

// T shares in one process, a thread each: the sum (or max) of their tensors in share order, the same
// on every share; with `sequence`, sequence parallel's all-gather and reduce-scatter of flat chunks.
class LocalShares {
 public:
  explicit LocalShares(int n) : n_(n), slots_(static_cast<size_t>(n)), barrier_(n) {}
  TensorSlice slice(int rank, bool sequence = false) {
    TensorSlice s;
    s.rank = rank;
    s.ranks = n_;
    s.sequence = sequence;
    s.allreduce = [this, rank](at::Tensor& t, bool max) {
      const at::Tensor r = exchange(rank, t, [max](const at::Tensor& a, const at::Tensor& b) {
        return max ? at::maximum(a, b) : a + b;
      });
      t.copy_(r);
    };
    s.allgather = [this, rank](at::Tensor& out, at::Tensor& in) {
      slots_[static_cast<size_t>(rank)] = in.reshape({-1}).clone();
      barrier_.arrive_and_wait();
      const at::Tensor all = at::cat(slots_);
      barrier_.arrive_and_wait();
      out.view({-1}).copy_(all);
    };
    s.reduce_scatter = [this, rank](at::Tensor& out, at::Tensor& in) {
      const at::Tensor sum = exchange(rank, in.reshape({-1}), std::plus<at::Tensor>());
      out.view({-1}).copy_(sum.chunk(n_)[static_cast<size_t>(rank)]);
    };
    return s;
  }

 private:
  // Every share's `t` combined in share order, the same on every share.
  template <typename Combine>
  at::Tensor exchange(int rank, const at::Tensor& t, Combine combine) {
    slots_[static_cast<size_t>(rank)] = t.clone();
    barrier_.arrive_and_wait();
    at::Tensor r = slots_[0].clone();
    for (size_t k = 1; k < slots_.size(); ++k) r = combine(r, slots_[k]);
    barrier_.arrive_and_wait();
    return r;
  }

  int n_;
  std::vector<at::Tensor> slots_;
  std::barrier<> barrier_;
};

// The whole model's tensor `whole` from the shares' `parts` as Megatron lays them out, worked out
// from the shapes alone: equal shapes are replicas (each must be the whole); a fused q/k/v (gpt2's,
// key/value heads as many as query heads) is cut in thirds per share; shares whose sizes along the
// differing dimension add up to the whole's are its pieces in order; more than that are key/value
// heads replicated over T / kv consecutive shares. Returns the largest difference, or -1 when a
// share does not belong where it should.
double largest_gap(const std::string& name, const at::Tensor& whole, const std::vector<at::Tensor>& parts) {
  double worst = 0;
  auto gap = [&](const at::Tensor& a, const at::Tensor& b) {
    if (a.sizes() != b.sizes()) return -1.0;
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  };
  auto keep = [&](double g) { worst = g < 0 || worst < 0 ? -1 : std::max(worst, g); };
  if (parts[0].sizes() == whole.sizes()) {
    for (const at::Tensor& p : parts) keep(gap(p, whole));
    return worst;
  }
  int64_t dim = 0;
  while (parts[0].size(dim) == whole.size(dim)) ++dim;
  int64_t total = 0;
  for (const at::Tensor& p : parts) total += p.size(dim);
  if (name.find("attn.qkv.") != std::string::npos) {
    std::vector<at::Tensor> q, k, v;
    for (const at::Tensor& p : parts) {
      auto thirds = p.chunk(3, dim);
      q.push_back(thirds[0]);
      k.push_back(thirds[1]);
      v.push_back(thirds[2]);
    }
    return gap(at::cat({at::cat(q, dim), at::cat(k, dim), at::cat(v, dim)}, dim), whole);
  }
  if (total == whole.size(dim)) return gap(at::cat(parts, dim), whole);
  const auto copies = static_cast<int64_t>(parts.size()) * parts[0].size(dim) / whole.size(dim);
  for (size_t t = 0; t < parts.size(); ++t) {
    const int64_t size = parts[t].size(dim);
    keep(gap(parts[t], whole.narrow(dim, static_cast<int64_t>(t) / copies * size, size)));
  }
  return worst;
}

struct SplitCase {
  std::string model;
  std::vector<std::string> overrides;
  int shares;
  bool sequence = false;
};

// One layer of `k.model` split over its shares (threads), float32: each share's parameters are the
// whole model's of the same seed, cut; the loss is the whole model's; and after backward every
// share's gradients are the whole model's, cut, its replicas' equal to the whole's.
void expect_shares_compute_the_whole(const SplitCase& k);

// Qwen3's widths and vocabulary (tied, per-head q/k norms) split in two and, untied with 2 key/value
// heads, in four (each replicated on two shares); GPT-2's (fused q/k/v with biases, layer norms, learned
// positions, an odd vocabulary of 50257 split unevenly) in two.
TEST(TensorParallelModel, SharesComputeWhatTheWholeModelDoes) {
  for (const SplitCase& k : std::vector<SplitCase>{
           {"qwen3-0.6b", {"num_hidden_layers=1"}, 2},
           {"qwen3-0.6b", {"num_hidden_layers=1", "num_key_value_heads=2", "tie_word_embeddings=false"}, 4},
           {"gpt2", {"n_layer=1", "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"}, 2},
       }) {
    expect_shares_compute_the_whole(k);
  }
}

// The same with sequence parallel: the tokens between the blocks split over the shares, the
// replicated norms', biases' and positions' gradients summed over them.
TEST(TensorParallelModel, SequenceParallelSharesComputeWhatTheWholeModelDoes) {
  for (const SplitCase& k : std::vector<SplitCase>{
           {"qwen3-0.6b", {"num_hidden_layers=1", "num_key_value_heads=2", "tie_word_embeddings=false"}, 4, true},
           {"gpt2", {"n_layer=1", "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"}, 2, true},
       }) {
    expect_shares_compute_the_whole(k);
  }
}

void expect_shares_compute_the_whole(const SplitCase& k) {
  {
    SCOPED_TRACE(fmt::format("{} over {}{}", k.model, k.shares, k.sequence ? ", sequence parallel" : ""));
    const ModelConfig c = load_model_config(k.model, k.overrides);
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    const ForwardOptions o{AttentionPath::math, /*training=*/true};
    const at::Tensor ids = at::randint(c.vocab_size, {2, 16}, f32.dtype(at::kLong));
    const at::Tensor targets = at::randint(c.vocab_size, {2, 16}, f32.dtype(at::kLong));
    const CausalLM whole(c, f32, 11);
    const at::Tensor whole_loss = token_loss(whole.forward(ids, o), targets);
    whole_loss.backward();

    LocalShares shares(k.shares);
    std::vector<std::unique_ptr<CausalLM>> models(static_cast<size_t>(k.shares));
    std::vector<double> losses(static_cast<size_t>(k.shares));
    std::vector<std::thread> threads;
    for (int t = 0; t < k.shares; ++t) {
      threads.emplace_back([&, t] {
        ModelStage stage;
        stage.tensor = shares.slice(t, k.sequence);
        auto& m = models[static_cast<size_t>(t)];
        m = std::make_unique<CausalLM>(c, f32, 11, CausalLM::KeepParameter{}, Finetune{}, true, BaseWeights::dense,
                                       stage);
        const at::Tensor loss = model_loss(*m, ids, targets, o, LossSetting{});
        loss.backward();
        losses[static_cast<size_t>(t)] = loss.item<double>();
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < k.shares; ++t) {
      EXPECT_NEAR(losses[static_cast<size_t>(t)], whole_loss.item<double>(), 1e-5) << "share " << t;
    }
    for (size_t i = 0; i < whole.parameters().size(); ++i) {
      const NamedTensor& p = whole.parameters()[i];
      std::vector<at::Tensor> weights, grads;
      for (const auto& m : models) {
        ASSERT_EQ(m->parameters()[i].name, p.name);
        weights.push_back(m->parameters()[i].tensor.detach());
        grads.push_back(m->parameters()[i].tensor.grad());
      }
      EXPECT_EQ(largest_gap(p.name, p.tensor.detach(), weights), 0.0) << p.name;
      const double scale = p.tensor.grad().abs().max().item<double>();
      const double g = largest_gap(p.name, p.tensor.grad(), grads);
      EXPECT_GE(g, 0.0) << p.name;
      EXPECT_LE(g, 1e-4 * scale + 1e-9) << p.name << " (largest gradient " << scale << ")";
    }
  }
}

// What cannot be split is refused in one line naming what is accepted.
TEST(TensorParallelModel, ModelsThatDoNotSplitAreRefused) {
  const ModelConfig qwen = load_model_config("qwen3-0.6b", {"num_hidden_layers=1"});
  EXPECT_NO_THROW(check_tensor_parallel(qwen, 16));  // 8 key/value heads, each on 2 ranks
  EXPECT_THAT([&] { check_tensor_parallel(qwen, 3); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("16 attention heads do not split evenly")));
  const ModelConfig kv3 = load_model_config("qwen3-0.6b", {"num_hidden_layers=1", "num_key_value_heads=4",
                                                           "num_attention_heads=24", "head_dim=64"});
  EXPECT_NO_THROW(check_tensor_parallel(kv3, 8));
  EXPECT_THAT([&] { check_tensor_parallel(kv3, 6); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("neither split evenly over 6 ranks")));
  EXPECT_THAT([&] { check_tensor_parallel(load_model_config("qwen3-30b-a3b", {"num_hidden_layers=1"}), 2); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("a mixture of experts")));
  EXPECT_NE(kv_replication_note(qwen, 16).find("each on 2 of the 16"), std::string::npos);
  EXPECT_EQ(kv_replication_note(qwen, 8), "");
}

// Qwen3's widths and vocabulary (2 layers) on 2 tensor-parallel ranks and on 2 x 2 (data parallel
// over the shares, the optimizer state sharded; or the weights too, each share's slices gathered a
// layer at a time), against one process on the same global batch, Adam
// with clipping, two steps (the second with the optimizer's state): the final and held-out losses
// within 1e-4; each rank's peak in every step below the one process's and within 0.1% of its
// estimated step peak (estimate --world-size N --tensor-parallel 2). 16 tokens a row: the vocabulary's
// 155M-parameter matrix, not the tokens, is what the shares split.
TEST(TensorParallel, RanksTrainAsOneProcess) {
  const std::string shape = "--device cpu --model qwen3-0.6b --set num_hidden_layers=2 --seq 16 --accum 2";
  const std::string common = "train " + shape + " --steps 2 --eval-rows 4 --quiet --json --lr 0.001 --grad-clip 1";
  const auto alone = run_command(fmt::format("env OMP_NUM_THREADS=1 {} {} --batch 2", HEADROOM_BINARY, common));
  ASSERT_EQ(alone.code, 0) << alone.out;
  const auto a = nlohmann::json::parse(alone.out);
  struct Layout {
    int ranks;
    std::string flags;
  };
  for (const Layout& l : {Layout{2, "--tensor-parallel 2 --batch 2"},
                          Layout{4, "--tensor-parallel 2 --shard optimizer --batch 1"},
                          Layout{4, "--tensor-parallel 2 --shard full --batch 1"}}) {
    SCOPED_TRACE(l.flags);
    TempDir dir;
    const auto ranks = torchrun_launch(l.ranks, HEADROOM_BINARY,
                              fmt::format("{} {} --metrics {} 2>/dev/null", common, l.flags, dir.file("m.jsonl")));
    ASSERT_EQ(ranks.code, 0) << ranks.out;
    const auto p = nlohmann::json::parse(ranks.out.substr(ranks.out.find('{')));
    EXPECT_NEAR(p.at("final_loss").get<double>(), a.at("final_loss").get<double>(), 1e-4);
    EXPECT_NEAR(p.at("eval_loss").get<double>(), a.at("eval_loss").get<double>(), 1e-4);
    const auto estimated = run_command(
        fmt::format("{} estimate {} {} --world-size {} --json --quiet", HEADROOM_BINARY, shape, l.flags, l.ranks));
    ASSERT_EQ(estimated.code, 0) << estimated.out;
    // The step's peak (the metrics' is the step's; setup's, drawing each whole tensor before cutting
    // its share, is apart).
    const nlohmann::json phases = nlohmann::json::parse(estimated.out).at("phases");
    double predicted = 0;
    for (const auto& bytes : phases) predicted = std::max(predicted, bytes.get<double>());
    for (int r = 0; r < l.ranks; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const auto steps = read_jsonl(r == 0 ? dir.file("m.jsonl") : dir.file(fmt::format("m.rank{}.jsonl", r)));
      ASSERT_EQ(steps.size(), 2u);
      for (const auto& step : steps) {
        const auto measured = step.at("peak_bytes").get<double>();
        EXPECT_LT(measured, a.at("peak_bytes").get<double>());
        EXPECT_NEAR(predicted, measured, measured * 1e-3);
      }
    }
  }
}

// Sequence parallel: Qwen3-0.6B's widths (hidden 1024) on 2 tensor-parallel ranks, 128 tokens a
// micro-batch. What a layer keeps from its forward to its backward is read off the measured forward
// (its live bytes at the end, less at the start) at 4 layers and at 2: the difference is 2 layers'.
// Checkpointing every layer, a layer keeps its input and the random state: with sequence parallel
// the input is half of the tokens, [B, T/2, hidden] in float32, where without it each rank keeps all
// of them — by hand, 512 KiB against 1 MiB a layer. Without checkpointing the residual stream and the
// norms' inputs are halved too (the gathered inputs of the projections are kept whole, as torch's
// SequenceParallel keeps them): less kept, by less than half. Each run's rank peak is its estimate
// within 0.1%, and the losses are those of the runs without sequence parallel (within 1e-5).
TEST(TensorParallel, SequenceParallelHalvesWhatACheckpointedLayerKeeps) {
  const int64_t tokens = 2 * 64, hidden = 1024;
  const int64_t rng = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  auto run = [](const std::string& flags) {
    TempDir dir;
    const std::string args = fmt::format(
        "train --device cpu --model qwen3-0.6b --seq 64 --batch 2 --optimizer sgd --steps 2 --eval-rows 0 --quiet "
        "--json --tensor-parallel 2 {} --metrics {} 2>/dev/null",
        flags, dir.file("m.jsonl"));
    const auto r = launch(2, HEADROOM_BINARY, args);
    EXPECT_EQ(r.code, 0) << r.out;
    const auto steps = read_jsonl(dir.file("m.jsonl"));
    EXPECT_EQ(steps.size(), 2u);
    const nlohmann::json& forward = steps.back().at("phases").at("forward");
    const auto estimated = run_command(fmt::format(
        "{} estimate --device cpu --model qwen3-0.6b --seq 64 --batch 2 --optimizer sgd --tensor-parallel 2 "
        "--world-size 2 {} --json --quiet",
        HEADROOM_BINARY, flags));
    EXPECT_EQ(estimated.code, 0) << estimated.out;
    const nlohmann::json estimate = nlohmann::json::parse(estimated.out);  // kept: the loop reads into it
    double predicted = 0;
    for (const auto& bytes : estimate.at("phases")) predicted = std::max(predicted, bytes.get<double>());
    const auto measured = steps.back().at("peak_bytes").get<double>();
    EXPECT_NEAR(predicted, measured, measured * 1e-3) << flags;
    const auto loss = nlohmann::json::parse(r.out.substr(r.out.find('{'))).at("final_loss").get<double>();
    return std::pair{forward.at("live_out").get<int64_t>() - forward.at("live_in").get<int64_t>(), loss};
  };
  auto per_layer = [&](const std::string& flags) {
    const auto [four, loss4] = run(flags + " --set num_hidden_layers=4");
    const auto [two, loss2] = run(flags + " --set num_hidden_layers=2");
    return std::tuple{(four - two) / 2, loss4, loss2};
  };
  const auto [split, split4, split2] = per_layer("--checkpointing full");
  const auto [whole, whole4, whole2] = per_layer("--checkpointing full --sequence-parallel=false");
  EXPECT_EQ(split, tokens / 2 * hidden * 4 + rng);
  EXPECT_EQ(whole, tokens * hidden * 4 + rng);
  EXPECT_NEAR(split4, whole4, 1e-5);
  EXPECT_NEAR(split2, whole2, 1e-5);
  const auto [kept, kept4, kept2] = per_layer("");
  const auto [all, all4, all2] = per_layer("--sequence-parallel=false");
  EXPECT_LT(kept, all);
  EXPECT_GT(kept, all / 2);
  std::printf("  a layer keeps, per rank: %lld B with sequence parallel, %lld B without (checkpointed: %lld, %lld)\n",
              static_cast<long long>(kept), static_cast<long long>(all), static_cast<long long>(split),
              static_cast<long long>(whole));
}

// GPT-2's widths and vocabulary (tied, 50257 rows split unevenly), 2 pipeline stages x 2 tensor-
// parallel shares on 4 ranks, 4 micro-batches, against one process on the same global batch: the
// final and held-out losses within 1e-4; each rank's peak in every step below the one process's and
// within 0.1% of its stage's estimate (estimate --pipeline 2 --tensor-parallel 2, the share with
// the most vocabulary rows).
TEST(TensorParallel, TwoStagesOfTwoSharesMatchOneProcess) {
  const std::string shape =
      "--device cpu --model gpt2 --set n_layer=2 --set embd_pdrop=0 --set attn_pdrop=0 --set resid_pdrop=0 --seq 32 "
      "--batch 2 --accum 4";
  const std::string common = "train " + shape + " --steps 2 --eval-rows 4 --quiet --json --lr 0.001";
  TempDir dir;
  const auto ranks = launch(4, HEADROOM_BINARY,
                            fmt::format("{} --pipeline 2 --tensor-parallel 2 --metrics {} 2>/dev/null", common,
                                        dir.file("m.jsonl")));
  ASSERT_EQ(ranks.code, 0) << ranks.out;
  const auto alone = run_command(fmt::format("env OMP_NUM_THREADS=1 {} {}", HEADROOM_BINARY, common));
  ASSERT_EQ(alone.code, 0) << alone.out;
  const auto p = nlohmann::json::parse(ranks.out.substr(ranks.out.find('{'))), a = nlohmann::json::parse(alone.out);
  EXPECT_NEAR(p.at("final_loss").get<double>(), a.at("final_loss").get<double>(), 1e-4);
  EXPECT_NEAR(p.at("eval_loss").get<double>(), a.at("eval_loss").get<double>(), 1e-4);
  const auto estimated = run_command(fmt::format("{} estimate {} --pipeline 2 --tensor-parallel 2 --world-size 4 "
                                                 "--json --quiet",
                                                 HEADROOM_BINARY, shape));
  ASSERT_EQ(estimated.code, 0) << estimated.out;
  const auto stages = nlohmann::json::parse(estimated.out).at("pipeline").at("stages");
  ASSERT_EQ(stages.size(), 2u);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(fmt::format("rank {} (stage {}, share {})", r, r / 2, r % 2));
    const auto predicted = stages[static_cast<size_t>(r / 2)].at("peak_bytes").get<double>();
    const auto steps = read_jsonl(r == 0 ? dir.file("m.jsonl") : dir.file(fmt::format("m.rank{}.jsonl", r)));
    ASSERT_EQ(steps.size(), 2u);
    for (const auto& step : steps) {
      const auto measured = step.at("peak_bytes").get<double>();
      EXPECT_LT(measured, a.at("peak_bytes").get<double>());
      EXPECT_NEAR(predicted, measured, measured * 1e-3);
    }
  }
}

// A run split over 2 ranks (2 tensor-parallel shares; 2 pipeline stages) or 4 (both; or either with
// 2 data-parallel ranks at --shard full) stopped at step 2 with --checkpoint and resumed to step 4
// ends where the same run without a stop does, bit for bit (each rank's file holds its share's or
// stage's weights and optimizer state, or its slices of them); resuming it in another layout, or in
// one process, is refused in one line.
TEST(TensorParallel, ACheckpointResumesInTheLayoutThatSavedIt) {
  const std::string common = fmt::format(
      "train --device cpu --model tiny --seq 32 --batch 2 --accum 2 --eval-rows 0 --quiet --json --steps 4");
  auto final_loss = [](const testing::CommandResult& r) {
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.rfind("\n{") + 1)).at("final_loss").get<double>();
  };
  struct Layout {
    int ranks;
    std::string flags, saved, shard = "none";
  };
  for (const Layout& l :
       {Layout{2, "--tensor-parallel 2", "--tensor-parallel 2"},
        Layout{2, "--pipeline 2", "--pipeline 2 --pipeline-split 0:2,2:4"},
        Layout{4, "--pipeline 2 --tensor-parallel 2", "--pipeline 2 --pipeline-split 0:2,2:4 --tensor-parallel 2"},
        Layout{4, "--pipeline 2 --shard full", "--pipeline 2 --pipeline-split 0:2,2:4", "full"},
        Layout{4, "--tensor-parallel 2 --shard full", "--tensor-parallel 2", "full"}}) {
    SCOPED_TRACE(l.flags);
    TempDir dir;
    const double straight = final_loss(launch(l.ranks, HEADROOM_BINARY, common + " " + l.flags + " 2>/dev/null"));
    const auto stopped = launch(l.ranks, HEADROOM_BINARY,
                                fmt::format("{} {} --stop-at 2 --checkpoint {} 2>/dev/null", common, l.flags,
                                            dir.file("ck")));
    ASSERT_EQ(stopped.code, 0) << stopped.out;
    const double resumed = final_loss(
        launch(l.ranks, HEADROOM_BINARY, fmt::format("{} {} --resume {} 2>/dev/null", common, l.flags, dir.file("ck"))));
    EXPECT_EQ(resumed, straight);
    const auto other = launch(2, HEADROOM_BINARY, fmt::format("{} --resume {}", common, dir.file("ck")));
    EXPECT_NE(other.code, 0);
    EXPECT_THAT(other.out, ::testing::HasSubstr("resumes only in the layout that saved it"));
    const auto alone = run_command(fmt::format("{} {} --resume {} 2>&1", HEADROOM_BINARY, common, dir.file("ck")));
    EXPECT_EQ(alone.code, kExitUsage);
    EXPECT_THAT(alone.out,
                ::testing::HasSubstr(fmt::format("was saved by {} ranks with {} --shard {}", l.ranks, l.saved, l.shard)));
  }
}

// A Hugging Face checkpoint of the whole model (GPT-2's widths and vocabulary, written by one
// process after a step at a high learning rate, so it is not the seed's initialisation) loaded with
// --weights into 2 stages x 2 shares, tied, and into 2 shares, untied: each rank reads its stage's
// tensors and cuts its share (fused q/k/v, the vocabulary split unevenly). Two steps from it end where
// one process loading it does (final and held-out losses within 1e-4), and away from a run that does
// not load it.
TEST(TensorParallel, AWholeCheckpointLoadsIntoStagesAndShares) {
  const std::string gpt2 =
      "train --device cpu --model gpt2 --set n_layer=2 --set embd_pdrop=0 --set attn_pdrop=0 --set resid_pdrop=0 "
      "--seq 32 --quiet";
  auto losses = [](const testing::CommandResult& r) {
    EXPECT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind("\n{") + 1));
    return std::pair{j.at("final_loss").get<double>(), j.at("eval_loss").get<double>()};
  };
  struct Case {
    int ranks;
    std::string model, layout;
  };
  for (const Case& c : {Case{4, "", "--pipeline 2 --tensor-parallel 2"},
                        Case{2, "--set tie_word_embeddings=false", "--tensor-parallel 2"}}) {
    SCOPED_TRACE(c.layout + " " + c.model);
    TempDir dir;
    const auto saved = run_command(fmt::format("{} {} {} --batch 2 --steps 1 --lr 0.05 --eval-rows 0 --save-weights {}",
                                               HEADROOM_BINARY, gpt2, c.model, dir.file("hf")));
    ASSERT_EQ(saved.code, 0) << saved.out;
    const std::string train =
        fmt::format("{} {} --batch 2 --accum 4 --steps 2 --lr 0.001 --eval-rows 4 --json", gpt2, c.model);
    const auto alone = losses(
        run_command(fmt::format("env OMP_NUM_THREADS=1 {} {} --weights {}", HEADROOM_BINARY, train, dir.file("hf"))));
    const auto split = losses(launch(c.ranks, HEADROOM_BINARY,
                                     fmt::format("{} {} --weights {} 2>/dev/null", train, c.layout, dir.file("hf"))));
    EXPECT_NEAR(split.first, alone.first, 1e-4);
    EXPECT_NEAR(split.second, alone.second, 1e-4);
    const auto drawn = losses(run_command(fmt::format("env OMP_NUM_THREADS=1 {} {}", HEADROOM_BINARY, train)));
    EXPECT_GT(std::abs(drawn.second - alone.second), 1e-2) << "the checkpoint changed nothing";
  }
}

// One of two tensor-parallel ranks is killed once training runs: the other ends with one line
// saying so, well within its timeout.
TEST(TensorParallel, AKilledRankEndsTheOtherWithAnError) {
  const data_parallel_testing::PeerLoss r = data_parallel_testing::lose_peer("--tensor-parallel 2", "KILL");
  ASSERT_GE(r.ms, 0) << r.script_out;
  EXPECT_EQ(r.rc, kExitUsage) << r.err;
  EXPECT_LT(r.ms, 40'000) << "the 10 s timeout (and the time to report) was not kept";
  EXPECT_THAT(r.err, ::testing::HasSubstr("rank 0: lost contact with"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// Layouts that cannot work are refused before anything trains, in one line each.
TEST(TensorParallel, ImpossibleLayoutsAreRefused) {
  const std::string base = "train --device cpu --model tiny --steps 1 --eval-rows 0 --quiet";
  struct Case {
    int ranks;
    std::string flags, says;
  };
  for (const Case& c : std::vector<Case>{
           {2, "--tensor-parallel 3", "--tensor-parallel 3 needs a multiple of 3 ranks"},
           {2, "--tensor-parallel 2 --shard optimizer", "--shard optimizer with --tensor-parallel 2 on 2 ranks"},
           {2, "--tensor-parallel 2 --pipeline 2", "--pipeline 2 x --tensor-parallel 2 needs a multiple of 4 ranks"},
           {2, "--tensor-parallel 2 --optimizer adafactor", "--optimizer adafactor with --tensor-parallel"},
           {2, "--tensor-parallel 2 --seq 31", "--seq 31 with --tensor-parallel 2 and sequence parallel"},
           {2, "--tensor-parallel 2 --save-weights " + TempDir().path(), "--save-weights with --tensor-parallel"},
       }) {
    SCOPED_TRACE(c.flags);
    const auto r = launch(c.ranks, HEADROOM_BINARY,
                          base + " " + c.flags + (c.flags.find("--seq") == std::string::npos ? " --seq 32" : ""));
    EXPECT_NE(r.code, 0);
    EXPECT_THAT(r.out, ::testing::HasSubstr(c.says));
  }
}

}  // namespace
}  // namespace headroom

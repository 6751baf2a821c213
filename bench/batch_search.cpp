// `headroom fit` (seeded by the estimator; and without it, from the measured line of batches 2 and 4)
// against the batch-size finders people use today, over the same real trial steps:
//   lightning-power      Lightning's BatchSizeFinder, mode "power": start at 2, double while it fits
//   lightning-binsearch  mode "binsearch": double until it fails, then bisect
//   accelerate-halving   Accelerate's find_executable_batch_size: start at 128, halve until it fits
// (each implemented from its published description). The true maximum comes from an exhaustive
// scan. Trials are memoised per configuration, so every strategy sees identical outcomes, and each
// is charged for every trial it asks for. Prints one row per configuration and a summary.
//   build/bench_batch_search
#include "train/batch_search.h"

#include <fmt/format.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "util/size.h"

using namespace headroom;

namespace {

struct Outcome {
  int64_t found = 0;
  int trials = 0;
};

using Probe = std::function<bool(int64_t)>;  // fits?

Outcome lightning_power(const Probe& fits, int64_t limit) {
  Outcome o;
  int64_t b = 2, last = 0;
  while (b <= limit) {
    ++o.trials;
    if (!fits(b)) break;
    last = b;
    b *= 2;
  }
  o.found = last;
  return o;
}

Outcome lightning_binsearch(const Probe& fits, int64_t limit) {
  Outcome o;
  int64_t low = 0, high = 0, b = 2;
  while (b >= 1 && b <= limit) {
    ++o.trials;
    if (fits(b)) {
      low = b;
      if (high && high - low <= 1) break;
      b = high ? (low + high) / 2 : b * 2;
    } else {
      high = b;
      if (high - low <= 1) break;
      b = (low + high) / 2;
    }
  }
  o.found = low;
  return o;
}

Outcome accelerate_halving(const Probe& fits, int64_t /*limit*/) {
  Outcome o;
  for (int64_t b = 128; b >= 1; b /= 2) {
    ++o.trials;
    if (fits(b)) {
      o.found = b;
      break;
    }
  }
  return o;
}

struct Config {
  std::string label;
  RunConfig run;
};

RunConfig make(const std::string& model, std::vector<std::string> set, int64_t seq, const std::string& budget) {
  RunConfig c;
  c.model = model;
  c.overrides = std::move(set);
  c.seq = seq;
  c.device = "cpu";
  c.memory_budget = parse_size(budget, "budget");
  return c;
}

}  // namespace

int main() {
  const int64_t limit = 512;
  std::vector<Config> configs = {
      {"tiny L2 seq64 60MiB", make("tiny", {"num_hidden_layers=2"}, 64, "60MiB")},
      {"tiny L2 seq128 80MiB", make("tiny", {"num_hidden_layers=2"}, 128, "80MiB")},
      {"tiny L4 seq128 150MiB", make("tiny", {}, 128, "150MiB")},
      {"tiny L4 seq256 200MiB", make("tiny", {}, 256, "200MiB")},
      {"tiny L2 seq64 math 70MiB", make("tiny", {"num_hidden_layers=2"}, 64, "70MiB")},
      {"tiny L2 seq128 sgd 40MiB", make("tiny", {"num_hidden_layers=2"}, 128, "40MiB")},
      {"tiny L2 seq128 ckpt-full 60MiB", make("tiny", {"num_hidden_layers=2"}, 128, "60MiB")},
      {"gpt2-128x2 seq128 60MiB",
       make("gpt2", {"n_layer=2", "n_embd=128", "n_head=4", "vocab_size=256"}, 128, "60MiB")},
      {"pythia-128x2 seq128 60MiB", make("pythia-160m",
                                         {"hidden_size=128", "num_attention_heads=4", "num_hidden_layers=2",
                                          "intermediate_size=512", "vocab_size=256"},
                                         128, "60MiB")},
      {"qwen2-128x2 seq256 90MiB",
       make("qwen2.5-0.5b",
            {"hidden_size=128", "num_attention_heads=4", "num_key_value_heads=2", "num_hidden_layers=2",
             "intermediate_size=256", "vocab_size=256", "head_dim=32"},
            256, "90MiB")},
      {"tiny L1 seq512 100MiB", make("tiny", {"num_hidden_layers=1"}, 512, "100MiB")},
  };
  configs[4].run.attention = AttentionPath::math;
  configs[5].run.optimizer = OptimizerKind::sgd;
  configs[6].run.checkpointing = parse_checkpoint_policy("full");

  const std::vector<std::string> names = {"headroom-fit", "headroom-line", "lightning-power", "lightning-binsearch",
                                          "accelerate-halving"};
  std::map<std::string, int> total_trials, exact;
  fmt::print("{:<32} {:>5} | {:>14} {:>14} {:>18} {:>20} {:>19}\n", "configuration", "true", "headroom-fit",
             "headroom-line", "lightning-power", "lightning-binsearch", "accelerate-halving");
  fmt::print("{:<32} {:>5} | {:>14} {:>14} {:>18} {:>20} {:>19}\n", "", "max", "found/trials", "found/trials",
             "found/trials", "found/trials", "found/trials");
  for (const Config& c : configs) {
    std::map<int64_t, Trial> memo;
    auto trial = [&](int64_t b) {
      auto it = memo.find(b);
      if (it == memo.end()) it = memo.emplace(b, trial_step(c.run, b)).first;
      return it->second;
    };
    int64_t truth = 0;
    while (truth < limit && trial(truth + 1).fits) ++truth;  // exhaustive scan

    const int64_t budget = *c.run.memory_budget;
    std::vector<Outcome> results;
    const FitResult seeded = search_max_batch(trial, budget, limit, peak_predictor(c.run));
    results.push_back({seeded.max_batch, static_cast<int>(seeded.log.size())});
    const FitResult line = search_max_batch(trial, budget, limit);
    results.push_back({line.max_batch, static_cast<int>(line.log.size())});
    const Probe fits = [&](int64_t b) { return trial(b).fits; };
    results.push_back(lightning_power(fits, limit));
    results.push_back(lightning_binsearch(fits, limit));
    results.push_back(accelerate_halving(fits, limit));
    std::string row = fmt::format("{:<32} {:>5} |", c.label, truth);
    const int widths[] = {14, 14, 18, 20, 19};
    for (size_t i = 0; i < results.size(); ++i) {
      total_trials[names[i]] += results[i].trials;
      if (results[i].found == truth) exact[names[i]] += 1;
      row += fmt::format(
          " {:>{}}", fmt::format("{}{}/{}", results[i].found == truth ? "" : "*", results[i].found, results[i].trials),
          widths[i]);
    }
    fmt::print("{}\n", row);
  }
  fmt::print("\n* = not the true maximum\n");
  for (const auto& n : names) {
    fmt::print("{:<20} true maximum {:>2}/{} times, {:.2f} trials on average\n", n, exact[n], configs.size(),
               static_cast<double>(total_trials[n]) / static_cast<double>(configs.size()));
  }
  return 0;
}

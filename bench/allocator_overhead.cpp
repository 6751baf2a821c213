// What headroom's memory accounting costs: training step time of `tiny` (and `small`) on CPU with
// the budget allocator counting and recording every allocation, versus passing straight through to
// LibTorch's allocator, in one process, runs interleaved (off, on, off, on, ...) so that drift in the
// machine's speed hits both alike. Prints each run and the ratio of medians. Target: under 3%.
//   build/bench_allocator_overhead [rounds=5] [preset=tiny]
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "memory/budget_allocator.h"
#include "train/trainer.h"
#include "util/stats.h"

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::string preset = argc > 2 ? argv[2] : "tiny";
  headroom::RunConfig cfg;
  cfg.model = preset;
  cfg.steps = 15;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 8;
  auto& allocator = headroom::BudgetAllocator::install();
  std::vector<double> off, on;
  fmt::print("allocator overhead: {} x {} steps of {} (batch {}, seq {}), interleaved\n", rounds, cfg.steps, preset,
             cfg.batch, cfg.seq);
  for (int r = 0; r < rounds; ++r) {
    for (bool accounting : {false, true}) {
      allocator.set_accounting(accounting);
      const auto s = headroom::train(cfg).summary;
      const double step_s = static_cast<double>(cfg.batch * cfg.seq) / s.tokens_per_s;
      (accounting ? on : off).push_back(step_s);
      fmt::print("  round {} accounting {:<3}  {:.1f} ms/step\n", r + 1, accounting ? "on" : "off", 1e3 * step_s);
    }
  }
  allocator.set_accounting(true);
  using headroom::median;
  const double ratio = median(on) / median(off);
  fmt::print("median step time: off {:.1f} ms, on {:.1f} ms; on/off = {:.4f} ({:+.2f}%)\n", 1e3 * median(off),
             1e3 * median(on), ratio, 100 * (ratio - 1));
  return 0;
}

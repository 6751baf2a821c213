// Training throughput on CPU: tokens per second of the real trainer (train/trainer.h) for the
// `tiny` and `small` presets, the baseline later work and a plain PyTorch loop are compared with.
// Each run trains a fixed number of steps (the first excluded as warm-up is not needed: the figure
// counts step time only, and 20 steps amortise the first).
//   build/bench_train_throughput [--benchmark_filter=tiny]
#include <benchmark/benchmark.h>

#include "train/trainer.h"

namespace {

void train_preset(benchmark::State& state, const char* preset, int64_t batch, int64_t seq) {
  headroom::RunConfig cfg;
  cfg.model = preset;
  cfg.steps = 20;
  cfg.batch = batch;
  cfg.seq = seq;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 8;
  double tokens_per_s = 0;
  for (auto _ : state) tokens_per_s = headroom::train(cfg).summary.tokens_per_s;
  state.counters["tokens_per_s"] = tokens_per_s;
  state.counters["batch"] = static_cast<double>(batch);
  state.counters["seq"] = static_cast<double>(seq);
}

}  // namespace

BENCHMARK_CAPTURE(train_preset, tiny, "tiny", 8, 128)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(train_preset, small, "small", 8, 128)->Iterations(1)->Unit(benchmark::kSecond);

BENCHMARK_MAIN();

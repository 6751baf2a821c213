// The default pipeline cut (estimate/pipeline_cut.h) on Llama-3.1-70B's shape: for each layout,
// the cut, its largest stage's estimated peak against the cut balancing parameters', and what
// finding it costs, as the planner estimates a layout (every_stage = false, cuda, its caching
// allocator): the estimate with the parameters' cut given against the estimate that balances.
//   build/bench_pipeline_cut [rounds=3]
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <vector>

#include "memory/allocator_config.h"
#include "dist/pipeline_schedule.h"
#include "estimate/estimator.h"
#include "estimate/pipeline_cut.h"
#include "util/size.h"
#include "util/stats.h"

int main(int argc, char** argv) {
  using namespace headroom;
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  const ModelConfig model = load_model_config("llama-3.1-70b", {});
  struct Layout {
    int64_t stages, tensor, data, micro, accum;
    ShardLevel shard;
    const char* checkpointing;
  };
  fmt::print("Llama-3.1-70B, seq 4096, bf16-mixed, AdamW, cuda; layout P x T x D, micro-batch x accum\n");
  fmt::print("{:<10} {:>9} {:<9} {:<5} {:>12} {:>12} {:>9} {:>9} {:>6}  {}\n", "layout", "micro", "shard", "ckpt",
             "by params", "balanced", "given ms", "default", "ratio", "cut");
  for (const Layout& l : {Layout{8, 2, 4, 1, 128, ShardLevel::optimizer, "full"},
                          Layout{4, 4, 4, 1, 128, ShardLevel::optimizer, "full"},
                          Layout{16, 1, 4, 1, 128, ShardLevel::optimizer, "full"},
                          Layout{8, 4, 2, 4, 64, ShardLevel::full, "full"},
                          Layout{8, 1, 1, 1, 64, ShardLevel::none, "selective"},
                          Layout{32, 2, 1, 1, 512, ShardLevel::none, "full"},
                          Layout{64, 1, 1, 1, 512, ShardLevel::none, "full"}}) {
    TrainSpec spec;
    spec.seq = 4096;
    spec.batch = l.micro;
    spec.accum = l.accum;
    spec.precision = Precision::bf16_mixed;
    spec.checkpointing = parse_checkpoint_policy(l.checkpointing);
    spec.world = l.data;
    spec.shard = l.shard;
    spec.tensor_parallel = l.tensor;
    spec.pipeline.stages = l.stages;
    spec.cuda = true;
    spec.caching = parse_allocator_config("", "bench");
    spec.every_stage = false;
    TrainSpec given = spec;
    given.pipeline.split = pipeline_stages(model, spec.pipeline);
    std::vector<double> given_ms, default_ms;
    Estimate by_params, balanced;
    for (int r = 0; r < rounds; ++r) {
      for (bool balance : {false, true}) {
        const auto t0 = std::chrono::steady_clock::now();
        Estimate e = estimate(model, balance ? spec : given);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        (balance ? default_ms : given_ms).push_back(ms);
        (balance ? balanced : by_params) = std::move(e);
      }
    }
    const double g = median(given_ms), d = median(default_ms);
    fmt::print("{:<10} {:>9} {:<9} {:<5} {:>12} {:>12} {:>9.0f} {:>9.0f} {:>6.2f}  {}\n",
               fmt::format("{}x{}x{}", l.stages, l.tensor, l.data), fmt::format("{}x{}", l.micro, l.accum),
               shard_level_name(l.shard), l.checkpointing, format_bytes(by_params.step_peak()),
               format_bytes(balanced.step_peak()), g, d, d / g, pipeline_split_text(balanced.cut));
  }
}

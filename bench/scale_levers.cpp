// The levers of the runs launched at scale, measured on the cpu and estimated at scale.
//
// 1. Per-op checkpointing and FSDP2's bf16 parameters on one process, at SmolLM-135M's widths and
//    vocabulary (6 layers, 4 x 256 tokens, AdamW): each setting's measured step peak (the budget
//    allocator's, step 2 of a real run) and median step time beside none / bf16-mixed, the estimate's
//    error, and the final loss.
// 2. torchtitan's published Llama 3.1 runs (H100, max reserved), estimated: the command line a user
//    gives, the allocated and reserved peaks headroom predicts, and the published figure beside.
//
//   build/bench_scale_levers
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "train/trainer.h"
#include "util/size.h"

using namespace headroom;

namespace {

void measured_levers() {
  struct Row {
    const char* label;
    Precision precision;
    const char* checkpointing;
  };
  const std::vector<Row> rows = {
      {"fp32, none", Precision::fp32, "none"},
      {"fp32, ops", Precision::fp32, "ops"},
      {"fp32, full", Precision::fp32, "full"},
      {"bf16-mixed, none", Precision::bf16_mixed, "none"},
      {"bf16-params, none", Precision::bf16_params, "none"},
      {"bf16-params, ops", Precision::bf16_params, "ops"},
  };
  std::printf("smollm-135m, 6 layers, batch 4 x seq 256, adamw, cpu, one process\n\n");
  std::printf("%-20s %14s %10s %10s %12s\n", "setting", "step peak", "estimate", "step s", "final loss");
  for (const Row& row : rows) {
    RunConfig cfg;
    cfg.model = "smollm-135m";
    cfg.overrides = {"num_hidden_layers=6"};
    cfg.batch = 4;
    cfg.seq = 256;
    cfg.precision = row.precision;
    cfg.checkpointing = parse_checkpoint_policy(row.checkpointing);
    cfg.device = "cpu";
    cfg.steps = 4;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    const TrainResult r = train(cfg);
    const StepRecord& s = r.steps.at(1);
    const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), train_spec(cfg));
    std::printf("%-20s %14lld %+9.4f%% %10.2f %12.6f\n", row.label, static_cast<long long>(s.peak_bytes),
                100.0 * static_cast<double>(e.peak_bytes - s.peak_bytes) / static_cast<double>(s.peak_bytes),
                r.median_step_seconds(), r.steps.back().loss);
  }
}

void published_runs() {
  struct Run {
    const char* what;
    const char* model;
    int64_t batch, world, tensor;
    const char* checkpointing;
    const char* published;
  };
  const std::vector<Run> runs = {
      {"Llama 3.1 8B, FSDP 8, per-op checkpointing", "llama-3.1-8b", 2, 8, 1, "ops", "82.4 GiB"},
      {"Llama 3.1 8B, FSDP 128, per-op checkpointing", "llama-3.1-8b", 2, 128, 1, "ops", "67.0 GiB"},
      {"Llama 3.1 70B, FSDP 32 x TP 8, full checkpointing", "llama-3.1-70b", 16, 256, 8, "full", "fits 96 GB"},
  };
  std::printf("\ntorchtitan's published runs (H100, seq 8192, max reserved) against headroom's estimate\n\n");
  for (const Run& run : runs) {
    RunConfig cfg;
    cfg.model = run.model;
    cfg.batch = run.batch;
    cfg.seq = 8192;
    cfg.device = "cuda";
    cfg.world_size = static_cast<int>(run.world);
    cfg.tensor_parallel = run.tensor;
    cfg.shard = ShardLevel::full;
    cfg.precision = Precision::bf16_params;
    cfg.checkpointing = parse_checkpoint_policy(run.checkpointing);
    TrainSpec spec = train_spec(cfg);
    if (!spec.caching) spec.caching = AllocatorConfig{};
    const auto start = std::chrono::steady_clock::now();
    const Estimate e = estimate(load_model_config(cfg.model), spec);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%-52s published %-11s estimate: allocated %10s, reserved %10s (%.0f ms)\n", run.what, run.published,
                format_bytes(e.peak_bytes).c_str(), format_bytes(e.reserved ? e.reserved->peak_reserved : 0).c_str(),
                ms);
    const std::string tensor = run.tensor > 1 ? fmt::format(" --tensor-parallel {}", run.tensor) : "";
    std::printf(
        "  headroom estimate --model %s --device cuda --batch %lld --seq 8192 --world-size %lld%s --shard full "
        "--precision bf16-params --checkpointing %s\n",
        run.model, static_cast<long long>(run.batch), static_cast<long long>(run.world), tensor.c_str(),
        run.checkpointing);
  }
}

}  // namespace

int main() {
  published_runs();
  std::printf("\n");
  measured_levers();
  return 0;
}

// The planner at scale: the bound-first search (what `headroom plan` runs beyond 2,000 candidates)
// against estimating every candidate (`--exhaustive`), in one run, on the cases of docs/benchmarks.md:
// Llama 3.1 8B on 16 ranks and 70B on 64 (both ways), 405B on 1024 x 80 GiB and 512 x 96 GiB (the
// search only: exhaustively they take tens of minutes). For each: the wall time, the candidates
// considered and estimated, and the best layout with its predicted peak and step time.
//
//   build/bench_plan_search [--no-exhaustive]
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "plan/planner.h"
#include "util/size.h"

using namespace headroom;

namespace {

struct Case {
  const char* model;
  int64_t world, global, seq;
  int64_t budget_gib;
  bool exhaustive;  // also every candidate estimated
  Precision precision = Precision::fp32;
};

PlanResult timed(const PlanRequest& r, double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  CostModel cost = CostModel::flops_only();
  cost.set_assumed_flops(r.assumed_flops);
  cost.set_link(r.link_bytes_per_second);
  cost.set_node_link(r.node_link_bytes_per_second);
  PlanResult out = r.best_only > 0 ? fastest_fitting_plans(r, cost) : fitting_plans(r);
  rank_plans(out, r, cost);
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

std::string best(const PlanResult& p) {
  if (p.plans.empty()) return "nothing fits";
  const Plan& b = p.plans.front();
  return fmt::format("{} x {} x {} (pipeline x tensor x data), {}; {} per rank, {:.4g} s a step",
                     b.pipeline.stages, b.tensor_parallel, b.world, b.describe(), format_bytes(b.predicted_peak_bytes),
                     b.predicted_step_seconds);
}

}  // namespace

int main(int argc, char** argv) {
  const bool exhaustive = !(argc > 1 && std::strcmp(argv[1], "--no-exhaustive") == 0);
  // The 70B case is docs/estimate-and-plan.md's (`--precision bf16-mixed --link-bytes-per-second 2.5e10`).
  const Case cases[] = {{"llama-3.1-8b", 16, 64, 2048, 80, true},
                        {"llama-3.1-70b", 64, 512, 4096, 80, true, Precision::bf16_mixed},
                        {"llama-3.1-405b", 1024, 2048, 8192, 80, false},
                        {"llama-3.1-405b", 512, 1024, 8192, 96, false}};
  fmt::print("| model | ranks | budget | search | candidates | estimated | wall | best |\n");
  fmt::print("| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |\n");
  for (const Case& c : cases) {
    PlanRequest r;
    r.base.model = c.model;
    r.base.seq = c.seq;
    r.base.device = "cuda";
    r.base.world_size = c.world;
    r.base.quiet = true;
    r.base.precision = c.precision;
    r.global_batch = c.global;
    r.budget = c.budget_gib << 30;
    r.assumed_flops = 4e14;              // an H100's realised bf16 rate
    r.link_bytes_per_second = 2.5e10;    // InfiniBand between nodes
    r.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int pass = 0; pass < (exhaustive && c.exhaustive ? 2 : 1); ++pass) {
      r.best_only = pass == 0 ? 10 : 0;
      double seconds = 0;
      const PlanResult p = timed(r, seconds);
      fmt::print("| {} | {} | {} GiB | {} | {} | {} | {:.1f} s | {} |\n", c.model, c.world, c.budget_gib,
                 pass == 0 ? "bound-first" : "every candidate", p.considered, p.estimated, seconds, best(p));
      std::fflush(stdout);
    }
  }
  return 0;
}

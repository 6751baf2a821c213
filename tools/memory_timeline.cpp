// memory_timeline — a development tool: runs `headroom train` for two steps and prints, for every
// top-level operator of step 2 (forward ops and autograd backward nodes), the live bytes after it and
// the peak inside it, from the budget allocator. It is how the estimator's phase timeline is checked
// against what LibTorch really holds, op by op.
//
//   build/headroom_memory_timeline [train flags...]     e.g. --model tiny --batch 2 --seq 32
#include <ATen/record_function.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "memory/budget_allocator.h"
#include "train/trainer.h"
#include "util/error.h"

namespace {

struct Row {
  std::string op;
  headroom::Phase phase;
  int64_t live_before, live_after, peak;
};

thread_local int depth = 0;
thread_local std::vector<int64_t> live_at_start;
int max_depth = 1;  // HEADROOM_TIMELINE_DEPTH: nested operators to show (1: top level only)
std::mutex rows_mutex;
std::vector<Row> rows;

bool recording() { return headroom::BudgetAllocator::install().context_step() == 1; }

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  if (depth++ < max_depth && recording()) {
    auto& a = headroom::BudgetAllocator::install();
    live_at_start.push_back(a.live_bytes());
    if (depth == 1) a.reset_peak();
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (--depth < max_depth && recording() && !live_at_start.empty()) {
    auto& a = headroom::BudgetAllocator::install();
    std::lock_guard lock(rows_mutex);
    rows.push_back({std::string(static_cast<size_t>(2 * depth), ' ') + fn.name(), a.context_phase(),
                    live_at_start.back(), a.live_bytes(), a.peak_bytes()});
    live_at_start.pop_back();
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* d = std::getenv("HEADROOM_TIMELINE_DEPTH")) max_depth = std::max(1, std::atoi(d));
  headroom::RunConfig cfg;
  cfg.steps = 2;
  cfg.eval_rows = 0;
  cfg.quiet = true;
  cfg.device = "cpu";
  const auto& fields = headroom::run_fields();
  try {
    for (int i = 1; i < argc; ++i) {
      std::string key = argv[i];
      if (key.rfind("--", 0) != 0) headroom::fail("expected --flag, got '{}'", key);
      key = key.substr(2);
      bool found = false;
      for (const auto& f : fields) {
        if (f.key != key) continue;
        found = true;
        if (f.kind == headroom::RunField::Kind::flag) {
          f.set(cfg, "true");
        } else {
          if (i + 1 >= argc) headroom::fail("--{} needs a value", key);
          f.set(cfg, argv[++i]);
        }
      }
      if (!found) headroom::fail("unknown flag --{}", key);
    }
    headroom::BudgetAllocator::install();
    at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                              .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    headroom::train(cfg);
  } catch (const std::exception& e) {
    fmt::print(stderr, "memory_timeline: {}\n", e.what());
    return 2;
  }
  int64_t top = 0;
  for (const auto& r : rows) top = std::max(top, r.peak);
  for (const auto& r : rows) {
    fmt::print("{:<10} {:<44} live {:>12} -> {:>12} ({:+11})  peak {:>12}{}\n", headroom::phase_name(r.phase), r.op,
               r.live_before, r.live_after, r.live_after - r.live_before, r.peak,
               r.peak == top ? "  <== step peak" : "");
  }
  return 0;
}

// Step observers — what a run does after each optimizer step besides training: save a checkpoint,
// evaluate held-out loss, write the metrics line, print progress. Each decides for itself whether
// to act at a step (every N steps and at the last one, every 2 s, ...), the way torchtitan's
// components do, and each exists only when its flag asks for it, so it costs nothing otherwise.
// The trainer calls them in the order make_observers() gives: the checkpoint first, so that a
// failure later in the step (evaluation) cannot cost the run its state, then evaluation (which adds
// eval_loss to the record), the metrics line, progress.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/run.h"
#include "train/step_record.h"

namespace headroom {

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // After optimizer step `record.step` (1-based) completed; `last`: it was the run's last. May add
  // to `record`.
  virtual void after_step(Run& run, StepRecord& record, bool last) = 0;
  // The run stops before its last step (an interrupt) after `last` completed.
  virtual void on_stop(Run& /*run*/, const StepRecord& /*last*/) {}
};

// Evaluation at the step's micro-batch (record.batch), so that a run whose micro-batch the OOM
// guard lowered evaluates in batches that fit too (should it still run out, it is skipped with a
// note): every --eval-every steps and at the last.
std::unique_ptr<StepObserver> eval_observer(int64_t every);
// --checkpoint DIR: every --checkpoint-every steps, at the last, and when the run is interrupted.
// (The trainer checks and locks DIR before it resumes from it or trains.)
std::unique_ptr<StepObserver> checkpoint_observer(const std::string& dir, int64_t every);
// --metrics FILE: one line per step; a resumed run keeps the lines up to `resumed_at`.
std::unique_ptr<StepObserver> metrics_observer(const std::string& path, std::optional<int64_t> resumed_at);
// Progress on stderr: the first step, then at most every 2 s, and the last; tokens/s and time left.
std::unique_ptr<StepObserver> progress_observer(int64_t start, int64_t end, int64_t total_steps);

// The file of rank `rank` for an output path: the path itself for rank 0 (and a lone process),
// "metrics.rank1.jsonl" for rank 1 of "metrics.jsonl".
std::string rank_file(const std::string& path, int rank);

// The observers `run`'s config asks for, in order, for a run that starts after step `start`
// (0, or where it resumed).
std::vector<std::unique_ptr<StepObserver>> make_observers(const Run& run, int64_t start,
                                                          std::optional<int64_t> resumed_at);

}  // namespace headroom

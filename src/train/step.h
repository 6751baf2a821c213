// The training step — one optimizer step of a Run, as five phases, each inside the memory monitor's
// scope for it:
//
//   for each micro-batch:  data (the rows, to the device) → forward (logits and the loss, under
//                          autocast) → backward (of the token-weighted loss, loss-scaled in fp16)
//   optimizer              (fp16: unscale, skip on inf/NaN) clip, update, loss scale
//   zero_grad              drop the gradients
//
// run_step() is exactly those calls; each phase is a function of its own so that other loops (the
// static-graph trial, evaluation) reuse them. A step that runs out of memory throws
// c10::OutOfMemoryError from whichever phase it was in; train/oom_guard.h decides what happens then.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "train/run.h"

namespace headroom {

// How one optimizer step's global batch is split: this rank's rows are
// [rank·rows, (rank+1)·rows) of the ranks·rows global ones, in micro-batches of `micro`.
struct StepShape {
  int64_t step = 0;   // 0-based optimizer step
  int64_t rows = 0;   // sequences per optimizer step on this rank, fixed for the run
  int64_t micro = 0;  // sequences per micro-batch
  int rank = 0, ranks = 1;
  int64_t accum() const { return (rows + micro - 1) / micro; }
};

// Thrown on every rank whose micro-batch went well when another rank's did not (data-parallel runs):
// `code` is the agreed outcome, which train/oom_guard.h defines.
struct PeerFailure {
  int code = 0;
};

// What a step did; filled as it runs, so that after an exception it says how far it got.
struct StepOutcome {
  double loss = 0;  // the global batch's mean token loss (token-weighted over micro-batches)
  double grad_norm = 0;
  bool skipped = false;         // fp16: an inf/NaN gradient skipped the update
  bool update_started = false;  // from here a failure may have changed parameters: not retryable
  bool agreed = false;          // data parallel: every micro-batch agreed; the update's collectives follow
};

struct MicroBatch {
  at::Tensor inputs, targets;  // on the run's device
  double weight = 0;           // its share of the global batch's tokens
};

// The five phases.
MicroBatch load_micro_batch(Run& run, const StepShape& shape, int64_t m);  // data
at::Tensor forward_loss(Run& run, const MicroBatch& batch);                // forward
void backward_loss(Run& run, const at::Tensor& loss, double weight);       // backward
void update(Run& run, double lr, StepOutcome& out);                        // optimizer
void clear_gradients(Run& run);                                            // zero_grad

// One optimizer step: seeds dropout from (seed, step), then the phases above. The monitor's step
// must have begun (MemoryMonitor::begin_step). `out` is filled as the step goes. With data-parallel
// ranks (Run::replicas) the ranks agree after each micro-batch, throwing PeerFailure when another
// failed; the loss is the global batch's, summed over the ranks.
void run_step(Run& run, const StepShape& shape, StepOutcome& out);

// --shard full, before the first step: a one-row micro-batch whose gradients are dropped, so that
// the ranks know the order of their collectives, which a rank that runs out of memory part-way
// must replay to the others (dist/data_parallel.h). Nothing to do otherwise, once done, or model
// parallel (an out-of-memory ends that rank).
void rehearse_collectives(Run& run, int64_t step);

// The mean token loss of up to --eval-rows held-out sequences, in batches of `rows`, without
// gradients; NaN with --eval-rows 0. With ranks, every rank evaluates and each batch's outcome is
// agreed: an out-of-memory on any of them throws c10::OutOfMemoryError on all.
double evaluate(Run& run, int64_t rows);

}  // namespace headroom

// The pipeline's training step and evaluation (--pipeline P, dist/pipeline.h): what train/step.h's
// run_step and evaluate do when the model's layers are cut into stages, one per rank.
//
// Every stage walks its own one_f_one_b() schedule over the step's micro-batches, inside the memory
// monitor's phases: data (the micro-batch's rows: the first stage uses its tokens, the last its
// targets), forward (receive the previous stage's output, run this stage's layers, send the output
// on; the last stage's loss), backward (receive the output's gradient, or start from the loss;
// send the input's gradient back). Then the update, over this stage's parameters, with the tied
// embedding's gradient, the global gradient norm and fp16's inf/NaN check shared between the stages.
// Dropout draws from (seed, step, stage), so a stage's masks are its own.
//
// An out-of-memory error on one stage cannot be recovered from together (the others are part-way
// through their schedules): the guard ends the run on that rank, and the others stop with an error
// when they lose contact with it.
#pragma once

#include <cstdint>

#include "train/run.h"
#include "train/step.h"

namespace headroom {

void run_pipeline_step(Run& run, const StepShape& shape, StepOutcome& out);

// The mean token loss of the held-out sequences, each batch's forward passed stage to stage without
// gradients; every stage returns it.
double evaluate_pipeline(Run& run, int64_t rows);

}  // namespace headroom

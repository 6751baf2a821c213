// MetricsLog — the --metrics JSONL file: one JSON object per optimizer step.
//
// Fields of each line:
//   step            optimizer steps completed (1-based)
//   loss            mean training loss of the step's global batch (token-weighted over micro-batches)
//   tokens          tokens in the step's global batch (all ranks')
//   rank            data-parallel runs (torchrun): the rank this file's memory figures are of; each
//                   rank writes its own file (rank 0 the --metrics path, rank R "NAME.rankR.EXT")
//   seconds         wall time of the step (data, forward, backward, optimizer)
//   peak_bytes      peak device memory during the step: on cpu, bytes allocated through LibTorch's
//                   CPU allocator (headroom's counting allocator); on cuda, the caching allocator's
//                   allocated bytes (not reserved)
//   live_bytes      device memory in use at the end of the step, same source
//   reserved_bytes, peak_reserved_bytes, peak_inactive_split_bytes
//                   with a caching allocator (cuda; cpu with --allocator caching): what it reserves
//                   after the step and at most during it, and the most free bytes inside split
//                   segments (fragmentation); absent with cpu's counting allocator
//   lr, grad_norm   learning rate used, global gradient norm before clipping
//   batch, accum    micro-batch size and micro-batches the step ran with
//   oom_recoveries  OOMs the guard absorbed during the step
//   peak_phase      the phase that held the step's peak (data, forward, backward, optimizer, zero_grad)
//   phases          per phase: live_in and live_out (bytes at entry and exit), peak (inside), and
//                   peak_reserved (caching allocators), breakdown: the peak by category — weights, gradients, optimizer, activations
//                   (and temporaries), other (live before the step and none of those)
//   skipped         true when fp16 loss scaling found an inf/NaN gradient and skipped the update
//   loss_scale      the fp16 loss scale after the step (fp16-mixed only)
//   eval_loss       held-out loss, on steps where it was evaluated
// Each line is flushed as written, so a crash loses at most the step in flight.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "train/step_record.h"

namespace headroom {

class MetricsLog {
 public:
  MetricsLog() = default;  // disabled: write() does nothing
  // Opens `path` for writing. When resuming after step `keep_through`, lines of steps up to it are
  // kept and later ones (from a run that went past its last checkpoint) are dropped.
  MetricsLog(const std::string& path, std::optional<int64_t> keep_through);

  void write(const StepRecord& record);

 private:
  std::ofstream out_;
  std::string path_;
};

}  // namespace headroom

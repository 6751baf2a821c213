// CostModel — the step time of a plan, relative to the others (lever 8's other half: what a lever
// costs in time).
//
// Work is counted in FLOPs: the matmuls (2 per weight and token forward, 4 backward), attention's
// two seq² products per head (causal flash skips about half), and what checkpointing recomputes
// (another forward of each checkpointed block). Time is a + b · FLOPs per micro-batch: `a`, the
// fixed cost of a micro-batch (dispatch, the loss, small-kernel inefficiency), and `b`, seconds per
// FLOP, differ by precision and device and are calibrated on this machine by timing real training
// steps of the model at two micro-batch sizes (the timer is passed in: the planner sits before the
// trainer in the data flow). A plan of k micro-batches costs k·a + b·ΣFLOPs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/precision.h"
#include "config/run_config.h"

namespace headroom {

// FLOPs of one micro-batch's forward and backward (with recompute) of `rows` sequences; a chunked
// loss recomputes the head's matmul in backward.
double micro_batch_flops(const ModelConfig& model, int64_t rows, int64_t seq, const CheckpointPolicy& checkpointing,
                         AttentionPath attention, bool chunked_loss = false);

struct StepTimeFit {
  double seconds_per_micro_batch = 0;  // a
  double seconds_per_flop = 0;         // b
};

class CostModel {
 public:
  // Seconds of a real step at a micro-batch in a precision, timed over some steps; nullopt when the
  // step ran out of memory (train/step_timing.h provides one).
  using StepTimer = std::function<std::optional<double>(Precision precision, int64_t rows, int timed_steps)>;
  // Bytes per second each way between the device and (pinned) host memory, measured on this
  // machine (train/step_timing.h provides one); nullopt when it could not be.
  using LinkTimer = std::function<std::optional<double>()>;
  // Times `base`'s model: in base's precision (or the first asked for) at micro-batches 1 and
  // `larger`, which splits fixed from per-FLOP cost; each other precision at `larger` only, scaling
  // both. nullopt when a timing step ran out of memory.
  static std::optional<CostModel> calibrate(const RunConfig& base, const std::vector<Precision>& precisions,
                                            int64_t larger, const StepTimer& time_step, int timed = 1);
  // `anchor` (calibrated in precision `measured`) extended to other precisions by measured ratios of
  // step time (theirs / the anchor's at the same micro-batch), as the doctor's lever trials give.
  static CostModel with_ratios(const CostModel& anchor, Precision measured, const std::map<Precision, double>& ratios);
  // Uncalibrated: FLOPs only (every precision the same speed, no per-micro-batch cost).
  static CostModel flops_only();

  // Seconds of one optimizer step of `global_rows` sequences as micro-batches of `micro` rows.
  double step_seconds(const ModelConfig& model, int64_t micro, int64_t global_rows, int64_t seq, Precision precision,
                      const CheckpointPolicy& checkpointing, AttentionPath attention, bool chunked_loss = false) const;
  // What offloading `bytes` of saved activations per micro-batch adds, for each of `micro_batches`:
  // down in forward and back in backward over the host link, less what compute hides. On cuda the
  // copies run beside the compute stream: the copies down behind the layers' forward
  // (`layers_forward_seconds` a micro-batch), the prefetches of all but the top layer (of `layers`)
  // behind backward (twice the forward); the top layer's copy back is not hidden. On the cpu (0
  // seconds given) nothing is: the whole round trip counts.
  double activation_offload_seconds(int64_t bytes, int64_t micro_batches, double layers_forward_seconds = 0,
                                    int64_t layers = 1) const;
  // Seconds of the layers' forward in one micro-batch (the head's matmul and the loss left out), by
  // the calibrated time per FLOP.
  double layers_forward_seconds(const ModelConfig& model, int64_t micro, int64_t seq, Precision precision,
                                AttentionPath attention) const;
  // The host link both offloads cross: measured (set_host_link) or, until then, assumed
  // (kHostLinkBytesPerSecond, a pinned PCIe 4 link's order).
  void set_host_link(double bytes_per_second);
  double host_link() const { return host_link_; }
  bool host_link_measured() const { return host_link_measured_; }
  // Seconds of one step's collectives on each of `world` ranks at `shard` with `accum` micro-batches:
  // the ring algorithms' bytes per rank — allreduce 2(N-1)/N of the gradients (none); reduce-scatter
  // (N-1)/N of them (once, or per micro-batch at gradients) and allgather (N-1)/N of the weights
  // (full: per micro-batch, for forward and again the layers' for backward) — over an assumed link (kLinkBytesPerSecond, not
  // measured), plus a fixed latency per collective (25 MiB buckets unsharded; two per parameter sharded). 0 for one
  // rank.
  double communication_seconds(const ModelConfig& model, Precision precision, int64_t world, ShardLevel shard,
                               int64_t accum) const;
  static constexpr double kLinkBytesPerSecond = 5e9;
  // Seconds a step's pipeline transfers add on the critical path of `stages` stages with
  // `micro_batches` micro-batches of `rows` x `seq`: each micro-batch's activations [rows, seq,
  // hidden] forward and their gradients back across each of the P - 1 boundaries, the 2(M + P - 2)
  // transfers that 1F1B cannot overlap with compute, at kLinkBytesPerSecond and a latency each. 0
  // for one stage.
  double pipeline_transfer_seconds(const ModelConfig& model, int64_t rows, int64_t seq, Precision precision,
                                   int64_t stages, int64_t micro_batches) const;
  // Seconds a step's tensor-parallel sums add on each of `ranks` ranks with `micro_batches`
  // micro-batches of `rows` x `seq`: per micro-batch, every layer's two block outputs summed in
  // forward and two inputs' gradients in backward, the embedding's sum and the head input's gradient
  // (4·layers + 2 ring allreduces of [rows, seq, hidden] in the activations' dtype, 2(T-1)/T of it
  // each way), and the loss's three per-token sums (latency), over the node's link
  // (kNodeLinkBytesPerSecond, assumed: tensor parallel stays inside a node). 0 for one rank.
  double tensor_parallel_seconds(const ModelConfig& model, int64_t rows, int64_t seq, Precision precision,
                                 int64_t ranks, int64_t micro_batches) const;
  static constexpr double kNodeLinkBytesPerSecond = 1.5e11;
  // What the state levers add to a step, over the update of the optimizer they replace (not
  // measured; assumed constants): adamw8bit's blockwise loop, kQuantisedUpdateSeconds per trained
  // parameter; an offloaded optimizer, its gradients copied to the host and its parameters back over
  // the host link, and its update on the host's cores at
  // kHostUpdateSeconds per parameter. 0 for neither.
  double state_lever_seconds(int64_t trainable_params, Precision precision, OptimizerKind optimizer,
                             Offload offload) const;
  static constexpr double kQuantisedUpdateSeconds = 4e-9;
  static constexpr double kHostLinkBytesPerSecond = 2e10;
  static constexpr double kHostUpdateSeconds = 2e-9;
  static constexpr double kCollectiveLatencySeconds = 50e-6;
  // Uncalibrated, a micro-batch's FLOPs at this rate (default 1e12 a second); and the link the
  // collectives and pipeline transfers cross, bytes a second each way per rank (default
  // kLinkBytesPerSecond). Both assumed, as given (plan --flops-per-second, --link-bytes-per-second).
  void set_assumed_flops(double per_second) { assumed_flops_ = per_second; }
  double assumed_flops() const { return assumed_flops_; }
  void set_link(double bytes_per_second) { link_ = bytes_per_second; }
  void set_node_link(double bytes_per_second) { node_link_ = bytes_per_second; }
  double node_link() const { return node_link_; }
  double link() const { return link_; }
  bool calibrated() const { return !fits_.empty(); }
  const std::map<Precision, StepTimeFit>& fits() const { return fits_; }

 private:
  std::map<Precision, StepTimeFit> fits_;
  double host_link_ = kHostLinkBytesPerSecond;
  double assumed_flops_ = 1e12;
  double link_ = kLinkBytesPerSecond;
  double node_link_ = kNodeLinkBytesPerSecond;
  bool host_link_measured_ = false;
};

}  // namespace headroom

// Pipeline — what a training step does differently when the model's layers are cut into stages, one
// per rank (lever 6, model parallelism), over a Communicator.
//
// Stage s holds its layers (config/pipeline_layout.h's stage_ranges), and only their weights,
// gradients and optimizer state; the first stage also the embeddings, the last the final norm, the
// head and the loss. A micro-batch's forward runs stage by stage: each sends its output [rows, seq,
// hidden] to the next, which receives it as a leaf that records its gradient. Backward runs the
// other way: the last stage from its loss, the others from the gradient of their output that the
// next stage sends back, each sending on the gradient of its own input. The order of forwards and
// backwards on each stage is dist/pipeline_schedule.h's one_f_one_b().
//
// With tied embeddings the last stage's head is its own copy of the embedding, drawn from the same
// seed: after the last backward the two copies' gradients are summed between the first and the last
// stage, so both take the same update and stay equal. The global gradient norm (clipping) and fp16's
// inf/NaN check are summed over the stages, the tied copy counted once. Not thread-safe; one per run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/pipeline_layout.h"
#include "dist/communicator.h"
#include "dist/pipeline_schedule.h"
#include "model/causal_lm.h"
#include "util/named_tensor.h"

namespace headroom {

class Pipeline {
 public:
  // `comm`: the pipeline's ranks, rank s holding stage s of `ranges`.
  Pipeline(Communicator& comm, std::vector<LayerRange> ranges, bool tied_embeddings);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  int64_t stage() const { return comm_.rank(); }
  int64_t stages() const { return static_cast<int64_t>(ranges_.size()); }
  bool first() const { return stage() == 0; }
  bool last() const { return stage() == stages() - 1; }
  const LayerRange& layers() const { return ranges_[static_cast<size_t>(stage())]; }
  const std::vector<LayerRange>& ranges() const { return ranges_; }
  // What this stage's model holds.
  ModelStage model_stage() const;

  // A micro-batch's activations to the next stage, its gradient back to the previous one.
  void send_forward(const at::Tensor& output);
  at::Tensor recv_forward(at::IntArrayRef shape, const at::TensorOptions& options);
  void send_backward(const at::Tensor& input_grad);
  at::Tensor recv_backward(at::IntArrayRef shape, const at::TensorOptions& options);
  // Waits for this stage's sends; at the end of each step's schedule.
  void finish_sends();

  // After the last backward: the tied embedding's gradient summed between its two copies. `params`:
  // what the optimizer updates, the parameters or (data parallel, sharded) this rank's slices of them,
  // whose .grad is the gradient it will use; the first and last stage's ranks of the same
  // data-parallel index hold the same slice.
  void reduce_tied(const std::vector<NamedTensor>& params);
  // Clips the global gradient norm over every stage to max_norm (<= 0: no clipping); the norm before.
  // The tied copy counts only on the first stage. `within`, when given, sums the squares over the
  // stage's other ranks first (data-parallel ranks holding slices of the gradients, tensor-parallel
  // shares); `share`, when given, is what each named parameter counts for (1 / its copies).
  double clip_grad_norm(const std::vector<NamedTensor>& params, double max_norm,
                        const std::function<void(at::Tensor&)>& within = {},
                        const std::function<double(const std::string&)>& share = {});
  double sum(double value);
  bool any(bool flag);

 private:
  Communicator& comm_;
  std::vector<LayerRange> ranges_;
  bool tied_ = false;
  std::unique_ptr<Communicator> ends_;  // tied embeddings: the first and the last stage
};

}  // namespace headroom

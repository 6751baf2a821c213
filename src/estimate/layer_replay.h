// LayerReplay — the model's forward on the operator models (estimate/ops.h), as CausalLM runs it:
// its parameters (their shapes from the trainer's own model class on the meta device, so they match
// the trainer's), and each family's layers operator by operator — the embeddings (learned positions
// or rotary tables), attention (fused or separate q, k, v; the attention path), the MLP (gated or
// not), the norms (layer norm or RMS norm), sequential or parallel residuals, the final norm and the
// head — with what each operator saves for backward and activation checkpointing's recompute (whole
// layers, or attention only).
//
// The step (estimate/step_replay.h) builds the model once and runs forward() per micro-batch. Under
// full sharding a ShardGate (model/parameter_gate.h's ParameterGate, on the simulation) holds the
// weights: the forward asks it for each unit before using it and says when it is done, and backward
// asks for a layer again before it backpropagates through it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "estimate/estimator.h"
#include "dist/pipeline_schedule.h"
#include "estimate/ops.h"
#include "model/causal_lm.h"

namespace headroom::replay {

// Units as CausalLM::parameter_units() numbers them: 0 the embeddings, final norm and head, 1 + i
// layer i.
class ShardGate {
 public:
  virtual ~ShardGate() = default;
  // The unit's parameters are all-gathered (a no-op while they are).
  virtual void gather(int unit) = 0;
  // The forward has finished with the unit; `recording`: gradients are being recorded.
  virtual void forward_done(int unit, bool recording) = 0;
  // While the model is built, each parameter in turn (CausalLM's KeepParameter): its slice kept.
  virtual void keep_slice(const std::string& name) = 0;
};

class LayerReplay : protected sim::Ops {
 public:
  LayerReplay(const ModelConfig& c, const TrainSpec& s);

 protected:
  // Full sharding: the parameters hold nothing between uses; `gate` gathers them. Before
  // construct_model().
  void set_gate(ShardGate* gate) { gate_ = gate; }
  // As CausalLM's constructor: the parameters in registration order, then their float32
  // initialisation copies, one at a time.
  void construct_model();
  // CausalLM::forward over `rows` sequences: the logits (`input`: as trunk's).
  sim::Tensor forward(int64_t rows, const sim::Tensor* input = nullptr);
  // CausalLM::hidden_states: the same without the head, the final norm's output. A pipeline stage's
  // (`stage_`): from `input` (the previous stage's output) when it has no embeddings, through its
  // layers, to the final norm only when it has the head.
  sim::Tensor trunk(int64_t rows, const sim::Tensor* input = nullptr);
  // The head's weight (the embedding's, when tied).
  const sim::Param& head();

  const ModelConfig& c_;
  const TrainSpec& s_;
  int ew_;  // parameter bytes, as the forward computes with them (bf16-params: the gathered bfloat16)
  int weights_, grads_;
  int expert_weights_ = -1, expert_grads_ = -1;  // a mixture of experts' (labels made when there are experts)
  int frozen_weights_ = -1;                      // --finetune: parameters without gradients
  int adapter_weights_ = -1, adapter_grads_ = -1;  // LoRA's adapters
  std::map<std::string, sim::Param> params_;
  std::vector<std::string> order_;    // parameter names in registration order
  std::shared_ptr<const CausalLM> shapes_;  // the model on the meta device (estimate/meta_models.h)
  ModelStage stage_;                  // --pipeline: the stage replayed (TrainSpec::stage); else the whole model
                                      // (--tensor-parallel: the last rank's share of it)
  int64_t heads_ = 0, kv_heads_ = 0;  // the attention heads and key/value heads the replayed rank holds

 private:
  // One of the model's parameters: its weight (by its kind's label) and, when it trains, its
  // gradient slot.
  void add_parameter(const NamedTensor& np);
  // The parameters' initialisation copies (or --weights' reads), in the model's order.
  void replay_initialisation();
  // The rotary tables: cos and sin, and the windowed layers' own (gemma3).
  struct Rope {
    sim::Tensor cos, sin, local_cos, local_sin;
  };
  // x through the projection whose weight is `weight`, and its LoRA adapter when it has one.
  sim::Tensor project(const sim::Tensor& x, const std::string& weight, const sim::Param* bias, int label);
  // A row-parallel projection (o, down) as CausalLM::project_out runs it.
  sim::Tensor project_out(const sim::Tensor& x, const std::string& weight, const sim::Param* bias, int label);
  sim::Tensor attention_block(int64_t layer, const sim::Tensor& x, const Rope& rope);
  sim::Tensor mlp_block(int64_t layer, const sim::Tensor& x);
  // One decoder layer; `selective`: its attention is checkpointed (the layer itself is not).
  sim::Tensor block(int64_t layer, const sim::Tensor& x, const Rope& rope, bool selective);
  // fn(x) under activation checkpointing: run without recording, recomputed in backward; with
  // `kept` (per-op checkpointing) the operators it keeps made current in both passes.
  sim::Tensor checkpointed(const std::function<sim::Tensor(const sim::Tensor&)>& fn, const sim::Tensor& x,
                           std::shared_ptr<sim::KeptOps> kept = nullptr);
  // fn(x) under per-op checkpointing (model/op_checkpoint.h): run without recording but for the
  // outputs the policy keeps; recomputed in backward, taking those back.
  sim::Tensor op_checkpointed(const std::function<sim::Tensor(const sim::Tensor&)>& fn, const sim::Tensor& x);
  // Sequence parallel (model/tensor_parallel.h): this rank's part of the tokens all-gathered into the
  // whole (backward: its gradient reduce-scattered), and a partial sum reduce-scattered into this
  // rank's part (backward: all-gathered), each with the collective's own buffers on Gloo.
  sim::Tensor gather_sequence(const sim::Tensor& part);
  sim::Tensor scatter_sequence(const sim::Tensor& partial);
  // A block's or the head's input as the rank's share computes on it (CausalLM::enter_share).
  sim::Tensor enter_share(const sim::Tensor& x) { return stage_.tensor.splits_sequence() ? gather_sequence(x) : x; }
  // An identity whose backward has the gate gather `unit` first.
  sim::Tensor gate_backward(const sim::Tensor& x, int unit);

  const sim::Param& p(const std::string& name) const;
  const sim::Param* maybe(const std::string& name) const;
  sim::Tensor norm(const sim::Tensor& x, const sim::Param& w, const sim::Param* b) {
    return c_.norm == NormKind::layer_norm ? layer_norm(x, w, b) : rms_norm(x, w, c_.norm_plus_one);
  }

  ShardGate* gate_ = nullptr;
};

}  // namespace headroom::replay

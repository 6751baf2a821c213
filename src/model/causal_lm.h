// CausalLM — a decoder-only Transformer language model built from a ModelConfig.
//
// One class, the decoder skeleton, covers every family; the config's switches (norm kind and
// placement, learned vs rotary positions and their bases, fused qkv or gate/up, q/k norms, gated MLP
// or experts (model/experts.h), parallel residual, biases, embedding scale, tied head) select the
// layout, so parameter counts equal Hugging Face's for the same config.json. Parameters are plain tensors with Hugging Face-like
// names, created with the given options: on the meta device nothing is allocated (a 70B model's
// parameters can be counted for free). Not thread-safe; one model per training run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "config/base_weights.h"
#include "config/finetune.h"
#include "config/model_config.h"
#include "model/attention.h"
#include "model/checkpointing.h"
#include "model/experts.h"
#include "model/lora.h"
#include "model/activation_offload.h"
#include "model/nf4.h"
#include "model/parameter_gate.h"
#include "model/rotary.h"
#include "model/tensor_parallel.h"
#include "util/named_tensor.h"

namespace headroom {

struct ForwardOptions {
  AttentionPath attention = AttentionPath::flash;
  bool training = true;         // dropout on
  CheckpointPolicy checkpoint;  // applies only while gradients are being recorded
  ParameterGate* gate = nullptr;  // ZeRO-3: where the parameters are kept between uses (null: in place)
  // --offload activations: what each layer saves goes to host memory (null: it stays)
  std::shared_ptr<ActivationOffload> offload;
};

// The part of the model a rank holds. A pipeline stage (dist/pipeline.h): layers [first, end), the
// embeddings (the first stage), the final norm and the head (the last; with tied embeddings its head
// is its own copy of the embedding). Tensor parallel (model/tensor_parallel.h): its share of each
// layer's matrices and of the vocabulary. The default is the whole model.
struct ModelStage {
  int64_t first = 0, end = -1;  // end -1: to the last layer
  bool embeddings = true, head = true;
  TensorSlice tensor;
  // The whole model of `layers` layers: from layer 0 to the last (`end` -1 as given, or the last
  // layer as CausalLM sets it), with the embeddings and the head, unsplit.
  bool whole(int64_t layers) const {
    return first == 0 && (end < 0 || end == layers) && embeddings && head && tensor.whole();
  }
};

class CausalLM {
 public:
  // Weights are initialised from `seed` as Hugging Face does (normal(0, initializer_range), biases
  // zero, norm weights one; gpt2's residual projections scaled by 1/sqrt(2 * layers)) on the CPU,
  // then moved to options.device(), so the same seed gives the same model on every device.
  // `keep` (ZeRO-3): called with each parameter once initialised, in registration order, after which
  // the parameter lets its memory go (device/storage_adapter.h) — what the callback keeps of it is
  // all that remains, and at most one parameter is ever whole.
  // `finetune` (config/finetune.h): which parameters require gradients; LoRA adds its adapters
  // after the model's own parameters (A Kaiming-uniform, B zeros, from the same generator, so that
  // the base weights are those of the same seed without LoRA). A freeze pattern that matches no
  // parameter is an Error.
  using KeepParameter = std::function<void(const NamedTensor&)>;
  // `initialise_base` false: the model's own parameters are left as allocated, for a checkpoint to
  // fill (model/hf_weights.h); LoRA's adapters are still drawn.
  // `base_weights` nf4 (LoRA only): every projection LoRA could adapt (model/lora.h's
  // adaptable_modules, targeted or not) is held in NF4 (model/nf4.h) as two parameters, "<weight>.nf4"
  // (the codes) and "<weight>.absmax", in the weight's place; initialised, it is drawn as the dense
  // weight would be, one at a time, then quantised, so a seed gives the same base either way.
  // `stage`: only that part's parameters are kept; every parameter is still drawn in order, so a
  // stage's weights are those of the whole model of the same seed.
  CausalLM(const ModelConfig& config, const at::TensorOptions& options, uint64_t seed, const KeepParameter& keep = {},
           const Finetune& finetune = {}, bool initialise_base = true, BaseWeights base_weights = BaseWeights::dense,
           const ModelStage& stage = {});

  // input_ids: [B, T] int64 with T <= max positions (a pipeline's last stage: the previous stage's
  // output [B, T, hidden]). Returns logits [B, T, vocab] in the parameters' dtype (tensor parallel:
  // [B, T, this rank's vocabulary rows]). `router`: a mixture of experts reports there the skew of
  // its routing and, when its config asks for it (output_router_logits) and gradients are recorded,
  // its load-balancing loss times router_aux_loss_coef (left undefined otherwise), which the caller
  // adds to the loss.
  at::Tensor forward(const at::Tensor& input_ids, const ForwardOptions& options, RouterOutput* router = nullptr) const;
  // The same forward without the head: the final norm's output [B, T, hidden], for a loss that
  // applies head_weight() itself (model/chunked_loss.h). Not with a ParameterGate when the model has
  // its head (the head's unit would stay gathered: forward() is that stage's). A pipeline stage's
  // forward: `input_ids` is the previous stage's output [B, T, hidden] when the stage has no
  // embeddings, and the result is its last layer's output when it has no head.
  at::Tensor hidden_states(const at::Tensor& input_ids, const ForwardOptions& options,
                           RouterOutput* router = nullptr) const;
  // The LM head's weight [vocab, hidden] (the embedding's, when tied); tensor parallel: this rank's
  // vocabulary rows.
  const at::Tensor& head_weight() const { return head_; }
  // The head on the final norm's output: the logits (tensor parallel: of this rank's vocabulary rows).
  at::Tensor head(const at::Tensor& hidden) const;
  // Tensor parallel: this rank's share (whole() without).
  const TensorSlice& tensor_slice() const { return stage_.tensor; }
  // How many tensor-parallel ranks hold a copy of the named parameter: 1 for a share of its own, the
  // ranks for a replicated one (a norm, a bias added after the sum), ranks / kv for a replicated
  // key/value head's projection; 1 without tensor parallel.
  int64_t tensor_copies(const std::string& name) const;
  // This rank's share of a whole tensor of the named parameter (a copy; tensor parallel), or `whole`
  // itself for a parameter held whole.
  at::Tensor share_of(const std::string& name, const at::Tensor& whole) const;

  const ModelConfig& config() const { return config_; }
  const ModelStage& stage() const { return stage_; }
  // Whether the stage holds the named parameter (every name, for the whole model).
  bool holds(const std::string& name) const;
  const std::vector<NamedTensor>& parameters() const { return params_; }
  std::vector<at::Tensor> parameter_tensors() const;
  int64_t num_parameters() const;
  // The parameters that require gradients (all of them unless frozen or LoRA).
  int64_t num_trainable_parameters() const;
  std::vector<NamedTensor> trainable_parameters() const;
  const Finetune& finetune() const { return finetune_; }
  // LoRA: the adapted modules' weight names, each with its adapter's A and B.
  struct Adapted {
    std::string weight;
    LoraAdapter adapter;
  };
  std::vector<Adapted> adapters() const;
  // --base-weights nf4: the weight of this (dense) name in NF4, or null when it is held dense.
  const Nf4Weight* nf4_weight(const std::string& name) const;
  // Every weight held in NF4, by its dense name.
  std::vector<std::string> nf4_weights() const;
  // Quantises `dense` (that weight's shape, any device and floating dtype) into the NF4 weight.
  void quantise(const std::string& name, const at::Tensor& dense);
  // What a parameter stands for in the model's parameter count: its elements, or for an NF4 weight's
  // codes the dense weight's (its absmax: none).
  int64_t counted_elements(const NamedTensor& param) const;
  // The unit of each of parameters() (model/parameter_gate.h): 0 for the embeddings, the final norm
  // and the head, 1 + i for layer i.
  std::vector<int> parameter_units() const;

 private:
  struct Layer {
    at::Tensor norm1_w, norm1_b, norm2_w, norm2_b;
    at::Tensor qkv_w, qkv_b;  // fused families
    at::Tensor q_w, q_b, k_w, k_b, v_w, v_b;
    at::Tensor o_w, o_b;
    at::Tensor q_norm_w, k_norm_w;              // q/k norms (qwen3, gemma3, olmo2)
    at::Tensor attn_out_norm_w, mlp_out_norm_w;  // norms after attention and the MLP (olmo2, gemma3)
    at::Tensor up_w, up_b, gate_w, gate_b, down_w, down_b;
    at::Tensor gate_up_w;  // phi3
    at::Tensor router_w;   // a mixture of experts
    // LoRA adapters of the projections (undefined when not adapted); a fused module's in its slot.
    LoraAdapter lora_qkv, lora_q, lora_k, lora_v, lora_o, lora_gate_up, lora_gate, lora_up, lora_down;
    // --base-weights nf4: the projections' weights in NF4 (the dense member is then undefined).
    Nf4Weight nf4_qkv, nf4_q, nf4_k, nf4_v, nf4_o, nf4_gate_up, nf4_gate, nf4_up, nf4_down;
    std::vector<Expert> experts;
    std::optional<int64_t> window;  // sliding attention window of this layer
    bool local_rope = false;        // rotates by the windowed layers' own base (gemma3)
    bool rotary = true;             // rotates q and k at all (smollm3: not every 4th layer)
  };
  struct RotaryTables {
    std::pair<at::Tensor, at::Tensor> global, local;  // cos, sin
  };

  // A parameter of the whole model's `shape`; tensor parallel, with `spans` along `dim` of it: only
  // those (TensorCut), drawn whole and cut.
  at::Tensor add_param(const std::string& name, std::vector<int64_t> shape, int64_t dim = 0,
                       std::vector<Span> spans = {});
  // Tensor parallel: a replicated key/value projection's weight or bias as the forward uses it (its
  // gradient summed over its copies), else the parameter itself.
  at::Tensor kv_param(const at::Tensor& p) const;
  // A row-parallel projection (o, down): this rank's partial product summed over the ranks, then the
  // bias; the plain projection without tensor parallel.
  at::Tensor project_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const LoraAdapter& lora,
                         const Nf4Weight& nf4, const ForwardOptions& o) const;
  // Tensor parallel: a block's (or the head's) input as this rank's share computes on it — the whole
  // tokens (sequence parallel: gathered from the ranks' parts), their gradient summed over the ranks.
  at::Tensor enter_share(const at::Tensor& input) const;
  // Sequence parallel: a replicated parameter used on this rank's part of the tokens (a norm's weight,
  // a bias added after the sum, the position embedding), its gradient summed over the ranks; else p.
  at::Tensor region_param(const at::Tensor& p) const;
  // A norm between the blocks (or the final one), over region_param's weights.
  at::Tensor region_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const;
  // Tensor parallel: this rank's rows and columns of the model's split dimensions (all of them without).
  struct Shares {
    Span heads, kv_heads, q_rows, kv_rows, inner, vocab;
  };
  static Shares shares_of(const ModelConfig& c, const TensorSlice& tp);
  // Layer i's parameters: its norms, attention, and MLP or experts.
  void add_layer(int64_t i, const Shares& shares);
  void add_attention(Layer& l, const std::string& prefix, const Shares& shares);
  void add_experts(Layer& l, const std::string& prefix);
  void add_mlp(Layer& l, const std::string& prefix, const Span& inner);
  void add_adapters();
  void mark_trainable();
  // x through a projection (dense, or its NF4 weight when defined) and, when adapted, its LoRA adapter.
  at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const LoraAdapter& lora,
                     const Nf4Weight& nf4, const ForwardOptions& o) const;
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const;
  at::Tensor attention(const Layer& l, const at::Tensor& x, const RotaryTables& rope, const ForwardOptions& o) const;
  at::Tensor mlp(const Layer& l, const at::Tensor& x, const ForwardOptions& o, RouterStats* stats) const;
  // The model up to its head: the final norm's output, and the routing statistics gathered on the way.
  struct Trunk {
    at::Tensor hidden;
    std::shared_ptr<RouterStats> stats;
  };
  Trunk run_trunk(const at::Tensor& input_ids, const ForwardOptions& o, RouterOutput* router) const;
  void report_router(const Trunk& trunk, RouterOutput* router) const;
  at::Tensor block(const Layer& l, const at::Tensor& x, const RotaryTables& rope, const ForwardOptions& o,
                   RouterStats* stats) const;

  ModelConfig config_;
  ModelStage stage_;
  Finetune finetune_;
  BaseWeights base_weights_ = BaseWeights::dense;
  at::TensorOptions options_;
  bool release_ = false;  // parameters hold memory only while initialised (a KeepParameter was given)
  Rotary rotary_;
  Rotary local_rotary_;  // windowed layers' (gemma3); rotary_'s settings otherwise
  std::vector<NamedTensor> params_;
  at::Tensor embed_, pos_embed_, final_norm_w_, final_norm_b_, head_;
  std::vector<Layer> layers_;
  // Tensor parallel: the cut parameters' shares, and this rank's attention heads and key/value heads
  // (the config's without).
  std::map<std::string, TensorCut> cuts_;
  int64_t heads_ = 0, kv_heads_ = 0;
};

}  // namespace headroom

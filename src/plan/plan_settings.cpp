#include "plan/plan_settings.h"

#include <fmt/format.h>

namespace headroom {
namespace {

std::string python_value(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  return v.dump();
}

const char* hf_optim(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::sgd:
    case OptimizerKind::momentum: return "sgd";
    case OptimizerKind::adam:
    case OptimizerKind::adamw: return "adamw_torch";
    case OptimizerKind::adagrad: return "adagrad";
    case OptimizerKind::adafactor: return "adafactor";
    case OptimizerKind::adamw8bit: return "adamw_bnb_8bit";
  }
  return "adamw_torch";
}

// The class and keyword arguments CPUOffloadOptimizer takes for each kind.
const char* torch_optimizer_class(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::sgd: return "torch.optim.SGD";
    case OptimizerKind::momentum: return "torch.optim.SGD, momentum=0.9";
    case OptimizerKind::adam: return "torch.optim.Adam";
    case OptimizerKind::adamw: return "torch.optim.AdamW, weight_decay=0.1";
    case OptimizerKind::adagrad: return "torch.optim.Adagrad";
    case OptimizerKind::adafactor: return "torch.optim.Adafactor";
    case OptimizerKind::adamw8bit: return "bitsandbytes.optim.AdamW8bit, weight_decay=0.1";
  }
  return "?";
}

const char* torch_optimizer(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::sgd: return "torch.optim.SGD(model.parameters(), lr=lr)";
    case OptimizerKind::momentum: return "torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)";
    case OptimizerKind::adam: return "torch.optim.Adam(model.parameters(), lr=lr)";
    case OptimizerKind::adamw: return "torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)";
    case OptimizerKind::adagrad: return "torch.optim.Adagrad(model.parameters(), lr=lr)";
    case OptimizerKind::adafactor: return "torch.optim.Adafactor(model.parameters(), lr=lr)";
    case OptimizerKind::adamw8bit:
      return "bitsandbytes.optim.AdamW8bit(model.parameters(), lr=lr, weight_decay=0.1)  # pip install bitsandbytes";
  }
  return "";
}

// --precision bf16-params in PyTorch's own words.
constexpr const char* kFsdp2Recipe =
    "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32); fully_shard(layer, "
    "mp_policy=mp) for each decoder layer, then fully_shard(model, mp_policy=mp) (torch.distributed.fsdp); the "
    "weights stay float32, no autocast";

// --checkpointing ops in PyTorch's own words (torchtitan's default policy).
constexpr const char* kPerOpRecipe =
    "per op: context_fn=lambda: create_selective_checkpoint_contexts(policy) (torch.utils.checkpoint) with a "
    "policy that returns MUST_SAVE for aten.mm on its 1st, 3rd, 5th... call in the layer and for the SDPA "
    "kernels, PREFER_RECOMPUTE otherwise";

}  // namespace

nlohmann::json training_arguments(const Plan& p) {
  nlohmann::json args = {{"per_device_train_batch_size", p.batch},
                         {"gradient_accumulation_steps", p.accum},
                         {"bf16", p.precision == Precision::bf16_mixed},
                         {"fp16", p.precision == Precision::fp16_mixed},
                         {"gradient_checkpointing", p.checkpointing.kind != CheckpointPolicy::Kind::none},
                         {"optim", hf_optim(p.optimizer)}};
  nlohmann::json model = {{"attn_implementation", p.attention == AttentionPath::flash ? "sdpa" : "eager"}};
  nlohmann::json notes = nlohmann::json::array();
  if (p.precision == Precision::bf16) {
    model["dtype"] = "bfloat16";
    notes.push_back("bf16: the weights themselves are bfloat16 (from_pretrained(dtype=torch.bfloat16)), no autocast");
  }
  if (p.precision == Precision::bf16_params) notes.push_back(std::string("bf16-params: ") + kFsdp2Recipe);
  if (p.optimizer == OptimizerKind::adam) args["weight_decay"] = 0.0;
  if (p.optimizer == OptimizerKind::adamw) args["weight_decay"] = 0.1;
  if (p.optimizer == OptimizerKind::momentum) args["optim_args"] = "momentum=0.9";
  if (p.checkpointing.kind == CheckpointPolicy::Kind::selective ||
      p.checkpointing.kind == CheckpointPolicy::Kind::every || p.checkpointing.per_op()) {
    notes.push_back(fmt::format(
        "checkpointing {}: transformers checkpoints every layer; its peak is lower and its step slower than planned{}",
        p.checkpointing.name(), p.checkpointing.per_op() ? std::string("; ") + kPerOpRecipe : ""));
  }
  if (offloads_activations(p.offload)) {
    notes.push_back(
        "offload activations has no TrainingArguments setting: run the model's forward inside "
        "headroom.offload_activations() (torch.autograd.graph.saved_tensors_hooks), e.g. in compute_loss");
  }
  if (p.loss.chunked) {
    notes.push_back(
        "loss chunked has no TrainingArguments setting: compute the loss with headroom.chunked_cross_entropy("
        "hidden, model.lm_head.weight, labels) in compute_loss (or Liger's fused linear cross-entropy on cuda)");
  }
  if (offloads_optimizer(p.offload)) {
    notes.push_back(
        "offload optimizer has no TrainingArguments setting: pass optimizers=(torchao.optim.CPUOffloadOptimizer("
        "model.parameters(), torch.optim.AdamW), None) to Trainer, or use DeepSpeed's "
        "zero_optimization.offload_optimizer {\"device\": \"cpu\", \"pin_memory\": true}");
  }
  if (p.pipeline.stages > 1) {
    notes.push_back(fmt::format(
        "pipeline {} stages has no TrainingArguments setting: headroom train --pipeline {} under torchrun, or "
        "torch.distributed.pipelining's Schedule1F1B with {} micro-batches",
        p.pipeline.stages, p.pipeline.stages, p.accum));
  }
  if (p.tensor_parallel > 1) {
    notes.push_back(fmt::format(
        "tensor parallel {} has no TrainingArguments setting: headroom train --tensor-parallel {} under torchrun, "
        "or torch.distributed.tensor.parallel's ColwiseParallel/RowwiseParallel plan over a {}-rank mesh",
        p.tensor_parallel, p.tensor_parallel, p.tensor_parallel));
  }
  if (p.ranks() > 1) {
    notes.push_back(fmt::format("launch with torchrun --nproc-per-node {}; the batch sizes are per data-parallel rank",
                                p.ranks()));
    if (p.shard == ShardLevel::gradients) args["fsdp"] = "shard_grad_op";
    if (p.shard == ShardLevel::full) args["fsdp"] = "full_shard";
    if (p.shard == ShardLevel::optimizer) {
      notes.push_back("shard optimizer (ZeRO-1) has no FSDP setting: use DeepSpeed with zero_optimization.stage 1");
    }
  }
  return {{"training_arguments", args}, {"model_kwargs", model}, {"notes", notes}};
}

std::string training_arguments_code(const Plan& p) {
  const nlohmann::json s = training_arguments(p);
  std::string out = fmt::format("# {}\n", p.describe());
  for (const auto& note : s.at("notes")) out += "# " + note.get<std::string>() + "\n";
  out += "model = AutoModelForCausalLM.from_pretrained(name";
  for (const auto& [k, v] : s.at("model_kwargs").items()) {
    out += fmt::format(", {}={}", k, k == "dtype" ? "torch." + v.get<std::string>() : python_value(v));
  }
  out += ")\nargs = TrainingArguments(\n    output_dir=\"out\",\n";
  for (const auto& [k, v] : s.at("training_arguments").items()) out += fmt::format("    {}={},\n", k, python_value(v));
  out += ")\n";
  return out;
}

nlohmann::json lightning_trainer_kwargs(const Plan& p) {
  const char* precision = "32-true";
  if (p.precision == Precision::bf16_mixed) precision = "bf16-mixed";
  if (p.precision == Precision::fp16_mixed) precision = "16-mixed";
  if (p.precision == Precision::bf16) precision = "bf16-true";
  nlohmann::json trainer = {{"precision", precision}, {"accumulate_grad_batches", p.accum}};
  // The optimizer over the module's trainable parameters, as configure_optimizers returns it.
  std::string optimizer = torch_optimizer(p.optimizer);
  const std::string all = "model.parameters()";
  optimizer.replace(optimizer.find(all), all.size(), "(q for q in self.parameters() if q.requires_grad)");
  nlohmann::json module = {{"batch_size", p.batch},
                           {"gradient_checkpointing", p.checkpointing.kind != CheckpointPolicy::Kind::none},
                           {"optimizer", optimizer}};
  nlohmann::json model = {{"attn_implementation", p.attention == AttentionPath::flash ? "sdpa" : "eager"}};
  nlohmann::json notes = nlohmann::json::array();
  if (p.precision == Precision::bf16) {
    model["dtype"] = "bfloat16";
    notes.push_back("bf16: precision=\"bf16-true\" keeps the weights themselves in bfloat16, no autocast");
  }
  if (p.precision == Precision::bf16_params) {
    notes.push_back(std::string("bf16-params: Lightning's ModelParallelStrategy, in configure_model: ") + kFsdp2Recipe);
  }
  if (p.checkpointing.kind != CheckpointPolicy::Kind::none) {
    notes.push_back(
        "checkpointing has no Trainer argument: in the LightningModule's configure_model, call "
        "self.model.gradient_checkpointing_enable() (a transformers model) or wrap each layer in "
        "torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)");
  }
  if (p.checkpointing.kind == CheckpointPolicy::Kind::selective ||
      p.checkpointing.kind == CheckpointPolicy::Kind::every || p.checkpointing.per_op()) {
    notes.push_back(fmt::format(
        "checkpointing {}: gradient_checkpointing_enable() checkpoints every layer; its peak is lower and its "
        "step slower than planned{}",
        p.checkpointing.name(), p.checkpointing.per_op() ? std::string("; ") + kPerOpRecipe : ""));
  }
  if (offloads_activations(p.offload)) {
    notes.push_back(
        "offload activations has no Trainer argument: run the model's forward in training_step inside "
        "headroom.offload_activations()");
  }
  if (p.loss.chunked) {
    notes.push_back(
        "loss chunked has no Trainer argument: compute the loss in training_step with "
        "headroom.chunked_cross_entropy(hidden, model.lm_head.weight, labels)");
  }
  if (offloads_optimizer(p.offload)) {
    notes.push_back(fmt::format(
        "offload optimizer: return torchao.optim.CPUOffloadOptimizer(self.parameters(), {}) from "
        "configure_optimizers, or use strategy=\"deepspeed_stage_2_offload\"",
        torch_optimizer_class(p.optimizer)));
  }
  if (p.pipeline.stages > 1) {
    notes.push_back(fmt::format(
        "pipeline {} stages has no Lightning strategy: headroom train --pipeline {} under torchrun, or "
        "torch.distributed.pipelining's Schedule1F1B in the module",
        p.pipeline.stages, p.pipeline.stages));
  }
  if (p.tensor_parallel > 1) {
    notes.push_back(fmt::format(
        "tensor parallel {} has no Lightning strategy setting here: headroom train --tensor-parallel {} under "
        "torchrun, or Lightning's ModelParallelStrategy with a parallelize_module plan",
        p.tensor_parallel, p.tensor_parallel));
  }
  if (p.world > 1) {
    trainer["devices"] = p.world;
    switch (p.shard) {
      case ShardLevel::none: trainer["strategy"] = "ddp"; break;
      case ShardLevel::optimizer: trainer["strategy"] = "deepspeed_stage_1"; break;
      case ShardLevel::gradients: trainer["strategy"] = "deepspeed_stage_2"; break;
      case ShardLevel::full: trainer["strategy"] = "fsdp"; break;
    }
    notes.push_back("the batch size is per device; Lightning starts one process per device");
    if (p.shard == ShardLevel::gradients) {
      notes.push_back("shard gradients (ZeRO-2): FSDPStrategy(sharding_strategy=\"SHARD_GRAD_OP\") is the FSDP equivalent");
    }
  }
  return {{"trainer_kwargs", trainer}, {"module", module}, {"model_kwargs", model}, {"notes", notes}};
}

std::string lightning_trainer_code(const Plan& p) {
  const nlohmann::json s = lightning_trainer_kwargs(p);
  const nlohmann::json& m = s.at("module");
  std::string out = fmt::format("# {}\n", p.describe());
  for (const auto& note : s.at("notes")) out += "# " + note.get<std::string>() + "\n";
  out += "model = AutoModelForCausalLM.from_pretrained(name";
  for (const auto& [k, v] : s.at("model_kwargs").items()) {
    out += fmt::format(", {}={}", k, k == "dtype" ? "torch." + v.get<std::string>() : python_value(v));
  }
  out += ")\n";
  out += fmt::format("loader = DataLoader(dataset, batch_size={}, shuffle=True)\n", m.at("batch_size").get<int64_t>());
  out += "# in the LightningModule:\n";
  if (m.at("gradient_checkpointing").get<bool>()) {
    out += "#   def configure_model(self): self.model.gradient_checkpointing_enable()\n";
  }
  out += fmt::format("#   def configure_optimizers(self): return {}\n", m.at("optimizer").get<std::string>());
  out += "trainer = lightning.Trainer(\n";
  for (const auto& [k, v] : s.at("trainer_kwargs").items()) out += fmt::format("    {}={},\n", k, python_value(v));
  out += ")\n";
  return out;
}

std::string torch_loop_code(const Plan& p, const std::string& device) {
  std::string out = fmt::format("# {}\n", p.describe());
  if (p.precision == Precision::bf16) out += "model = model.to(torch.bfloat16)  # bf16: the weights themselves\n";
  if (p.precision == Precision::bf16_params) out += fmt::format("# bf16-params: {}\n", kFsdp2Recipe);
  if (p.checkpointing.kind != CheckpointPolicy::Kind::none) {
    out += fmt::format(
        "# checkpointing {}: wrap {} in torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)\n"
        "# (a transformers model: model.gradient_checkpointing_enable(), which checkpoints every layer)\n",
        p.checkpointing.name(),
        p.checkpointing.kind == CheckpointPolicy::Kind::full ? "every layer's forward"
        : p.checkpointing.kind == CheckpointPolicy::Kind::selective
            ? "every layer's attention block"
        : p.checkpointing.per_op() ? std::string("every layer's forward, ") + kPerOpRecipe
                                   : fmt::format("layers 0, {0}, 2*{0}, ...", p.checkpointing.every));
  }
  if (offloads_optimizer(p.offload)) {
    out += fmt::format(
        "# offload optimizer: the state and update in host memory (pip install torchao)\n"
        "optimizer = torchao.optim.CPUOffloadOptimizer(model.parameters(), {})\n",
        torch_optimizer_class(p.optimizer));
  } else {
    out += fmt::format("optimizer = {}\n", torch_optimizer(p.optimizer));
  }
  const bool mixed = p.precision == Precision::bf16_mixed || p.precision == Precision::fp16_mixed;
  const char* dtype = p.precision == Precision::fp16_mixed ? "torch.float16" : "torch.bfloat16";
  if (p.precision == Precision::fp16_mixed) out += fmt::format("scaler = torch.amp.GradScaler(\"{}\")\n", device);
  out += fmt::format("accum = {}  # micro-batches of {} sequence{} per optimizer step\n", p.accum, p.batch,
                     p.batch == 1 ? "" : "s");
  out += "for i, batch in enumerate(loader):  # each batch: one micro-batch\n";
  std::string indent = "    ";
  if (mixed) {
    out += fmt::format("    with torch.autocast(device_type=\"{}\", dtype={}):\n", device, dtype);
    indent = "        ";
  }
  if (offloads_activations(p.offload)) {
    out += indent + "with headroom.offload_activations():  # what autograd saves, in host memory until backward\n";
    indent += "    ";
  }
  if (p.loss.chunked) {
    out += indent + "# chunked loss: the head and the cross-entropy a chunk of tokens at a time (import headroom)\n";
    out += indent + "hidden = model.model(input_ids=batch[\"input_ids\"]).last_hidden_state[:, :-1]\n";
    out += indent + "loss = headroom.chunked_cross_entropy(hidden, model.lm_head.weight, batch[\"labels\"][:, 1:]) / accum\n";
  } else {
    out += indent + "loss = model(**batch).loss / accum\n";
  }
  out += p.precision == Precision::fp16_mixed ? "    scaler.scale(loss).backward()\n" : "    loss.backward()\n";
  out += "    if (i + 1) % accum == 0:\n";
  out += p.precision == Precision::fp16_mixed ? "        scaler.step(optimizer)\n        scaler.update()\n"
                                              : "        optimizer.step()\n";
  out += "        optimizer.zero_grad(set_to_none=True)\n";
  return out;
}

}  // namespace headroom

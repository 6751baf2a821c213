// Plan settings — a plan (plan/planner.h) as the settings a user types into their own training
// code: Hugging Face TrainingArguments fields, lightning.Trainer keyword arguments, or the
// torch.autocast / checkpointing / accumulation of a plain PyTorch loop. Where headroom's lever has no exact counterpart there (checkpointing
// every K-th layer, ZeRO-1), the nearest one is given and a note says what differs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "plan/planner.h"

namespace headroom {

// {"training_arguments": {per_device_train_batch_size, gradient_accumulation_steps, bf16, fp16,
//  gradient_checkpointing, optim, [weight_decay, optim_args, fsdp]}, "model_kwargs": {attn_implementation,
//  [dtype]}, "notes": [...]}
nlohmann::json training_arguments(const Plan& plan);

// Python source: TrainingArguments(...) with the model's from_pretrained keyword arguments.
std::string training_arguments_code(const Plan& plan);

// {"trainer_kwargs": {precision, accumulate_grad_batches, [devices, strategy]}, "module": {batch_size
//  (the DataLoader's), gradient_checkpointing (what the LightningModule enables in configure_model),
//  optimizer (Python source for configure_optimizers)}, "model_kwargs": {attn_implementation, [dtype]},
//  "notes": [...]}
nlohmann::json lightning_trainer_kwargs(const Plan& plan);

// Python source: lightning.Trainer(...) and what the LightningModule and DataLoader take.
std::string lightning_trainer_code(const Plan& plan);

// Python source: a plain loop with the plan's micro-batch, accumulation, autocast and
// checkpointing, for `device` ("cuda" or "cpu").
std::string torch_loop_code(const Plan& plan, const std::string& device);

}  // namespace headroom

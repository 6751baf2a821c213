// Precision — how a run computes (lever 4):
//   fp32        everything in float32
//   bf16-mixed  float32 weights, gradients and optimizer state; the forward pass under autocast to
//               bfloat16 (autocast caches low-precision copies of the weights during it)
//   fp16-mixed  the same with float16, plus a dynamic loss scaler (train/precision.h)
//   bf16        weights, gradients and optimizer state in bfloat16 ("pure" bf16)
//   bf16-params FSDP2's mixed precision (MixedPrecisionPolicy(param_dtype=bfloat16,
//               reduce_dtype=float32), torchtitan's default): float32 weights (each rank's slice),
//               gradients and optimizer state; each unit (a layer; the embeddings and head) is cast to
//               bfloat16 and gathered when used, computes in bfloat16 without autocast, and its
//               bfloat16 gradients are reduced in float32 (dist/data_parallel.h). With --shard full
//               on several ranks, or on one process (as fully_shard on one GPU runs it)
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace headroom {

enum class Precision { fp32, bf16_mixed, fp16_mixed, bf16, bf16_params };

const char* precision_name(Precision p);
// Throws Error naming the accepted values.
Precision parse_precision(const std::string& text);

// dtype of the weights, gradients and optimizer state.
c10::ScalarType parameter_dtype(Precision p);
// dtype the model computes with, its parameters as the forward uses them: bfloat16 for bf16 and
// bf16-params (the gathered copies), else parameter_dtype (autocast casts inside the operators).
c10::ScalarType compute_dtype(Precision p);

}  // namespace headroom

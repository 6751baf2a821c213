// Chunked linear cross-entropy — the LM head and the loss over chunks of tokens, never holding the
// whole [tokens × vocab] logits (the loss lever, --loss chunked).
//
// One autograd function takes the final hidden states, the head's weight and the targets. Forward
// runs chunk by chunk: a chunk's logits in the compute dtype (autocast's, else the hidden states'),
// their float32 copy, the target's logit and the log-sum-exp; it keeps only the hidden states (in
// the compute dtype, as the head's matmul would) and one float32 log-sum-exp per token. Backward
// recomputes each chunk's logits from them, turns them into the float32 softmax minus the one-hot
// target, and accumulates the hidden states' gradient and the head's.
//
// Why recompute rather than compute the gradients during forward (as Liger does): the gradient then
// comes from the loss's real incoming gradient (the accumulation weight, fp16's loss scale), an
// evaluation forward pays nothing extra, and nothing the size of the head's gradient is held from
// forward to backward. It costs one more head matmul per chunk.
//
// The same numbers as `lm_head` + token_loss (train/step_ops.h): the logits round to the compute
// dtype and are upcast to float32 where the full path does it; the softmax's gradient is rounded to
// the compute dtype before the matmuls, as the full path's cast does; the head's gradient is summed
// over the chunks in float32 and rounded to the compute dtype once at the end, as the full path's
// single matmul over all tokens rounds it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace headroom {

// Mean cross-entropy of `hidden` ([..., hidden]) through `weight` ([vocab, hidden]) against
// `targets` (int64, hidden's leading shape), `chunk` tokens at a time.
at::Tensor chunked_token_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                              int64_t chunk);

}  // namespace headroom

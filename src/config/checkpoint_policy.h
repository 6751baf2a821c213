// CheckpointPolicy — which activations are recomputed in backward instead of kept (lever 5). The
// mechanism is model/checkpointing.h; this is the setting, parsed once.
//   none       keep every activation
//   selective  recompute the attention sub-block of every layer
//   every:K    recompute whole layers 0, K, 2K, ... (every:1 is full, and parses as full)
//   full       recompute every layer
//   ops        per-op selective (torchtitan's default, PyTorch's create_selective_checkpoint_contexts):
//              inside every layer the outputs of the 1st, 3rd, 5th ... matrix multiplication (aten::mm:
//              a projection without bias) and of the fused attention kernel (with its log-sum-exp) are
//              kept; everything else is recomputed in backward from the layer's input
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct CheckpointPolicy {
  enum class Kind { none, selective, every, full, ops };
  Kind kind = Kind::none;
  int64_t every = 1;  // K, for Kind::every (at least 2)

  bool whole_layer(int64_t layer) const { return kind == Kind::full || (kind == Kind::every && layer % every == 0); }
  bool attention_only() const { return kind == Kind::selective; }
  bool per_op() const { return kind == Kind::ops; }
  // ops: whether the `n`-th matrix multiplication of a layer's forward (1-based) is kept: every
  // second one is recomputed, as torchtitan's policy counts them.
  static bool keeps_matmul(int64_t n) { return n % 2 == 1; }
  std::string name() const;  // "none", "selective", "every:4", "full", "ops"

  static CheckpointPolicy none() { return {}; }
  static CheckpointPolicy selective() { return {Kind::selective, 1}; }
  static CheckpointPolicy every_kth(int64_t k) { return k <= 1 ? full() : CheckpointPolicy{Kind::every, k}; }
  static CheckpointPolicy full() { return {Kind::full, 1}; }
  static CheckpointPolicy ops() { return {Kind::ops, 1}; }
  friend bool operator==(const CheckpointPolicy&, const CheckpointPolicy&) = default;
};

// Throws Error naming the accepted forms.
CheckpointPolicy parse_checkpoint_policy(const std::string& text);

}  // namespace headroom

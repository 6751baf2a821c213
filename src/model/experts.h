// A mixture of experts in place of a layer's MLP (qwen3_moe, mixtral): a router scores the experts
// for each token, the top k are kept (their softmax weights, optionally renormalised), each expert —
// a gated MLP — runs on the tokens routed to it, and the weighted outputs sum back per token.
//
// The tokens are grouped by expert with one sort: gathered once into a [tokens·k, hidden] buffer,
// split (a view per expert; split's backward is one concatenation, not a zero-filled buffer per
// expert), and the experts' outputs joined, weighted and scattered back with one index_add. Every
// expert runs, on zero rows when no token chose it, so each expert's weights get a gradient (zeros)
// every step: optimizers, clipping and data parallel's buckets see the same parameters each time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "config/model_config.h"

namespace headroom {

struct Expert {
  at::Tensor gate_w, up_w, down_w;  // [I, d], [I, d], [d, I]
};

// The load-balancing loss's statistics over the layers of one forward (Switch Transformer's, as
// transformers computes it): assignments per expert, routing probability summed per expert, rows.
struct RouterStats {
  bool balance = false;    // gather the load-balancing loss's statistics (below)
  at::Tensor assignments;  // float32 [experts], no gradient
  at::Tensor probability;  // float32 [experts], differentiable
  int64_t rows = 0;
  // The routing's skew: the most rows any expert of any layer received, relative to the balanced
  // share (rows · top_k / experts). Always gathered.
  double skew = 0;
};

// What a forward reports of its experts: the load-balancing loss (times its coefficient) when the
// config asks for it, and the skew of the routing.
struct RouterOutput {
  at::Tensor loss;
  double skew = 0;
};

// x: [..., d]. Returns the experts' combined output in the experts' matmul dtype, x's shape.
// `stats` (may be null) gathers the routing's skew and, when asked, the load-balancing statistics.
at::Tensor mixture_of_experts(const at::Tensor& x, const at::Tensor& router_w, const std::vector<Expert>& experts,
                              const MoeConfig& moe, Activation activation, RouterStats* stats);

// router_aux_loss_coef · experts · Σ_e (assignments_e / rows) · (probability_e / rows).
at::Tensor load_balancing_loss(const RouterStats& stats, const MoeConfig& moe);

}  // namespace headroom

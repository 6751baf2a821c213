#include "model/experts.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "model/activation.h"

namespace headroom {

at::Tensor mixture_of_experts(const at::Tensor& x, const at::Tensor& router_w, const std::vector<Expert>& experts,
                              const MoeConfig& moe, Activation activation, RouterStats* stats) {
  const int64_t d = x.size(-1), k = moe.top_k, count = static_cast<int64_t>(experts.size());
  const at::Tensor flat = x.reshape({-1, d});
  const int64_t rows = flat.size(0);
  const at::Tensor logits = at::linear(flat, router_w);  // [rows, experts]
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [top_w, top_i] = at::topk(probs, k, -1);
  if (moe.normalise_top_k) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
  top_w = top_w.to(logits.scalar_type());
  const at::Tensor chosen = top_i.reshape({-1});  // [rows · k], row-major: token r's picks at r·k ...
  if (stats && stats->balance) {
    at::Tensor assigned;
    {
      const c10::NoGradGuard no_grad;
      assigned = at::bincount(chosen, {}, count).to(at::kFloat);
    }
    at::Tensor probability = probs.sum(0);
    stats->assignments = stats->assignments.defined() ? stats->assignments + assigned : assigned;
    stats->probability = stats->probability.defined() ? stats->probability + probability : probability;
    stats->rows += rows;
  }
  at::Tensor order, token, sizes;
  {
    const c10::NoGradGuard no_grad;
    order = at::argsort(chosen, /*stable=*/true);
    token = at::div(order, k, "floor");
    sizes = at::bincount(chosen, {}, count).cpu();
  }
  const at::Tensor gathered = flat.index_select(0, token);              // [rows · k, d]
  const at::Tensor weight = top_w.reshape({-1}).index_select(0, order);  // [rows · k]
  std::vector<int64_t> split(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + count);
  if (stats && rows > 0) {
    const double balanced = static_cast<double>(rows * k) / static_cast<double>(count);
    stats->skew = std::max(stats->skew, static_cast<double>(*std::max_element(split.begin(), split.end())) / balanced);
  }
  const std::vector<at::Tensor> pieces = gathered.split_with_sizes(split, 0);
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const Expert& ex = experts[e];
    const at::Tensor h = activate(at::linear(pieces[e], ex.gate_w), activation) * at::linear(pieces[e], ex.up_w);
    outputs.push_back(at::linear(h, ex.down_w));
  }
  at::Tensor joined = at::cat(outputs, 0);
  outputs.clear();  // the experts' outputs go once joined (the multiplication keeps the join)
  const at::Tensor weighted = joined * weight.unsqueeze(-1);
  joined.reset();
  at::Tensor out = at::zeros({rows, d}, weighted.options());
  out.index_add_(0, token, weighted);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  return out.view(shape);
}

at::Tensor load_balancing_loss(const RouterStats& stats, const MoeConfig& moe) {
  const double rows = static_cast<double>(stats.rows);
  const at::Tensor per_expert = (stats.assignments / rows) * (stats.probability / rows);
  return per_expert.sum() * (static_cast<double>(moe.experts) * moe.aux_loss_coef);
}

}  // namespace headroom

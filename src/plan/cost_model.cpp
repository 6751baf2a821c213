#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "config/model_config.h"

namespace headroom {
namespace {

// Weights that multiply activations: everything but the embeddings (a lookup), norms and biases.
double matmul_params(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), i = static_cast<double>(c.intermediate_size);
  const double per_layer = h * (q + 2 * kv) + q * h + (c.gated_mlp ? 3 : 2) * h * i;
  return per_layer * static_cast<double>(c.num_layers) + static_cast<double>(c.vocab_size) * h;
}

double attention_matmul_params(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim);
  return h * (q + 2 * kv) + q * h;
}

// QKᵀ and PV of one layer: 2 · 2 · T · head_dim per query token and head; causal flash skips the
// upper half.
double attention_flops_per_layer(const ModelConfig& c, double tokens, double seq, AttentionPath attention) {
  return 4 * tokens * seq * static_cast<double>(c.num_heads * c.head_dim) * (attention == AttentionPath::flash ? 0.5 : 1.0);
}

// --checkpointing ops (model/op_checkpoint.h): the recomputed matmul weights of one layer, those
// with a bias (aten::addmm, not kept) and every second one without, in the forward's order.
double recomputed_matmul_params(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), i = static_cast<double>(c.intermediate_size);
  std::vector<std::pair<double, bool>> projections;  // weights, has a bias
  if (c.fused_qkv) {
    projections.push_back({h * (q + 2 * kv), c.qkv_bias});
  } else {
    for (double rows : {q, kv, kv}) projections.push_back({h * rows, c.qkv_bias});
  }
  projections.push_back({q * h, c.out_bias});
  if (c.fused_gate_up) {
    projections.push_back({2 * h * i, false});
  } else {
    if (c.gated_mlp) projections.push_back({h * i, c.mlp_bias});
    projections.push_back({h * i, c.mlp_bias});
  }
  projections.push_back({i * h, c.mlp_bias});
  double recomputed = 0;
  int64_t counted = 0;
  for (const auto& [weights, bias] : projections) {
    if (bias || !CheckpointPolicy::keeps_matmul(++counted)) recomputed += weights;
  }
  return recomputed;
}

double compute_bytes(Precision p) { return static_cast<double>(c10::elementSize(compute_dtype(p))); }

}  // namespace

double micro_batch_flops(const ModelConfig& c, int64_t rows, int64_t seq, const CheckpointPolicy& checkpointing,
                         AttentionPath attention, bool chunked_loss) {
  const double tokens = static_cast<double>(rows * seq), t = static_cast<double>(seq);
  const double layers = static_cast<double>(c.num_layers);
  const double attn_per_layer = attention_flops_per_layer(c, tokens, t, attention);
  const double forward = 2 * matmul_params(c) * tokens + attn_per_layer * layers;
  double recompute = 0;
  const double layer_forward = (forward - 2 * static_cast<double>(c.vocab_size * c.hidden_size) * tokens) / layers;
  switch (checkpointing.kind) {
    case CheckpointPolicy::Kind::none: break;
    case CheckpointPolicy::Kind::full: recompute = layer_forward * layers; break;
    case CheckpointPolicy::Kind::every: {
      const int64_t k = std::max<int64_t>(1, checkpointing.every);
      recompute = layer_forward * static_cast<double>((c.num_layers + k - 1) / k);
      break;
    }
    case CheckpointPolicy::Kind::selective:
      recompute = (2 * attention_matmul_params(c) * tokens + attn_per_layer) * layers;
      break;
    case CheckpointPolicy::Kind::ops:
      // The kept attention kernel is not run again (a windowed layer's is).
      recompute = 2 * recomputed_matmul_params(c) * tokens * layers;
      for (int64_t l = 0; l < c.num_layers; ++l) {
        if (c.windowed(l) && *c.sliding_window < seq) recompute += attn_per_layer;
      }
      break;
  }
  if (chunked_loss) recompute += 2 * static_cast<double>(c.vocab_size * c.hidden_size) * tokens;
  return 3 * forward + recompute;  // backward is twice the forward
}

CostModel CostModel::flops_only() { return CostModel(); }

CostModel CostModel::with_ratios(const CostModel& anchor, Precision measured,
                                 const std::map<Precision, double>& ratios) {
  CostModel m = anchor;
  const auto it = anchor.fits_.find(measured);
  if (it == anchor.fits_.end()) return m;
  for (const auto& [p, ratio] : ratios) {
    m.fits_[p] = {it->second.seconds_per_micro_batch * ratio, it->second.seconds_per_flop * ratio};
  }
  return m;
}

std::optional<CostModel> CostModel::calibrate(const RunConfig& base, const std::vector<Precision>& precisions,
                                              int64_t larger, const StepTimer& time_step, int timed) {
  CostModel m;
  if (precisions.empty()) return m;
  const ModelConfig model = load_model_config(base.model, base.overrides);
  larger = std::max<int64_t>(2, larger);
  // The run's own precision (or the first) gets the full two-point fit; the others are timed at the
  // larger batch only and keep its split between fixed and per-FLOP cost, scaled.
  Precision anchor = precisions.front();
  for (Precision p : precisions) {
    if (p == base.precision) anchor = p;
  }
  const double f1 = micro_batch_flops(model, 1, base.seq, {}, AttentionPath::flash);
  const double f2 = micro_batch_flops(model, larger, base.seq, {}, AttentionPath::flash);
  const std::optional<double> m1 = time_step(anchor, 1, timed + 2);
  const std::optional<double> m2 = m1 ? time_step(anchor, larger, timed + 2) : std::nullopt;
  if (!m2) return std::nullopt;
  const double t1 = *m1, t2 = *m2;
  // (An anchor measured with more steps: the split between fixed and per-FLOP cost decides between
  // many small micro-batches and few large ones.)
  StepTimeFit fit;
  fit.seconds_per_flop = (t2 - t1) / (f2 - f1);
  fit.seconds_per_micro_batch = t1 - fit.seconds_per_flop * f1;
  if (fit.seconds_per_flop <= 0 || fit.seconds_per_micro_batch < 0) {
    // Timing noise beat the signal: all of it proportional to the work.
    fit.seconds_per_flop = t2 / f2;
    fit.seconds_per_micro_batch = 0;
  }
  m.fits_[anchor] = fit;
  for (Precision p : precisions) {
    if (p == anchor) continue;
    const std::optional<double> t = time_step(p, larger, timed);
    if (!t) return std::nullopt;
    const double scale = *t / t2;
    m.fits_[p] = {fit.seconds_per_micro_batch * scale, fit.seconds_per_flop * scale};
  }
  return m;
}

double CostModel::state_lever_seconds(int64_t trainable_params, Precision precision, OptimizerKind optimizer,
                                      Offload offload) const {
  const auto n = static_cast<double>(trainable_params);
  double seconds = optimizer == OptimizerKind::adamw8bit ? n * kQuantisedUpdateSeconds : 0.0;
  if (offloads_optimizer(offload)) {
    const double bytes = n * (precision == Precision::bf16 ? 2.0 : 4.0);
    seconds += 2 * bytes / host_link_ + n * kHostUpdateSeconds;
  }
  return seconds;
}

double CostModel::pipeline_transfer_seconds(const ModelConfig& model, int64_t rows, int64_t seq, Precision precision,
                                            int64_t stages, int64_t micro_batches) const {
  if (stages <= 1) return 0;
  // Activations in the dtype the model computes with (bf16 and bf16-params: 2 bytes).
  const double bytes = static_cast<double>(rows * seq * model.hidden_size) * compute_bytes(precision);
  const auto transfers = static_cast<double>(2 * (micro_batches + stages - 2));
  return transfers * (bytes / link_ + kCollectiveLatencySeconds);
}

double CostModel::tensor_parallel_seconds(const ModelConfig& model, int64_t rows, int64_t seq, Precision precision,
                                          int64_t ranks, int64_t micro_batches) const {
  if (ranks <= 1) return 0;
  const double elem = precision == Precision::fp32 ? 4.0 : 2.0;  // the row-parallel matmuls' output
  const double bytes = static_cast<double>(rows * seq * model.hidden_size) * elem;
  const double part = 2.0 * static_cast<double>(ranks - 1) / static_cast<double>(ranks);
  const auto sums = static_cast<double>(4 * model.num_layers + 2);
  return static_cast<double>(micro_batches) *
         (sums * (part * bytes / node_link_ + kCollectiveLatencySeconds) + 3 * kCollectiveLatencySeconds);
}

double CostModel::communication_seconds(const ModelConfig& model, Precision precision, int64_t world,
                                        ShardLevel shard, int64_t accum) const {
  if (world <= 1) return 0;
  const double bytes = static_cast<double>(count_parameters(model)) * (precision == Precision::bf16 ? 2.0 : 4.0);
  // What --shard full gathers: the parameters as the model computes with them (bf16-params: bf16).
  const double gathered = static_cast<double>(count_parameters(model)) * compute_bytes(precision);
  const double part = static_cast<double>(world - 1) / static_cast<double>(world);
  double volume = 0, collectives = 0;
  switch (shard) {
    case ShardLevel::none:
      volume = 2 * part * bytes;
      collectives = std::ceil(bytes / static_cast<double>(int64_t{25} << 20));
      break;
    case ShardLevel::optimizer:
    case ShardLevel::gradients: {
      // Reduce-scatters (once, or every micro-batch), then one all-gather of the updated weights.
      const double reductions = shard == ShardLevel::optimizer ? 1.0 : static_cast<double>(accum);
      volume = (reductions + 1) * part * bytes;
      collectives = (reductions + 1) * static_cast<double>(model.num_layers * 10 + 4);  // about 10 tensors a layer
      break;
    }
    case ShardLevel::full: {
      // Every micro-batch: the weights all-gathered for forward, the layers again for backward (the
      // embeddings and head stay), and the gradients reduce-scattered.
      const int64_t outer = model.vocab_size * model.hidden_size * (model.tie_word_embeddings ? 1 : 2) +
                            (model.learned_positions ? model.max_positions * model.hidden_size : 0);
      const double layers =
          gathered * static_cast<double>(count_parameters(model) - outer) / static_cast<double>(count_parameters(model));
      volume = static_cast<double>(accum) * part * (gathered + layers + bytes);
      collectives = 3 * static_cast<double>(accum) * static_cast<double>(model.num_layers * 10 + 4);
      break;
    }
  }
  return volume / link_ + collectives * kCollectiveLatencySeconds;
}

double CostModel::step_seconds(const ModelConfig& model, int64_t micro, int64_t global_rows, int64_t seq,
                               Precision precision, const CheckpointPolicy& checkpointing,
                               AttentionPath attention, bool chunked_loss) const {
  StepTimeFit fit{0, 1.0 / assumed_flops_};
  if (auto it = fits_.find(precision); it != fits_.end()) fit = it->second;
  const int64_t full = global_rows / micro, rest = global_rows % micro;
  double seconds = static_cast<double>(full) *
                   (fit.seconds_per_micro_batch +
                    fit.seconds_per_flop * micro_batch_flops(model, micro, seq, checkpointing, attention, chunked_loss));
  if (rest > 0) {
    seconds += fit.seconds_per_micro_batch +
               fit.seconds_per_flop * micro_batch_flops(model, rest, seq, checkpointing, attention, chunked_loss);
  }
  return seconds;
}

double CostModel::activation_offload_seconds(int64_t bytes, int64_t micro_batches, double layers_forward_seconds,
                                             int64_t layers) const {
  const double one_way = static_cast<double>(bytes) / host_link_;
  const double below_top = static_cast<double>(std::max<int64_t>(layers, 1) - 1) / static_cast<double>(std::max<int64_t>(layers, 1));
  const double down = std::max(0.0, one_way - layers_forward_seconds);
  const double up = one_way * (1 - below_top) + std::max(0.0, below_top * (one_way - 2 * layers_forward_seconds));
  return (down + up) * static_cast<double>(micro_batches);
}

double CostModel::layers_forward_seconds(const ModelConfig& c, int64_t micro, int64_t seq, Precision precision,
                                         AttentionPath attention) const {
  StepTimeFit fit{0, 1.0 / assumed_flops_};
  if (auto it = fits_.find(precision); it != fits_.end()) fit = it->second;
  const double tokens = static_cast<double>(micro * seq);
  const double head = static_cast<double>(c.vocab_size * c.hidden_size);
  const double flops = 2 * (matmul_params(c) - head) * tokens +
                       attention_flops_per_layer(c, tokens, static_cast<double>(seq), attention) *
                           static_cast<double>(c.num_layers);
  return fit.seconds_per_flop * flops;
}

void CostModel::set_host_link(double bytes_per_second) {
  if (!(bytes_per_second > 0)) throw std::invalid_argument("a host link's speed must be positive");
  host_link_ = bytes_per_second;
  host_link_measured_ = true;
}

}  // namespace headroom

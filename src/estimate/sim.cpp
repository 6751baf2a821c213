#include "estimate/sim.h"

#include <stdexcept>

#include <algorithm>

namespace headroom::sim {

const char* category_name(Category c) {
  switch (c) {
    case Category::weights: return "weights";
    case Category::weight_copies: return "weight_copies";
    case Category::gradients: return "gradients";
    case Category::optimizer: return "optimizer";
    case Category::activations: return "activations";
    case Category::logits: return "logits";
    case Category::loss: return "loss";
    case Category::temporaries: return "temporaries";
    case Category::allocator: return "allocator_overhead";
    case Category::other: return "other";
    case Category::communication: return "communication";
  }
  return "?";
}

Buffer::~Buffer() { memory_->release(id_); }

int Memory::label(std::string_view name, Category category, std::string_view formula) {
  for (size_t i = 0; i < labels_.size(); ++i) {
    if (labels_[i].name == name) return static_cast<int>(i);
  }
  labels_.push_back({std::string(name), category, std::string(formula)});
  by_label_.push_back(0);
  host_by_label_.push_back(0);
  return static_cast<int>(labels_.size() - 1);
}

Ref Memory::allocate(int64_t bytes, int label) {
  const int64_t padding = rounding_label_ >= 0 ? (granule_ - bytes % granule_) % granule_ : 0;
  buffers_.push_back({bytes, label, padding});
  events_.push_back({static_cast<int>(buffers_.size() - 1), bytes, true});
  live_ += bytes + padding;
  by_label_[static_cast<size_t>(label)] += bytes;
  if (padding > 0) by_label_[static_cast<size_t>(rounding_label_)] += padding;
  auto& phase_peak = phase_peaks_[static_cast<size_t>(phase_)];
  phase_peak = std::max(phase_peak, live_);
  if (live_ > peak_.bytes) {
    peak_.bytes = live_;
    peak_.phase = phase_;
    peak_.by_label = by_label_;
  }
  return std::make_shared<Buffer>(this, static_cast<int>(buffers_.size() - 1));
}

Ref Memory::allocate_host(int64_t bytes, int label) {
  buffers_.push_back({bytes, label, 0, /*host=*/true});
  host_live_ += bytes;
  host_by_label_[static_cast<size_t>(label)] += bytes;
  if (host_live_ > host_peak_.bytes) {
    host_peak_.bytes = host_live_;
    host_peak_.phase = phase_;
    host_peak_.by_label = host_by_label_;
  }
  return std::make_shared<Buffer>(this, static_cast<int>(buffers_.size() - 1));
}

int64_t Memory::bytes(const Ref& buffer) const { return buffers_[static_cast<size_t>(buffer->id())].bytes; }

void Memory::relabel(const Ref& buffer, int label) {
  Slot& s = buffers_[static_cast<size_t>(buffer->id())];
  by_label_[static_cast<size_t>(s.label)] -= s.bytes;
  s.label = label;
  by_label_[static_cast<size_t>(label)] += s.bytes;
}

void Memory::release(int id) {
  const Slot& s = buffers_[static_cast<size_t>(id)];
  if (s.host) {
    host_live_ -= s.bytes;
    host_by_label_[static_cast<size_t>(s.label)] -= s.bytes;
    return;
  }
  events_.push_back({id, s.bytes, false});
  live_ -= s.bytes + s.padding;
  by_label_[static_cast<size_t>(s.label)] -= s.bytes;
  if (s.padding > 0) by_label_[static_cast<size_t>(rounding_label_)] -= s.padding;
}

Tensor Graph::make(int64_t numel, int elem, int label, bool requires_grad) {
  return adopt(mem_.allocate(numel * elem, label), numel, elem, requires_grad);
}

Tensor Graph::adopt(Ref buffer, int64_t numel, int elem, bool requires_grad) const {
  Tensor t;
  t.buf = std::move(buffer);
  t.numel = numel;
  t.elem = elem;
  if (requires_grad && grad_mode_) {
    t.slot = std::make_shared<GradSlot>();
    t.slot->numel = numel;
    t.slot->elem = elem;
  }
  return t;
}

Tensor Graph::alias(const Tensor& base, int64_t numel) const {
  Tensor t = base;
  t.numel = numel;
  if (base.slot && grad_mode_) {
    t.slot = std::make_shared<GradSlot>();
    t.slot->numel = numel;
    t.slot->elem = base.elem;
  } else {
    t.slot = nullptr;
  }
  return t;
}

int Graph::temporaries_label() {
  if (temporaries_ < 0) {
    temporaries_ = mem_.label("backward temporaries", Category::temporaries,
                              "gradients of activations in flight and operator scratch");
  }
  return temporaries_;
}

Ref Graph::grad_for(const Tensor& input, int label) { return mem_.allocate(input.numel * input.elem, label); }

Ref Graph::scratch(int64_t bytes) { return mem_.allocate(bytes, temporaries_label()); }

void OffloadedLayer::restore(Memory& mem) {
  if (!device.empty()) return;
  for (const Ref& h : host) device.push_back(mem.allocate(mem.bytes(h), restored_label));
}

void SavedOffload::next_layer() {
  auto next = std::make_shared<OffloadedLayer>();
  next->restored_label = restored;
  next->below = layer;
  layer = std::move(next);
  copies.clear();
}

void Graph::record(const std::vector<const Tensor*>& outputs, std::vector<Ref> saved, Backward backward) {
  if (!grad_mode_) return;
  Node n;
  for (const Tensor* t : outputs) {
    if (t->slot) n.outputs.push_back(t->slot);
  }
  if (n.outputs.empty()) return;
  n.saved = std::move(saved);
  if (offload_) {
    OffloadedLayer& layer = *offload_->layer;
    for (Ref& r : n.saved) {
      if (!r || mem_.bytes(r) == 0 || offload_->keep(r)) continue;
      Ref& host = offload_->copies[r->id()];
      if (!host) {
        host = mem_.allocate_host(mem_.bytes(r), offload_->host_label);
        layer.host.push_back(host);
      }
      n.offloaded = offload_->layer;
      r = host;
    }
  }
  n.backward = std::move(backward);
  nodes_.push_back(std::move(n));
}

namespace {

// The input buffer's sum: `held` takes `incoming` in place when it is a buffer of its own, else the
// out-of-place sum replaces it (allocated while both are still alive).
void add_into(Memory& mem, Ref& held, bool& held_is_view, const GradSlot& s, int label) {
  if (held.use_count() > 1 || held_is_view) {
    held = mem.allocate(s.numel * s.elem, label);
    held_is_view = false;
  }
}

}  // namespace

void Graph::accumulate(Emit e) {
  if (!e.to || !e.grad) return;
  GradSlot& s = *e.to;
  if (s.param_label >= 0 && s.uses > 1) {
    // A parameter used more than once: its gradients gather in the input buffer first.
    if (!s.pending) {
      s.pending = std::move(e.grad);
      s.pending_is_view = e.view;
    } else {
      add_into(mem_, s.pending, s.pending_is_view, s, temporaries_label());
    }
    if (++s.arrived < s.uses) return;
    s.arrived = 0;
    e.grad = std::move(s.pending);
    s.pending_is_view = false;
  }
  if (s.grad) {
    add_into(mem_, s.grad, s.grad_is_view, s, s.param_label >= 0 ? s.param_label : temporaries_label());
    if (s.param_label >= 0 && s.on_accumulated) s.on_accumulated();
    return;
  }
  if (s.param_label >= 0) {
    // AccumulateGrad takes over a buffer nobody else holds, and copies one that is shared.
    if (e.grad.use_count() > 1) {
      e.grad = mem_.allocate(s.numel * s.elem, s.param_label);
    } else {
      mem_.relabel(e.grad, s.param_label);
    }
    e.view = false;
  }
  s.grad = std::move(e.grad);
  s.grad_is_view = e.view;
  if (s.param_label >= 0 && s.on_accumulated) s.on_accumulated();
}

void Graph::restore_nodes(std::vector<Node> nodes) {
  if (!nodes_.empty()) throw std::logic_error("sim::Graph::restore_nodes: nodes are already recorded");
  nodes_ = std::move(nodes);
}

void Graph::backward(const Tensor& root, Ref seed) {
  if (!root.slot) return;
  root.slot->grad = seed ? std::move(seed) : mem_.allocate(root.bytes(), temporaries_label());
  std::vector<Node> nodes = std::move(nodes_);
  nodes_.clear();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    Node& n = *it;
    std::vector<Ref> incoming;
    bool any = false;
    for (const SlotPtr& s : n.outputs) {
      incoming.push_back(s->param_label >= 0 ? nullptr : s->grad);
      any = any || s->grad != nullptr;
    }
    std::vector<Emit> out;
    if (any) {
      if (n.offloaded && !n.offloaded->entered) {
        n.offloaded->entered = true;
        n.offloaded->restore(mem_);
        if (const std::shared_ptr<OffloadedLayer> below = n.offloaded->below.lock()) below->restore(mem_);
      }
      out = n.backward(incoming);
    }
    // The node's inputs (incoming gradients) and saved tensors go once it has run.
    incoming.clear();
    for (const SlotPtr& s : n.outputs) {
      if (s->param_label < 0) {
        s->grad.reset();
        s->grad_is_view = false;
      }
    }
    n.saved.clear();
    n.offloaded.reset();
    n.backward = nullptr;
    for (Emit& e : out) accumulate(std::move(e));
  }
}

}  // namespace headroom::sim

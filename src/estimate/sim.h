// sim — a symbolic replay of a training step's memory: buffers, autograd nodes and what they save.
//
// The estimator describes a step as LibTorch executes it — each operator allocates its outputs,
// keeps (saves) some tensors for backward, and its backward allocates gradients and scratch — and
// this engine plays it through: buffers are reference-counted like at::Tensor storage, backward runs
// the nodes in reverse creation order as the autograd engine does on one device, gradients of a
// tensor used twice are summed in place, and parameter gradients take over the first buffer they
// receive (AccumulateGrad) and are summed into it afterwards. Nothing is computed; only sizes move.
// The live total is tracked at every allocation, so the peak, its phase and what it consisted of
// (bytes per label) fall out of the replay.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memory/phase.h"

namespace headroom::sim {

// The breakdown categories of the estimate's JSON contract (headroom estimate --json).
enum class Category {
  weights,
  weight_copies,
  gradients,
  optimizer,
  activations,
  logits,
  loss,
  temporaries,
  allocator,
  other,
  communication,  // data parallel: buckets and gather buffers of the collectives
};
inline constexpr int kCategories = 11;
const char* category_name(Category c);

// What a buffer is, for the table: a name, its category and the formula or reason behind its size.
struct Label {
  std::string name;
  Category category;
  std::string formula;
};

class Memory;

// One allocation; freed when the last handle to it goes.
class Buffer {
 public:
  Buffer(Memory* memory, int id) : memory_(memory), id_(id) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  int id() const { return id_; }

 private:
  Memory* memory_;
  int id_;
};
using Ref = std::shared_ptr<Buffer>;

class Memory {
 public:
  int label(std::string_view name, Category category, std::string_view formula = {});
  Ref allocate(int64_t bytes, int label);
  // Host memory (optimizer offload, optim/offload.h): counted apart from the device's — not in
  // live(), the peak or the events — with a peak of its own.
  Ref allocate_host(int64_t bytes, int label);
  void relabel(const Ref& buffer, int label);
  // The bytes `buffer` was allocated with (before rounding).
  int64_t bytes(const Ref& buffer) const;
  // A phase's peak is at least what is live when it begins (zero_grad allocates nothing).
  void set_phase(Phase phase) {
    phase_ = phase;
    auto& peak = phase_peaks_[static_cast<size_t>(phase)];
    peak = std::max(peak, live_);
  }
  // Allocations are rounded up to a multiple of this (PyTorch's CUDA caching allocator: 512 bytes);
  // what rounding adds is counted under `label`.
  void set_rounding(int64_t granule, int label) {
    granule_ = granule;
    rounding_label_ = label;
  }
  Phase phase() const { return phase_; }

  int64_t live() const { return live_; }
  struct Peak {
    int64_t bytes = 0;
    Phase phase = Phase::idle;
    std::vector<int64_t> by_label;
  };
  const Peak& peak() const { return peak_; }
  const Peak& host_peak() const { return host_peak_; }
  // Starts the peak over from what is live now (the operator table test measures one operator).
  void reset_peak() {
    peak_.bytes = live_;
    peak_.phase = phase_;
    peak_.by_label = by_label_;
  }
  const std::array<int64_t, 6>& phase_peaks() const { return phase_peaks_; }
  const std::vector<Label>& labels() const { return labels_; }
  // Bytes live now under `label`.
  int64_t live_under(int label) const { return by_label_[static_cast<size_t>(label)]; }

  // Every allocation and release so far, in order, at the bytes asked for (before rounding): the
  // sequence a caching allocator would see (estimate/reserved.h replays it).
  struct Event {
    int id = 0;
    int64_t bytes = 0;
    bool allocated = true;  // false: released
  };
  const std::vector<Event>& events() const { return events_; }
  std::vector<Event> take_events() { return std::exchange(events_, {}); }

 private:
  friend class Buffer;
  void release(int id);

  struct Slot {
    int64_t bytes = 0;
    int label = 0;
    int64_t padding = 0;  // rounding, counted under rounding_label_
    bool host = false;    // allocate_host's
  };
  std::vector<Slot> buffers_;
  std::vector<Event> events_;
  std::vector<Label> labels_;
  std::vector<int64_t> by_label_;
  int64_t live_ = 0;
  int64_t granule_ = 1;
  int rounding_label_ = -1;
  Phase phase_ = Phase::idle;
  Peak peak_;
  int64_t host_live_ = 0;
  std::vector<int64_t> host_by_label_;
  Peak host_peak_;
  std::array<int64_t, 6> phase_peaks_{};
};

// Where a tensor's gradient gathers during backward. As in the autograd engine, the gradients that
// arrive for a tensor are first summed in its node's input buffer: the first is held, each later
// one added into it in place when the held buffer is its own (not shared, not a view of another
// tensor), else summed out of place into a new buffer. A parameter's buffer is then handed to
// AccumulateGrad once all its uses have arrived: taken over as .grad (or copied, when shared) the
// first time, added into .grad after that.
struct GradSlot {
  Ref grad;  // the input buffer; a parameter's .grad
  bool grad_is_view = false;
  int64_t numel = 0;
  int elem = 4;
  int param_label = -1;  // >= 0: a parameter's .grad, kept across micro-batches under this label
  int uses = 1;          // parameters: gradients that arrive per backward (a tied embedding: 2)
  int arrived = 0;
  Ref pending;  // parameters used more than once: their input buffer until all arrive
  bool pending_is_view = false;
  // Parameters: called each time AccumulateGrad has run for it (a post-accumulate-grad hook).
  std::function<void()> on_accumulated;
};
using SlotPtr = std::shared_ptr<GradSlot>;

// A tensor: a handle on a buffer (views share it), its size, and its gradient slot when it requires
// one.
struct Tensor {
  Ref buf;
  int64_t numel = 0;
  int elem = 4;  // bytes per element
  SlotPtr slot;  // null: no gradient
  int64_t bytes() const { return numel * elem; }
  bool requires_grad() const { return slot != nullptr; }
};

// A gradient a node's backward sends to one of its inputs. `view`: it is a view of another tensor
// (a transposed matmul result), which the engine cannot add into in place.
struct Emit {
  SlotPtr to;
  Ref grad;
  bool view = false;
};

// --offload activations (model/activation_offload.h): while a Graph has one set, the buffers a
// recorded node saves go to host memory, one copy per buffer and layer, except those `keep` names
// (parameters). Backward, at the first node of a layer that runs, copies all of that layer's buffers
// back to the device (unless they are already) and those of the layer below it (the prefetch); a
// layer's device and host copies go once the last node that saved one of them has run.
struct OffloadedLayer {
  std::vector<Ref> host;    // its buffers' host copies, in the order they were made
  std::vector<Ref> device;  // their copies back on the device (empty: not yet)
  std::weak_ptr<OffloadedLayer> below;
  int restored_label = 0;
  bool entered = false;
  void restore(Memory& mem);
};

struct SavedOffload {
  std::function<bool(const Ref&)> keep;
  int host_label = 0, restored = 0;
  // A new layer begins (the one before it in this forward lies below it).
  void next_layer();
  std::shared_ptr<OffloadedLayer> layer;  // the layer being recorded
  std::map<int, Ref> copies;              // its host copies, by buffer id
};

class Graph {
 public:
  explicit Graph(Memory& memory) : mem_(memory) {}
  Memory& memory() { return mem_; }

  bool grad_mode() const { return grad_mode_; }
  void set_grad_mode(bool on) { grad_mode_ = on; }

  // A new buffer-backed tensor; requires grad when `requires_grad` and grad mode is on.
  Tensor make(int64_t numel, int elem, int label, bool requires_grad);
  // The same storage, seen under a new gradient slot (views: view, transpose, narrow as a view).
  Tensor alias(const Tensor& base, int64_t numel) const;
  // A tensor over a buffer made earlier (per-op checkpointing's kept outputs, handed back in the
  // recompute); requires grad as make() would.
  Tensor adopt(Ref buffer, int64_t numel, int elem, bool requires_grad) const;

  // Records a backward node: `outputs` are the tensors the op produced, `saved` what it keeps, and
  // `backward` turns the outputs' incoming gradients (same order; null when none arrived) into
  // gradients for the inputs. Not recorded when grad mode is off or no output requires grad.
  using Backward = std::function<std::vector<Emit>(const std::vector<Ref>& incoming)>;
  void record(const std::vector<const Tensor*>& outputs, std::vector<Ref> saved, Backward backward);
  // Null: saved buffers stay where they are.
  void set_offload(SavedOffload* offload) { offload_ = offload; }

  // A gradient buffer for `input` (its size and dtype), allocated now.
  Ref grad_for(const Tensor& input, int label);
  Ref scratch(int64_t bytes);  // a temporary, freed by the caller dropping it

  // Runs backward from `root`, seeded with `seed` (null: a new buffer of the root's size, as
  // backward() on a scalar loss makes).
  void backward(const Tensor& root, Ref seed = nullptr);
  int temporaries_label();

  struct Node {
    std::vector<SlotPtr> outputs;
    std::vector<Ref> saved;
    std::shared_ptr<OffloadedLayer> offloaded;  // the layer whose host copies it saved
    Backward backward;
  };
  // The nodes recorded since the last backward, taken out (what they save stays alive with them): a
  // pipeline stage keeps each micro-batch's own until its backward, which runs them after
  // restore_nodes (there must be none recorded then).
  std::vector<Node> take_nodes() { return std::exchange(nodes_, {}); }
  void restore_nodes(std::vector<Node> nodes);

 private:
  void accumulate(Emit e);

  Memory& mem_;
  bool grad_mode_ = true;
  std::vector<Node> nodes_;
  int temporaries_ = -1;
  SavedOffload* offload_ = nullptr;
};

}  // namespace headroom::sim

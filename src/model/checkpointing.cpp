#include "model/checkpointing.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "device/autocast_adapter.h"

namespace headroom {

namespace {

// What backward needs to redo the forward: the function, and the state it ran under.
struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  std::shared_ptr<CheckpointFrame> frame;
  c10::Device device{c10::kCPU};
  at::Tensor rng;
  AutocastState autocast;
};

// The frame made current while fn runs (a no-op without one).
class Entered {
 public:
  Entered(CheckpointFrame* frame, bool recompute) : frame_(frame) {
    if (frame_) frame_->enter(recompute);
  }
  ~Entered() {
    if (frame_) frame_->leave();
  }
  Entered(const Entered&) = delete;
  Entered& operator=(const Entered&) = delete;

 private:
  CheckpointFrame* frame_;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                c10::intrusive_ptr<Recompute> recompute) {
    recompute->device = x.device();
    recompute->rng = rng_state(x.device());
    recompute->autocast = autocast_state(x.device().type());
    at::Tensor y;
    {
      c10::NoGradGuard no_grad;
      const Entered frame(recompute->frame.get(), /*recompute=*/false);
      y = recompute->fn(x);
    }
    ctx->save_for_backward({x});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    // Replay the forward's random numbers, and put the generator back afterwards, even on a throw.
    struct RngRestore {
      c10::Device device;
      at::Tensor state;
      ~RngRestore() { set_rng_state(device, state); }
    } restore{recompute->device, rng_state(recompute->device)};
    set_rng_state(recompute->device, recompute->rng);
    at::Tensor input = x.detach().requires_grad_(true);
    {
      c10::AutoGradMode grad_on(true);
      AutocastScope autocast(recompute->device.type(), recompute->autocast);
      const Entered frame(recompute->frame.get(), /*recompute=*/true);
      // A view, not the leaf itself: autocast caches casts of leaves that require grad (meant for
      // weights), which would make the branches that read the input share one low-precision copy
      // and sum their gradients in low precision.
      at::Tensor y = recompute->fn(input.view_as(input));
      torch::autograd::backward({y}, {grads[0]});
    }
    return {input.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                        std::shared_ptr<CheckpointFrame> frame) {
  // The parameters fn reads are not inputs of the autograd function: if x needs no gradient the
  // output would need none either and backward would never reach them. Run it plainly then.
  if (!x.requires_grad()) return fn(x);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = std::move(fn);
  recompute->frame = std::move(frame);
  return CheckpointFunction::apply(x, recompute)[0];
}

}  // namespace headroom

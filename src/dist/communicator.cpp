#include "dist/communicator.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef HEADROOM_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <string_view>

#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, int lo, int hi) {
  const std::string text = *env(name);
  try {
    size_t used = 0;
    const long v = std::stol(text, &used);
    if (used == text.size() && v >= lo && v <= hi) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  fail("{}={}: expected a whole number in {}..{}", name, text, lo, hi);
}

std::string what_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return first_line(c->what_without_backtrace());
  return first_line(e.what());
}

}  // namespace

std::optional<WorldEnv> world_from_environment() {
  const bool has_rank = env("RANK").has_value(), has_world = env("WORLD_SIZE").has_value();
  if (!has_rank && !has_world) return std::nullopt;
  if (has_rank != has_world) {
    fail("{} is set but {} is not; a distributed run needs both (torchrun sets them), a lone run neither",
         has_rank ? "RANK" : "WORLD_SIZE", has_rank ? "WORLD_SIZE" : "RANK");
  }
  WorldEnv w;
  w.world_size = env_int("WORLD_SIZE", 1, 1 << 20);
  w.rank = env_int("RANK", 0, w.world_size - 1);
  w.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", 0, w.world_size - 1) : w.rank;
  if (w.world_size > 1 && (!env("MASTER_ADDR") || !env("MASTER_PORT"))) {
    fail("WORLD_SIZE={} needs MASTER_ADDR and MASTER_PORT (the rendezvous address; torchrun sets them)",
         w.world_size);
  }
  if (auto a = env("MASTER_ADDR")) w.master_addr = *a;
  if (env("MASTER_PORT")) w.master_port = env_int("MASTER_PORT", 1, 65535);
  if (auto s = env("TORCHELASTIC_USE_AGENT_STORE")) w.agent_store = *s == "True" || *s == "true" || *s == "1";
  if (env("TORCHELASTIC_RESTART_COUNT")) w.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20);
  return w;
}

struct Communicator::Backend {
  c10::intrusive_ptr<c10d::Store> tcp;    // the job's store, which groups share under prefixes
  c10::intrusive_ptr<c10d::Store> store;  // this group's keys, under `prefix`
  std::string prefix;
  c10::intrusive_ptr<c10d::Backend> group;
  bool gloo = true;
  c10::Device device = c10::Device(c10::kCPU);
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor tensor;
  };
  std::vector<Pending> sends;
};

Communicator::Communicator(const WorldEnv& env_in, const c10::Device& device, std::chrono::milliseconds timeout)
    : env_(env_in), timeout_(timeout), backend_(std::make_unique<Backend>()) {
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env_.master_port);
    opts.isServer = env_.rank == 0 && !env_.agent_store;
    opts.numWorkers = env_.agent_store ? std::nullopt : std::optional<std::size_t>(env_.world_size);
    opts.waitWorkers = !env_.agent_store;
    opts.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, opts);
    backend_->tcp = tcp;
    // Each communicator of the process (the doctor's trials make one per run) under its own keys;
    // every rank makes them in the same order, so the numbers agree.
    static int made = 0;
    backend_->prefix = fmt::format("headroom/attempt_{}/group_{}", env_.restart_count, made++);
    backend_->store = c10::make_intrusive<c10d::PrefixStore>(backend_->prefix, tcp);
  } catch (const std::exception& e) {
    fail("rank {}: cannot reach the rendezvous store at {}:{} within {} s: {}", env_.rank, env_.master_addr,
         env_.master_port, timeout.count() / 1000, what_of(e));
  }
  join(device);
}

Communicator::Communicator(const Communicator& parent, const std::vector<int>& members, const std::string& name)
    : env_(parent.env_), timeout_(parent.timeout_), backend_(std::make_unique<Backend>()) {
  const auto me = std::find(members.begin(), members.end(), parent.rank());
  TORCH_CHECK(me != members.end(), "Communicator: rank ", parent.rank(), " is not a member of group ", name);
  env_.rank = static_cast<int>(me - members.begin());
  env_.world_size = static_cast<int>(members.size());
  backend_->tcp = parent.backend_->tcp;
  backend_->prefix = parent.backend_->prefix + "/" + name;
  backend_->store = c10::make_intrusive<c10d::PrefixStore>(backend_->prefix, backend_->tcp);
  join(parent.backend_->device);
}

Communicator::Communicator(const c10::Device& device)
    : timeout_(std::chrono::seconds(1)), backend_(std::make_unique<Backend>()) {
  backend_->device = device;
}

c10::Device Communicator::device() const { return backend_->device; }

void Communicator::join(const c10::Device& device) {
  backend_->device = device;
  const std::chrono::milliseconds timeout = timeout_;
  backend_->gloo = !device.is_cuda();
  try {
    if (device.is_cuda()) {
#ifdef HEADROOM_WITH_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      backend_->group =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(backend_->store, env_.rank, env_.world_size, options);
#else
      fail("this headroom was built without NCCL (no nccl.h was found); a cuda run cannot be distributed");
#endif
    } else {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      if (auto ifname = env("GLOO_SOCKET_IFNAME")) {
        // Several interfaces may be listed, comma-separated, as PyTorch accepts.
        std::string_view rest = *ifname;
        while (!rest.empty()) {
          const size_t comma = rest.find(',');
          options->devices.push_back(
              c10d::ProcessGroupGloo::createDeviceForInterface(std::string(rest.substr(0, comma))));
          rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
        }
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      backend_->group =
          c10::make_intrusive<c10d::ProcessGroupGloo>(backend_->store, env_.rank, env_.world_size, options);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank {}: cannot join the {}-rank {} group within {} s: {}", env_.rank, env_.world_size,
         device.is_cuda() ? "NCCL" : "Gloo", timeout.count() / 1000, what_of(e));
  }
}

Communicator::~Communicator() {
  try {
    wait_sends();
  } catch (...) {  // nothing may throw out of a destructor; a lost peer is reported where it is used
  }
}

template <typename F>
void Communicator::run(const char* op, F&& start) {
  try {
    c10::intrusive_ptr<c10d::Work> work = start();
    work->wait(timeout_);
    if (backend_->gloo) {
      // Gloo's worker marks a collective done before it lets go of it, and with it of the buffers it
      // holds (the tensors given, its own copies): they would outlive this call by a moment, long
      // enough for the next collective's buffers to be allocated beside them on one rank and not on
      // another (the first step's peak, two buckets high on rank 0 only). Wait, a bounded moment,
      // until this is the last reference, so that a collective's memory is gone when it returns.
      // Bounded by 10 s, not less: on an overloaded machine the worker thread can wait its turn for
      // a second or more, and buffers outliving the call add to the rank's peak (suspected in one
      // unexplained pipeline test run in 17 above its estimate, on two cores and four ranks). The
      // caller hands the work over: a reference kept elsewhere would hold every call to the bound.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (work.use_count() > 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
  } catch (const c10::OutOfMemoryError& e) {
    // The collective's own buffers (Gloo's copies): whether the others are already inside it cannot be
    // told from here (Gloo takes the collective's tag before its worker allocates), so the ranks
    // cannot replay the step together; this rank ends, and the others learn of it when its
    // connections close (Gloo) or at --dist-timeout (NCCL).
    fail(
        "rank {}: out of memory inside a {} (its own buffers), which the ranks cannot recover from together: {}; "
        "accepted: a smaller --batch, or more memory",
        env_.rank, op, what_of(e));
  } catch (const std::exception& e) {
    fail("rank {}: lost contact with the other ranks during {} (timeout {} s): {}; another rank has failed or "
         "was stopped — its own output says why",
         env_.rank, op, timeout_.count() / 1000, what_of(e));
  }
}

namespace {
c10d::ReduceOp to_c10d(ReduceOp op) {
  return op == ReduceOp::max ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}
}  // namespace

void Communicator::allreduce(at::Tensor& tensor, ReduceOp op) {
  if (!backend_->group) return;  // alone: the sum is its own
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  run("allreduce", [&] { return backend_->group->allreduce(tensors, opts); });
}

void Communicator::broadcast(at::Tensor& tensor, int root) {
  if (!backend_->group) return;
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  run("broadcast", [&] { return backend_->group->broadcast(tensors, opts); });
}

void Communicator::reduce_scatter(at::Tensor& output, at::Tensor& input) {
  TORCH_CHECK(input.numel() == output.numel() * size(), "reduce_scatter: input must hold world-size chunks");
  if (!backend_->group) {
    output.copy_(input.view_as(output));
    return;
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  run("reduce-scatter", [&] { return backend_->group->_reduce_scatter_base(output, input, opts); });
}

void Communicator::allgather(at::Tensor& output, at::Tensor& input) {
  TORCH_CHECK(output.numel() == input.numel() * size(), "allgather: output must hold world-size chunks");
  if (!backend_->group) {
    output.copy_(input.view_as(output));
    return;
  }
  run("allgather", [&] { return backend_->group->_allgather_base(output, input); });
}

void Communicator::barrier() {
  if (!backend_->group) return;
  run("barrier", [&] { return backend_->group->barrier(); });
}

void Communicator::send(const at::Tensor& tensor, int dst) {
  TORCH_CHECK(backend_->group, "Communicator: a process alone has no one to send to");
  // The sends before this one first: their receivers are never waiting for this rank (a pipeline's
  // receives are posted in schedule order), and a sent tensor then lives exactly until the next
  // send, which the estimate can follow.
  wait_sends();
  std::vector<at::Tensor> tensors{tensor.contiguous()};
  try {
    backend_->sends.push_back({backend_->group->send(tensors, dst, /*tag=*/0), tensors.front()});
  } catch (const std::exception& e) {
    fail("rank {}: lost contact with rank {} while sending to it: {}; another rank has failed or was stopped — its "
         "own output says why",
         env_.rank, dst, what_of(e));
  }
}

void Communicator::recv(at::Tensor& tensor, int src) {
  TORCH_CHECK(backend_->group, "Communicator: a process alone has no one to receive from");
  std::vector<at::Tensor> tensors{tensor};
  run("a receive", [&] { return backend_->group->recv(tensors, src, /*tag=*/0); });
}

void Communicator::wait_sends() {
  std::vector<Backend::Pending> sends = std::move(backend_->sends);
  backend_->sends.clear();
  // The work handed over whole, so that run() can tell when Gloo's worker has let go of it.
  for (Backend::Pending& p : sends) run("a send", [&] { return std::move(p.work); });
}

}  // namespace headroom

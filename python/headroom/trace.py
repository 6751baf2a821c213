"""The allocation trace of a training step: every storage allocated and freed, in order.

:class:`StorageTrace` is a dispatch mode (``torch.utils._python_dispatch.TorchDispatchMode``): each
operator's outputs are looked at after it runs; a storage not seen before is an allocation, and a
finaliser on the storage records its free when the last tensor (or autograd's saved copy) lets it
go. Under ``FakeTensorMode`` nothing is computed, so the trace of a 70B model costs what its
operators' bookkeeping costs; over real tensors the same trace is what the real step allocated.

Each event carries the phase it happened in and a *block tag*: which of the model's repeated blocks
was running (``-1``: none), so that :mod:`headroom.blocks` can repeat a block's events to the full
depth. The tag comes from :meth:`StorageTrace.set_block` (forward and backward hooks) or, in the
optimizer and ``zero_grad`` phases, from the parameter an operator works on.

Another library's operator (``torch.ops.bitsandbytes.*``) whose cpu kernel is written in ATen's is
run with the trace on, so its allocations are seen one by one (real tensors only: a fake tensor has
no kernel to open).

What a kernel allocates inside itself and frees before returning (a cpu kernel's scratch) is not a
storage any operator returns: with ``probe_scratch`` the kernels known to allocate much of it on
the cpu are measured (:mod:`headroom.kernels`, each shape once) and recorded as a transient
allocation; with ``cuda`` the sizes are those of the CUDA kernels that run in the cpu ones' place.

Tracing changes one thing autograd decides: while any dispatch mode is active (and fake tensors are
one), PyTorch treats every tensor as a subclass, and its engine then sums the gradients that meet
at a tensor used twice (a residual branch, tied embeddings) out of place, where a plain run adds
the second into the first. :meth:`StorageTrace.backward` tells the engine's own operators apart
(they run after a node's post-hook) and records such a sum as the in-place add a plain run does:
the first gradient's storage becomes the sum's, when nothing else held it (it is freed at once, and
it is no view of another tensor).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import kernels
from .world import local

PHASES = ("idle", "data", "forward", "backward", "optimizer", "zero_grad")
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
_ATTR = "_headroom_trace_id"

MIXED = -3  # the tag after a foreach operator, which reads every block's tensors at once

# Inside host_memory(): storages made are host memory (headroom.offload_activations' copies), not the
# device's: the trace does not record them, as the counting allocator counts them apart.
_HOST_DEPTH = [0]


@contextlib.contextmanager
def host_memory():
    """What is allocated inside is host memory, left out of the device's trace."""
    _HOST_DEPTH[0] += 1
    try:
        yield
    finally:
        _HOST_DEPTH[0] -= 1

# An event: (storage id, bytes, allocated, phase index, block tag).
Event = Tuple[int, int, bool, int, int]


_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_OWN_NAMESPACES = ("aten", "prims", "profiler", "_c10d_functional", "c10d")


def _opens_up(func, args, kwargs) -> bool:
    """Whether ``func`` is another library's operator with a cpu kernel, called on real cpu tensors."""
    if func.namespace in _OWN_NAMESPACES:
        return False
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors or any(isinstance(t, FakeTensor) or t.device.type != "cpu" for t in tensors):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CPU")


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps, in some order of its
    dimensions (what the engine asks of a gradient it adds into)."""
    expected = 1
    for size, stride in sorted(((sz, st) for sz, st in zip(t.shape, t.stride()) if sz != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _nbytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tree_flatten(tensors)[0]
               if isinstance(t, torch.Tensor))


def _gloo_scratch(func, args) -> int:
    """What Gloo, the cpu collectives' backend, allocates inside a collective and frees when it is
    done: an all-gather lands in a flat copy of its output, a reduce-scatter all-reduces a clone of
    its input (ProcessGroupGloo.cpp). NCCL, on a card, allocates neither."""
    name = func.__name__.split(".")[0]
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        return _nbytes(args[0]) if args else 0
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1]) if len(args) > 1 else 0
    return 0


def _fsdp_work(region: str) -> str:
    """What FSDP allocates in a region: the parameters it gathers, the gradients it reduces."""
    if "all_gather" in region or "pre_forward" in region or "pre_backward" in region or "prefetch" in region:
        return "FSDP gathered parameters"
    if "reduce" in region:
        return "FSDP gradient reduction"
    return "FSDP"


class _Storage:
    __slots__ = ("sid", "nbytes", "owner", "op", "phase", "alive")

    def __init__(self, sid: int, nbytes: int, owner: int, op: str, phase: str):
        self.sid, self.nbytes, self.owner, self.op, self.phase, self.alive = sid, nbytes, owner, op, phase, True


class StorageTrace(TorchDispatchMode):
    """Records the storages the operators under it allocate, and their frees."""

    def __init__(self, probe_scratch: bool = False, cuda: bool = False) -> None:
        super().__init__()
        self.probe_scratch = probe_scratch
        self.cuda = cuda  # sizes as the CUDA kernels allocate them (headroom.kernels)
        self._scratch: Dict[tuple, int] = {}  # shape key -> bytes, of the probed kernels
        self.events: List[Event] = []
        self.storages: Dict[int, _Storage] = {}
        self.phase = "idle"
        self.block = -1  # the block running now (markers), -1 for none
        self.by_param = False  # optimizer/zero_grad: the tag is the block of the tensors an operator reads
        self.block_of: Dict[int, int] = {}  # storage id -> block, for by_param tagging
        self.ops_in_phase = 0
        self.weight_ids: set = set()  # storages of parameters: a copy of one is a weight copy (autocast)
        self._next = 1
        self._finished_node = None  # the autograd node whose post-hook ran last (engine operators follow)
        self._sum = None  # (new id, old id, weakref to the new storage, event index): an engine sum just made
        self.flops = 0  # of every operator traced (forward, backward, recompute)
        self.block_flops: Dict[int, int] = {}  # of the operators run in each block
        # FSDP's profiler regions open now: (handle, block tag or None, what it allocates); the stack's
        # name (``model.layers``) tells which block a region's module is.
        self.stack_name: Optional[str] = None
        self._regions: List[Tuple[None, Optional[int], Optional[str]]] = []

    # --- what the step runner tells it ---------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.ops_in_phase = 0
        self.by_param = phase in ("optimizer", "zero_grad")
        self.block = -1

    def set_block(self, block: int) -> None:
        self.block = block

    def add(self, tensor: torch.Tensor, op: str, block: int = -1) -> int:
        """Records ``tensor``'s storage as allocated now (weights and inputs, before the step)."""
        st = local(tensor).untyped_storage()
        sid = getattr(st, _ATTR, None)
        if sid is not None:
            return sid
        return self._allocate(st, op, block)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with a post-hook on every node of its graph so that the engine's
        gradient sums (made after a node's hooks, under the same node) are known."""
        handles = []
        seen = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ != "AccumulateGrad":
                handles.append(node.register_hook(self._node_done))
            stack.extend(n for n, _ in node.next_functions)
        seen.clear()
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
            self._finished_node = None
            self._sum = None

    def _node_done(self, grad_inputs, grad_outputs) -> None:
        self._finished_node = torch._C._current_autograd_node()

    def storage_id(self, tensor: torch.Tensor) -> Optional[int]:
        sid = getattr(local(tensor).untyped_storage(), _ATTR, None)
        return sid if sid else None

    # --- the recording ------------------------------------------------------------------------
    def _allocate(self, st, op: str, tag: int, nbytes: Optional[int] = None) -> int:
        sid = self._next
        self._next += 1
        nbytes = int(st.nbytes()) if nbytes is None else nbytes
        setattr(st, _ATTR, sid)
        self.storages[sid] = _Storage(sid, nbytes, tag, op, self.phase)
        self.events.append((sid, nbytes, True, _PHASE_INDEX[self.phase], tag))
        weakref.finalize(st, self._free, sid)
        return sid

    def _free(self, sid: int) -> None:
        if self._sum is not None and sid == self._sum[1] and self._summed_in_place():
            return
        s = self.storages.get(sid)
        if s is None or not s.alive:
            return
        s.alive = False
        tag = self._tag(raw=True)
        if self.by_param and (self.ops_in_phase == 0 or tag == MIXED):
            # zero_grad(set_to_none) frees without any operator between them, and a foreach
            # operator's outputs belong to every block at once: each free goes with its storage's block.
            tag = s.owner
        self.events.append((sid, s.nbytes, False, _PHASE_INDEX[self.phase], tag))

    def _summed_in_place(self) -> bool:
        """The engine's sum's first operand is freed right after the sum: nothing else held it, and
        a plain run would have added into it. Its storage becomes the sum's."""
        new, old, ref, index = self._sum
        self._sum = None
        st = ref()
        if st is None or index >= len(self.events) or self.events[index][0] != new:
            return False
        del self.events[index]
        del self.storages[new]
        setattr(st, _ATTR, old)
        weakref.finalize(st, self._free, old)
        return True

    def _engine_sum(self, func, args, out) -> bool:
        """Whether ``func`` is the engine's sum of two gradients, which a plain run does in place."""
        if func is not torch.ops.aten.add.Tensor or self._finished_node is None:
            return False
        if torch._C._current_autograd_node() is not self._finished_node:
            self._finished_node = None  # the next node has begun
            return False
        first = args[0] if args else None
        # A view (a transposed matmul gradient) shares its storage with its base: a plain run adds
        # out of place then too.
        return (isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor) and first._base is None
                and first.shape == out.shape and first.dtype == out.dtype and _dense(first))

    def _param_tag(self, args, kwargs) -> Optional[int]:
        """The block of the parameters (and their state) an operator reads; None: it reads none
        (the tag stays); -2: several blocks at once (a foreach operator)."""
        tags = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                sid = getattr(local(t).untyped_storage(), _ATTR, None)
                if sid in self.block_of:
                    tags.add(self.block_of[sid])
        if not tags:
            return None
        return tags.pop() if len(tags) == 1 else -2

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sum = None
        if func in kernels.META_NEEDS_BF16 and any(isinstance(t, FakeTensor) for t in tree_flatten(args)[0]):
            out = kernels.via_bf16_meta(func, args, kwargs)
        elif _opens_up(func, args, kwargs):
            # A library's own operator (bitsandbytes' 8-bit update) whose cpu kernel is made of
            # ATen's: run that kernel with the trace on, so that what it allocates inside is seen.
            with self:
                out = func.redispatch(_CPU, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if func.namespace == "profiler":
            self._region(func, args, out)
        elif func.namespace == "c10d" and not self.cuda:
            self._transient(_gloo_scratch(func, args), f"{func.__name__.split('.')[0]} (Gloo's copy)")
        if not self.by_param:
            self.ops_in_phase += 1
        formula = kernels.FLOPS.get(func.overloadpacket)
        if formula is not None:
            n = int(formula(*args, **kwargs, out_val=out))
            self.flops += n
            if self.block >= 0:
                self.block_flops[self.block] = self.block_flops.get(self.block, 0) + n
        outputs = [local(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        if self.by_param:
            tag = self._param_tag(args, kwargs)
            if tag is not None:
                self.ops_in_phase += 1  # an operator on the parameters (not the profiler's markers)
                self.block = MIXED if tag == -2 else tag
        fresh = []
        for k, t in enumerate(outputs):
            st = t.untyped_storage()
            if getattr(st, _ATTR, None) is not None:
                continue
            fresh.append((k, t, st))
        if not fresh:
            return out
        inputs = None
        name = str(func).replace("aten.", "").replace(".default", "")
        for k, t, st in fresh:
            if _HOST_DEPTH[0] > 0:
                setattr(st, _ATTR, 0)  # host memory: not the device's
                continue
            if inputs is None:
                inputs = [local(a).untyped_storage() for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, torch.Tensor)]
            if any(st is s for s in inputs):
                # A view of, or a write into, a tensor made before the trace: not an allocation.
                setattr(st, _ATTR, 0)
                continue
            tag = self._tag()
            if self.by_param and isinstance(args[0] if args else None, (list, tuple)):
                # A foreach operator's k-th output belongs to the k-th tensor of its first list.
                first = args[0]
                if k < len(first) and isinstance(first[k], torch.Tensor):
                    tag = self.block_of.get(getattr(local(first[k]).untyped_storage(), _ATTR, None), -1)
            op = name if not self._regions or self._regions[-1][2] is None else f"{self._regions[-1][2]} ({name})"
            if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and \
                    getattr(args[0].untyped_storage(), _ATTR, None) in self.weight_ids:
                op = "weight copy"
            sid = self._allocate(st, op, tag, kernels.cuda_output_bytes(func, k, t, args) if self.cuda else None)
            if self.by_param:
                self.block_of[sid] = tag
            elif self.phase == "backward" and self._engine_sum(func, args, t):
                old = getattr(local(args[0]).untyped_storage(), _ATTR, None)
                if old:
                    self._sum = (sid, old, weakref.ref(st), len(self.events) - 1)
        if self.probe_scratch and func in kernels.PROBED:
            key = kernels.shape_key(func, args, kwargs)
            if key not in self._scratch:
                self._scratch[key] = kernels.kernel_scratch(func, args, kwargs)
            self._transient(self._scratch[key], f"{name} scratch (probed on this cpu)")
        if self.cuda:
            self._transient(kernels.cuda_scratch_bytes(func, args), f"{name} scratch (its CUDA kernel's)")
        return out

    def _transient(self, nbytes: int, op: str) -> None:
        """An allocation freed within the operator: a kernel's scratch."""
        if nbytes <= 0:
            return
        sid = self._next
        self._next += 1
        tag = self._tag()
        self.storages[sid] = _Storage(sid, nbytes, tag, op, self.phase)
        self.storages[sid].alive = False
        self.events.append((sid, nbytes, True, _PHASE_INDEX[self.phase], tag))
        self.events.append((sid, nbytes, False, _PHASE_INDEX[self.phase], tag))

    # --- FSDP2: its regions and its storages' resizes ----------------------------------------------
    def _tag(self, raw: bool = False) -> int:
        """The block tag of what happens now: the block the outermost FSDP region open names (a block's gather or reshard runs in its module's hooks, outside the block's own markers;
        the gather a block's backward prefetches for the next is that block's work), else the
        running block."""
        for _, tag, work in self._regions:
            if work is not None:  # the outermost of FSDP's (the root's names no block: its prefetch is no block's)
                if tag is not None:
                    return tag
                break
        return self.block if raw else (-1 if self.block == MIXED else self.block)

    def _region(self, func, args, out) -> None:
        """FSDP names its work ``FSDP::all_gather (model.layers.3)``: a region of the block it names.
        Regions nest (each is a ``with record_function``), so an exit closes the innermost."""
        if func is torch.ops.profiler._record_function_enter_new.default:
            name = str(args[0]) if args else ""
            tag = None
            if self.stack_name is not None and name.startswith("FSDP::") and name.endswith(")") and " (" in name:
                fqn = name[name.rindex(" (") + 2:-1]
                rest = fqn[len(self.stack_name) + 1:] if fqn.startswith(self.stack_name + ".") else ""
                index = rest.split(".", 1)[0]
                tag = int(index) if index.isdigit() else None
            work = _fsdp_work(name) if name.startswith("FSDP::") else (self._regions[-1][2] if self._regions else None)
            self._regions.append((None, tag, work))
        elif func is torch.ops.profiler._record_function_exit._RecordFunction and self._regions:
            self._regions.pop()

    @contextlib.contextmanager
    def resizes(self):
        """Storage resizes recorded: FSDP frees a gathered parameter by resizing its storage to
        nothing, and allocates it again by resizing it back."""
        original = torch.UntypedStorage.resize_
        trace = self

        def resize_(st, size):
            before = st.nbytes()
            result = original(st, size)
            trace._resized(st, before, int(size))
            return result

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original

    def _resized(self, st, before: int, after: int) -> None:
        if after == before or _HOST_DEPTH[0] > 0:
            return
        sid = getattr(st, _ATTR, None)
        if sid == 0:
            return  # made before the trace
        if sid is not None:
            self._free(sid)
        if after > 0:
            op = f"{self._regions[-1][2]} (resize_)" if self._regions and self._regions[-1][2] else "resize_"
            self._allocate(st, op, self._tag(), after)

    # --- afterwards ---------------------------------------------------------------------------
    def live_ids(self) -> List[int]:
        return [s.sid for s in self.storages.values() if s.alive]

"""A world of N ranks inside one process, for tracing what one rank of a distributed run holds.

:func:`fake_world` initialises torch's *fake* process group (no communication: every collective
completes at once and leaves its output's shape, which is all a trace needs) as rank ``r`` of
``N``, and the device mesh handed to the user's ``parallelize(model, mesh)``: the function that
applies their parallelism (``fully_shard`` with a ``MixedPrecisionPolicy``, ``parallelize_module``,
``checkpoint_wrapper``), the shape of torchtitan's ``parallelize_llama``. :meth:`World.parallelized`
runs it on a copy of the model built on the meta device, so the user's model is never changed.

This module is the one adapter to PyTorch's private distributed pieces: the fake backend lives in
``torch.testing._internal.distributed.fake_pg``, and a DTensor's shard is its ``_local_tensor``.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch

Parallelize = Callable[[torch.nn.Module, Any], Optional[torch.nn.Module]]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard, any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class World:
    """Rank ``rank`` of ``size`` ranks, and the mesh ``parallelize`` gets."""

    def __init__(self, size: int, rank: int, mesh: Any, parallelize: Optional[Parallelize]):
        self.size, self.rank, self.mesh, self._parallelize = size, rank, mesh, parallelize

    def parallelized(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` on the meta device (a real model's weights are not copied) with the
        user's parallelism applied."""
        memo: dict = {}
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in memo and not t.is_meta:
                meta = torch.empty_like(t, device="meta")
                memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else meta
        clone = copy.deepcopy(model, memo)
        if self._parallelize is None:
            return clone
        try:
            out = self._parallelize(clone, self.mesh)
        except Exception as e:  # noqa: BLE001 - the user's function's own error, said where it happened
            raise ParallelizeError(f"headroom.estimate: parallelize(model, mesh) at world size {self.size}, rank "
                                   f"{self.rank}: {type(e).__name__}: {e}") from e
        if out is not None and not isinstance(out, torch.nn.Module):
            raise ParallelizeError(f"headroom.estimate: parallelize(model, mesh) returned a {type(out).__name__}: "
                                   "accepted: the model (or None); pipeline stages and schedules "
                                   "(torch.distributed.pipelining) are not traced: estimate each stage's module")
        return out if out is not None else clone

    def describe(self) -> dict:
        return {"world_size": self.size, "rank": self.rank, "mesh": {
            "shape": list(self.mesh.mesh.shape), "dim_names": list(self.mesh.mesh_dim_names or [])}}


class ParallelizeError(RuntimeError):
    """The user's ``parallelize`` raised (its own error is the cause)."""


def check_world(world_size: int, rank: int, mesh_shape: Optional[Sequence[int]],
                mesh_dim_names: Optional[Sequence[str]]) -> Tuple[Tuple[int, ...], Optional[Tuple[str, ...]]]:
    """The mesh's shape and names, checked; one-line errors saying what is accepted."""
    if not isinstance(world_size, int) or world_size < 1 or world_size > 1 << 20:
        raise ValueError(f"world_size {world_size!r}: accepted: an integer from 1 to {1 << 20}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r}: accepted: an integer from 0 to world_size - 1 ({world_size - 1})")
    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    product = 1
    for d in shape:
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"mesh_shape {tuple(shape)}: accepted: positive integers whose product is world_size")
        product *= d
    if product != world_size:
        raise ValueError(f"mesh_shape {tuple(shape)} holds {product} ranks, not world_size {world_size}: "
                         "accepted: a shape whose product is world_size, e.g. (world_size // 2, 2)")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else (("dp",) if len(shape) == 1 else None)
    if names is not None and (len(names) != len(shape) or len(set(names)) != len(names)):
        raise ValueError(f"mesh_dim_names {names}: accepted: one distinct name per dimension of mesh_shape {shape}")
    return shape, names


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, parallelize: Optional[Parallelize],
               mesh_shape: Optional[Sequence[int]] = None,
               mesh_dim_names: Optional[Sequence[str]] = None) -> Iterator[World]:
    """Rank ``rank`` of a fake process group of ``world_size`` ranks, destroyed on leaving."""
    shape, names = check_world(world_size, rank, mesh_shape, mesh_dim_names)
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("estimate(world_size=...): this torch was built without torch.distributed")
    if dist.is_initialized():
        raise RuntimeError("estimate(world_size=N): a process group is already initialised in this process; "
                           "accepted: calling it where none is (before init_process_group, or in its own process), "
                           "as it makes a fake one of N ranks")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        yield World(world_size, rank, mesh, parallelize)
    finally:
        dist.destroy_process_group()

"""The process groups of one engine core's workers, and the collectives the sharded model calls.

Every worker process of a tensor-parallel engine joins one torch.distributed world (gloo on CPU,
NCCL on CUDA) at start-up; the tensor-parallel group is that world. Model code never touches
torch.distributed: it asks `get_tp_group()` for its rank and size and calls `all_reduce` /
`all_gather` on it. In a process that never initialised a world (TP=1, the tests of single
layers) the group is a single rank and every collective returns its input.

On CPU the collectives go through shared memory (shm_communicator.py) when all ranks share a
machine: two gloo all-reduces per decoder layer over loopback TCP would cost more than the
layer. Across machines (Ray) they are gloo's; on CUDA, NCCL's.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.distributed.shm_communicator import ShmCommunicator


@dataclass
class GroupCoordinator:
    rank_in_group: int
    world_size: int
    cpu_group: dist.ProcessGroup | None = None  # gloo, for barriers
    device_group: dist.ProcessGroup | None = None  # the tensors' device (CUDA: NCCL)
    communicator: ShmCommunicator | None = None  # CPU ranks on one host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if torch.jit.is_tracing():  # a trace records the op and calls it when replayed
            return torch.ops.minivllm_dist.tp_all_reduce(x)
        return self.all_reduce_eager(x)

    def all_reduce_eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicator is not None:
            return self.communicator.all_reduce(x)
        x = x.clone()
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x of every rank (same shape everywhere), concatenated along dim in rank order."""
        if self.world_size == 1:
            return x
        if self.communicator is not None:
            return self.communicator.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def destroy(self) -> None:
        if self.communicator is not None:
            self.communicator.close()
            self.communicator = None


@torch.library.custom_op("minivllm_dist::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The TP group's all-reduce as an op, so that a TorchScript trace of the forward
    (worker/step_traces.py) records it: the trace keeps ops, not Python calls."""
    return _TP.all_reduce_eager(x)


@_tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_SINGLE = GroupCoordinator(rank_in_group=0, world_size=1)
_TP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, device: torch.device, use_shm: bool = True
) -> None:
    """Join the world of the engine core's workers and build its tensor-parallel group (the whole
    world: minivllm has no pipeline stages). use_shm=False keeps CPU collectives on gloo (tests
    compare the two)."""
    global _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    group = GroupCoordinator(rank, world_size, cpu_group, dist.group.WORLD)
    if device.type == "cpu" and use_shm and world_size > 1 and _on_one_host(world_size):
        group.communicator = ShmCommunicator(
            rank, world_size, communicator_shm_name(init_method), lambda: dist.barrier(group=cpu_group)
        )
    _TP = group


def _on_one_host(world_size: int) -> bool:
    """Whether every rank runs on this machine (shared memory reaches them all); Ray may place
    ranks on several."""
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts)) == 1


def communicator_shm_name(init_method: str) -> str:
    """The shared-memory segment of a world's CPU collectives, named after the world's rendezvous
    address: the executor that started the ranks removes it by that name, even after a crash."""
    return "minivllm_tp_" + hashlib.sha1(init_method.encode()).hexdigest()[:16]


def destroy_distributed_environment() -> None:
    global _TP
    _TP.destroy()
    _TP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()

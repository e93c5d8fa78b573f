"""All-reduce and all-gather between the ranks of one host through one shared-memory segment.

A tensor-parallel layer all-reduces twice per decoder layer; a decode step of a small model is a
few hundred microseconds of compute per layer, and a gloo all-reduce over TCP costs about as
much. Here each rank copies its tensor into its own slot of a segment every rank has mapped,
announces it by bumping its counter, waits until every rank has announced the same call, then
reads the others' slots. There is no second barrier: slots alternate between two sets by call
parity, and a rank can only start writing set p again two calls later, after every rank has
announced the call in between, which each does only after reading set p.

Each rank sums the slots in rank order, so every rank gets the same bits (ranks must: each one
samples from the gathered logits and must pick the same tokens).

NOTE: the counter store is an ordinary store after the slot's copy; readers see them in that
order because x86 keeps stores in program order (total store order). A weaker memory model
(ARM) would need fences here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import numpy as np
import torch

from minivllm.distributed.shm_broadcast import attach_segment

# Bytes per rank and parity: larger tensors go through in pieces. 8 MiB holds a 4096-token step of
# hidden size 512 in float32 in one piece.
SLOT_BYTES = 8 << 20
_SPIN_ROUNDS = 2000  # polls before yielding the core between polls


class ShmCommunicator:
    """The collectives of one group whose ranks share a host. Rank 0 creates the segment under
    `name` (chosen by whoever starts the ranks, so that it can remove the segment should rank 0
    die), `barrier` waits for all ranks, then the others attach."""

    def __init__(
        self, rank: int, world_size: int, name: str, barrier: Callable[[], None], slot_bytes: int = SLOT_BYTES
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        size = 2 * world_size * slot_bytes + world_size * 8
        if rank == 0:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            barrier()
        else:
            barrier()
            self._shm = attach_segment(name)  # rank 0 owns it
        self._creator = rank == 0
        buf = self._shm.buf
        self._data = torch.frombuffer(buf, dtype=torch.uint8, count=2 * world_size * slot_bytes)
        self._data = self._data.view(2, world_size, slot_bytes)
        self._counters = np.ndarray((world_size,), np.int64, buf, offset=2 * world_size * slot_bytes)
        self._counters[rank] = 0
        self._calls = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks; float32 accumulation beyond two ranks."""
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        for start, slots in self._exchange(flat):
            piece = out[start:start + slots.shape[1]]
            if self.world_size == 2:  # one rounding of the exact sum, in any dtype
                torch.add(slots[0], slots[1], out=piece)
            else:
                piece.copy_(slots.sum(0, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype))
        return out.view(x.shape)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x (same shape on every rank), concatenated along dim in rank order."""
        flat = x.reshape(-1)
        gathered = torch.empty((self.world_size, flat.numel()), dtype=x.dtype)
        for start, slots in self._exchange(flat):
            gathered[:, start:start + slots.shape[1]].copy_(slots)
        return torch.cat(gathered.view(self.world_size, *x.shape).unbind(0), dim=dim % x.dim())

    def _exchange(self, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Send flat to every rank in pieces of one slot; yields (offset, every rank's piece as
        [world_size, n]), which the caller must use before asking for the next piece (the slot
        set is reused two pieces later)."""
        slots_of = self._typed.get(flat.dtype)
        if slots_of is None:  # [parity, rank, elements] in this dtype, made once per dtype
            slots_of = self._typed[flat.dtype] = self._data.view(flat.dtype)
        per_slot = slots_of.shape[2]
        for start in range(0, max(flat.numel(), 1), per_slot):
            piece = flat[start:start + per_slot]
            n = piece.numel()
            self._calls += 1
            slots = slots_of[self._calls & 1]
            slots[self.rank, :n].copy_(piece)
            self._counters[self.rank] = self._calls
            self._wait_for_all(self._calls)
            yield start, slots[:, :n]

    def _wait_for_all(self, call: int) -> None:
        counters = self._counters
        spins = 0
        while counters.min() < call:
            spins += 1
            if spins > _SPIN_ROUNDS:
                # The peer is late (an uneven shard, or more processes than cores): let it run.
                os.sched_yield()
                if spins > 100 * _SPIN_ROUNDS:
                    time.sleep(0.0001)

    def close(self) -> None:
        """Unmap the segment (and remove it, on the rank that created it)."""
        if self._shm is None:
            return
        del self._data, self._counters, self._typed
        self._shm.close()
        if self._creator:
            self._shm.unlink()
        self._shm = None

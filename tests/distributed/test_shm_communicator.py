"""The shared-memory collectives of CPU tensor parallelism, in real processes: all-reduce and
all-gather against sums and concatenations computed independently (every rank can rebuild
every rank's input from its seed), the same bits on every rank, tensors larger than a slot
(pieces), empty ones, 2 and 3 ranks, gloo's own all-reduce as a second reference, and the
segment gone from /dev/shm once every rank has closed it; and the TP group model code uses, on
shared memory and on gloo."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import (
    communicator_shm_name,
    destroy_distributed_environment,
    get_tp_group,
    init_distributed_environment,
)
from minivllm.distributed.shm_communicator import ShmCommunicator

SHAPES = [(0,), (1, 7), (3, 100), (64, 33)]  # the last two exceed the 256-byte slot: pieces


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randn(shape, generator=gen).to(dtype)


def _rank_main(rank: int, world: int, init_method: str, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank)
        comm = ShmCommunicator(rank, world, communicator_shm_name(init_method), dist.barrier, slot_bytes=256)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                inputs = [_inputs(r, shape, dtype) for r in range(world)]
                reduced = comm.all_reduce(inputs[rank])
                if world == 2:  # one rounding of the exact sum: what float32 addition then rounding gives
                    expected = (inputs[0].float() + inputs[1].float()).to(dtype)
                else:  # float32 accumulation in rank order, rounded once
                    expected = sum((x.float() for x in inputs[1:]), inputs[0].float()).to(dtype)
                assert reduced.dtype == dtype and torch.equal(reduced, expected), (dtype, shape)
                if dtype == torch.float32:
                    gloo = inputs[rank].clone()
                    dist.all_reduce(gloo)
                    torch.testing.assert_close(reduced, gloo, rtol=1e-6, atol=1e-6)
                gathered = comm.all_gather(inputs[rank], dim=-1)
                assert torch.equal(gathered, torch.cat(inputs, dim=-1)), (dtype, shape)
                # Every rank holds the same bits.
                everyone = [torch.empty_like(reduced) for _ in range(world)]
                dist.all_gather(everyone, reduced)
                assert all(torch.equal(e, reduced) for e in everyone)
        assert comm.all_gather(_inputs(rank, (2, 3), torch.float32), dim=0).shape == (2 * world, 3)
        dist.barrier()
        comm.close()
        dist.barrier()
        assert not os.path.exists(f"/dev/shm/{communicator_shm_name(init_method)}")
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")


def _group_main(rank: int, world: int, init_method: str, errors, use_shm: bool) -> None:
    """The TP group as model code sees it: shared memory on one host, gloo when told not to (the
    path ranks on several machines take); the same answers either way."""
    try:
        init_distributed_environment(world, rank, init_method, torch.device("cpu"), use_shm=use_shm)
        group = get_tp_group()
        assert (group.rank_in_group, group.world_size) == (rank, world)
        assert (group.communicator is not None) == use_shm
        inputs = [_inputs(r, (3, 100), torch.float32) for r in range(world)]
        assert torch.equal(group.all_reduce(inputs[rank]), inputs[0] + inputs[1])
        assert torch.equal(group.all_gather(inputs[rank], dim=0), torch.cat(inputs, dim=0))
        destroy_distributed_environment()
        assert get_tp_group().world_size == 1
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.parametrize(("world", "target", "extra"), [
    (2, _rank_main, ()), (3, _rank_main, ()), (2, _group_main, (True,)), (2, _group_main, (False,)),
], ids=["shm-2", "shm-3", "group-shm", "group-gloo"])
def test_collectives_across_processes(world, target, extra, free_tcp_port):
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_tcp_port}"
    procs = [context.Process(target=target, args=(r, world, init_method, errors, *extra)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

"""The executor whose workers are Ray actors: tensor-parallel ranks on the machines of a Ray cluster.

Start-up: join the cluster this process can see (`ray start --head` here, or RAY_ADDRESS / `ray
start --address=...` pointing at one), else start a local one with this machine's cores; reserve
one bundle per rank in a placement group (PACK: as few machines as possible), start one actor per
bundle, and meet in one torch.distributed world at rank 0's address. Ranks that share a machine
split its cores and, when all of them share one, reduce through shared memory; across machines
through gloo.

Each call is one Ray task per actor (`execute_method`), results by rank; a step takes rank 0's.
An actor that dies (its process killed, its machine gone) fails the call that waits on it, and
check_health pings the actors while the engine idles: the engine core then reports itself dead.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minivllm.distributed.parallel_state import communicator_shm_name
from minivllm.distributed.shm_broadcast import unlink_segment
from minivllm.executor.abstract import Executor, ExecutorFailedError
from minivllm.executor.cpu_placement import cpus_of_rank, pin_to_cpus
from minivllm.logger import init_logger
from minivllm.utils import get_open_port

if TYPE_CHECKING:
    from minivllm.config import VllmConfig

logger = init_logger(__name__)

PLACEMENT_GROUP_TIMEOUT_S = 120  # a cluster without room for every rank never gets one
HEALTH_TIMEOUT_S = 10


class RayWorkerWrapper:
    """A Worker inside a Ray actor: created empty (Ray places it), then told its rank, cores and
    world by the executor, which runs Worker methods on it by name."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node(self) -> tuple[str, str, list[int]]:
        """(node id, IP address, cores this actor may use)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), sorted(os.sched_getaffinity(0))

    def open_port(self) -> int:
        return get_open_port(host="0.0.0.0")

    def pid(self) -> int:
        return os.getpid()

    def init_worker(self, vllm_config: VllmConfig, rank: int, distributed_init_method: str, cpus: list[int]) -> str:
        from minivllm.worker.worker import Worker

        pin_to_cpus(cpus)
        self.worker = Worker(vllm_config, local_rank=rank, rank=rank, distributed_init_method=distributed_init_method)
        return socket.gethostname()

    def execute_method(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.vllm_config.parallel_config.world_size
        self.is_failed = False
        self.actors: list[Any] = []
        self.placement_group = None
        self.distributed_init_method: str | None = None
        self._rank0_here = False
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # An existing cluster if one is running (or RAY_ADDRESS names one), else a local one.
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        cpus_per_worker = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.world_size)
        try:
            self.placement_group = placement_group([{"CPU": cpus_per_worker}] * self.world_size, strategy="PACK")
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_GROUP_TIMEOUT_S)
            actor_cls = ray.remote(num_cpus=cpus_per_worker)(RayWorkerWrapper)
            self.actors = [
                actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank)).remote()
                for rank in range(self.world_size)
            ]
            nodes = ray.get([a.node.remote() for a in self.actors])
            # Rank 0 makes the collectives' segment; on this machine, shutdown can remove it
            # should rank 0 die before it does.
            self._rank0_here = nodes[0][0] == ray.get_runtime_context().get_node_id()
            self.distributed_init_method = f"tcp://{nodes[0][1]}:{ray.get(self.actors[0].open_port.remote())}"
            ray.get([
                actor.init_worker.remote(self.vllm_config, rank, self.distributed_init_method, _cpus(nodes, rank))
                for rank, actor in enumerate(self.actors)
            ])
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray executor: %d workers on %d node(s), %d CPUs each",
                    self.world_size, len({n[0] for n in nodes}), cpus_per_worker)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self.is_failed:
            raise ExecutorFailedError("A worker died; the executor is shut down.")
        refs = [a.execute_method.remote(method, args, kwargs or {}) for a in self.actors]
        try:
            # As each finishes, not in rank order: the others may be waiting on a dead one in a
            # collective, and would never finish.
            pending = refs
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self.is_failed = True
            raise ExecutorFailedError(f"A worker died during {method}(): {e}") from None

    def check_health(self) -> None:
        try:
            ray.get([a.pid.remote() for a in self.actors], timeout=HEALTH_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self.is_failed = True
            raise ExecutorFailedError(f"A worker is gone: {e}") from None

    def shutdown(self) -> None:
        """Let the workers leave their world (rank 0 removes its shared memory; if it cannot, a
        dead peer holding it in a collective, this process does), kill the actors, free their
        placement group, and stop Ray if this executor started it."""
        if not ray.is_initialized():
            return
        if self.actors and not self.is_failed:
            try:
                ray.get([a.execute_method.remote("shutdown", (), {}) for a in self.actors], timeout=HEALTH_TIMEOUT_S)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass  # killed below all the same
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.distributed_init_method is not None and self._rank0_here:
            unlink_segment(communicator_shm_name(self.distributed_init_method), tracked_here=False)
        if self._started_ray:
            ray.shutdown()


def _cpus(nodes: list[tuple[str, str, list[int]]], rank: int) -> list[int]:
    """Rank's cores: its machine's cores shared among the ranks placed there."""
    node_id, _, cpus = nodes[rank]
    local = [r for r, node in enumerate(nodes) if node[0] == node_id]
    return cpus_of_rank(cpus, len(local), local.index(rank))

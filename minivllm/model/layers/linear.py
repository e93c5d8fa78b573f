"""Linear layers whose parameters know how to load themselves from a checkpoint, whole or as one
tensor-parallel rank's share.

Weights are loaded in the [out_features, in_features] layout and applied with F.linear.
Projections that read the same input are fused into one matrix (q/k/v, gate/up); each fused
parameter carries a `weight_loader` that copies a checkpoint shard ("q", "k", "v", or an index)
into its rows.

Under tensor parallelism (vLLM's scheme, Megatron's) a column-parallel layer holds a slice of
the output rows and a row-parallel one a slice of the input columns, and sums the ranks' partial
products (all-reduce); attention splits by heads, keeping each query head with its KV head
(`head_shard`). Each layer takes its slice from the full checkpoint tensor as it loads, so any
checkpoint loads into any TP size. A layer loaded from GGUF Q4_1 also keeps the int4 codes, one
loaded from Q8_0 or Q5_0 int8 codes, and uses them for inputs of few rows (see quant.py).

On CPU in bfloat16, F.linear runs oneDNN, which re-blocks the [out, in] weight into its GEMM
layout on every call. Where the platform says so (platforms/cpu.py: use_packed_linear),
`process_weights_after_loading` does that once, for the GEMM this CPU runs faster
(platforms/cpu_gemm.py times both). oneDNN's: the weight becomes oneDNN's packed tensor (same
memory) and `linear` calls oneDNN's linear on it, through minivllm's packed_linear op
(ops/csrc/packed_linear.cpp), which step traces can record; same results as F.linear bit for
bit, per call 2x faster at 1 row, 1.6x at 8, 1.1-1.2x at 64-512 rows (2-core AVX-512 CPU).
minivllm's (ops/csrc/bf16_gemm.cpp, float32 FMAs on the bfloat16 weight): the weight becomes
panels of 32 output columns; the products are the same, only the order of the float32 sums
differs, so a result may differ from F.linear's in its last bfloat16 bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import get_tp_group
from minivllm.model.layers.quant import (
    GroupQuantized,
    Int4Weight,
    Q4_1Tiles,
    Q4_1Weight,
    Q8_0Weight,
    pack_q4_1,
)
from minivllm.ops import cpu_kernels
from minivllm.platforms.cpu_gemm import PANEL, use_minivllm_gemm

Checkpoint = torch.Tensor | GroupQuantized


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] weight in the layout of the GEMM this CPU runs faster, for `linear`:
    minivllm's panels ([out / 32, in, 32]) or oneDNN's blocked tensor (platforms/cpu_gemm.py)."""
    if weight.shape[0] % PANEL == 0 and use_minivllm_gemm():
        return torch.ops.minivllm_cpu.bf16_pack_weight(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), for a plain weight or one packed by pack_linear_weight."""
    if weight.is_mkldnn:
        return torch.ops.minivllm_cpu.packed_linear(x, weight, bias)
    if weight.dim() == 3:
        return torch.ops.minivllm_cpu.bf16_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def shard_range(total: int, world_size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """(start, size) of rank's contiguous share of `total`, in whole units, as even as possible
    (the first ranks take one unit more when it does not divide)."""
    if total % unit:
        raise ValueError(f"{total} does not split into units of {unit}.")
    base, extra = divmod(total // unit, world_size)
    return (rank * base + min(rank, extra)) * unit, (base + (rank < extra)) * unit


def split_unit(size: int) -> int:
    """The unit a dimension splits in between ranks: whole quantization groups (32 columns, which
    the Q4_1 kernel needs) where the size allows."""
    return 32 if size % 32 == 0 else 1


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of rank. KV heads split between
    ranks, unevenly if they must (3 KV heads on 2 ranks: 2 and 1), each taking its query heads
    along; with more ranks than KV heads, each KV head is replicated on tp / kv ranks, which
    share its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start, kv_count = shard_range(num_kv_heads, world_size, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    replicas = world_size // num_kv_heads
    if world_size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not divide the attention heads: with {num_kv_heads} KV "
            f"heads it must divide them or be a multiple of them, and {num_heads} query heads must split evenly."
        )
    kv_start, q_count = rank // replicas, group // replicas
    return kv_start * group + (rank % replicas) * q_count, q_count, kv_start, 1


class Linear(nn.Module):
    """y = x W^T (+ b), the whole matrix on every rank (replicated); parameters allocated
    uninitialised (they are always loaded)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        """Sizes of the matrix this rank holds."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # The matrix as GGUF codes, for steps of at most `quantized.max_rows` rows. Which of the
        # two a step multiplies is chosen inside the gguf_linear op where the C++ kernels are
        # built (a step trace then records the choice, not one branch of it), else here in Python.
        self.quantized: Q4_1Tiles | Int4Weight | Q8_0Weight | None = None
        self.rows_choice_in_op = False
        self._quantized_shards: dict[object, GroupQuantized] = {}

    def rank_share(self, loaded: Checkpoint, shard_id: object, is_bias: bool) -> Checkpoint:
        """The part of a checkpoint tensor (or of one fused shard of it) this rank holds."""
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, self.rank_share(loaded_weight, shard_id, param.dim() == 1))

    def load_quantized(self, weight: GroupQuantized, shard_id: object = None) -> None:
        """Keep one shard's GGUF codes; once every shard of the matrix is in, and all of one
        kind, pack them for their kernel (a matrix of mixed kinds keeps its dequantized weight
        only)."""
        self._quantized_shards[shard_id] = self.rank_share(weight, shard_id, is_bias=False)
        order = [None] if shard_id is None else list(self.shard_offsets)  # shards: merged layers only
        if not all(s in self._quantized_shards for s in order):
            return
        shards = [self._quantized_shards[s] for s in order]
        self._quantized_shards = {}
        if all(isinstance(s, Q4_1Weight) for s in shards):
            self.quantized = pack_q4_1(shards)
        elif all(isinstance(s, Q8_0Weight) for s in shards):
            self.quantized = Q8_0Weight.cat(shards)
        self.rows_choice_in_op = self.quantized is not None and cpu_kernels.enabled()

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN (see the module docstring); called once, after loading."""
        self.weight = nn.Parameter(pack_linear_weight(self.weight), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_weight(x, self.bias)

    def apply_weight(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.rows_choice_in_op:
            assert self.quantized is not None
            return torch.ops.minivllm_cpu.gguf_linear(
                x, self.weight, bias, self.quantized.max_rows, self.quantized.codes_kind, *self.quantized.op_codes()
            )
        if self.quantized is not None and x.shape[0] <= self.quantized.max_rows:
            out = self.quantized.matmul(x).to(x.dtype)
            return out if bias is None else out + bias
        return linear(x, self.weight, bias)


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input stacked along the output dimension, each split
    between ranks by output rows.

    `shard_sizes` maps each shard id to its number of output rows in the checkpoint, in stacking
    order.
    """

    def __init__(self, input_size: int, shard_sizes: dict[object, int], bias: bool = False) -> None:
        tp = get_tp_group()
        self._init_shards(input_size, {
            shard_id: (size, *shard_range(size, tp.world_size, tp.rank_in_group, split_unit(size)))
            for shard_id, size in shard_sizes.items()
        }, bias)

    def _init_shards(self, input_size: int, slices: dict[object, tuple[int, int, int]], bias: bool) -> None:
        """slices: shard id -> (rows in the checkpoint, first row of this rank, rows of this rank)."""
        super().__init__(input_size, sum(size for _, _, size in slices.values()), bias)
        self.shard_slices = slices
        self.shard_offsets: dict[object, tuple[int, int]] = {}  # shard id -> (offset, rows) in the parameter
        offset = 0
        for shard_id, (_, _, size) in slices.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def rank_share(self, loaded: Checkpoint, shard_id: object, is_bias: bool) -> Checkpoint:
        _, start, size = self.shard_slices[shard_id]
        return loaded.narrow(0, start, size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused matrix
            checkpoint_offset = 0
            for sid, (rows, _, _) in self.shard_slices.items():
                self.weight_loader(param, loaded_weight.narrow(0, checkpoint_offset, rows), sid)
                checkpoint_offset += rows
            return
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), self.rank_share(loaded_weight, shard_id, False))


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused query/key/value projection: [q (heads), k (kv_heads), v (kv_heads)] rows, of this
    rank's heads (head_shard)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_group()
        q_start, q_count, kv_start, kv_count = head_shard(num_heads, num_kv_heads, tp.world_size, tp.rank_in_group)
        kv = (num_kv_heads * head_dim, kv_start * head_dim, kv_count * head_dim)
        self._init_shards(
            hidden_size, {"q": (num_heads * head_dim, q_start * head_dim, q_count * head_dim), "k": kv, "v": kv}, bias
        )
        self.num_heads, self.num_kv_heads = q_count, kv_count
        self.q_size = q_count * head_dim
        self.kv_size = kv_count * head_dim


class RowParallelLinear(Linear):
    """A projection whose input is split between ranks by columns (the output of a column-parallel
    layer, never gathered): each rank multiplies its columns, the ranks' products are summed
    (all-reduce), then the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_slice: tuple[int, int] | None = None) -> None:
        """input_slice: (first column, columns) of this rank; an even split when None."""
        tp = get_tp_group()
        self.tp = tp
        start, size = input_slice or shard_range(input_size, tp.world_size, tp.rank_in_group, split_unit(input_size))
        super().__init__(size, output_size, bias)
        self.input_start = start

    def rank_share(self, loaded: Checkpoint, shard_id: object, is_bias: bool) -> Checkpoint:
        return loaded if is_bias else loaded.narrow(1, self.input_start, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.apply_weight(x, self.bias)
        out = self.tp.all_reduce(self.apply_weight(x, None))
        return out if self.bias is None else out + self.bias

"""Quantized GGUF weights kept as stored, for small batches on CPU.

Q4_1 layers run minivllm's q4_1_linear (ops/csrc/q4_1_linear.cpp) on CPUs with AVX512-BF16, torch's
packed int4 kernel elsewhere; a Q8_0 lm_head runs minivllm's q8_0_linear (ops/csrc/q8_0_linear.cpp)
on its exact int8 codes and scales.

A decode step of a small model on a CPU is bound by memory bandwidth: every weight is read once
per step for a handful of rows. Read as 4-bit codes with a scale and offset per 32 weights, the
same layer moves a quarter of the bytes of bfloat16. Q4_1 (w = scale * q + min, q in [0, 16)) maps
exactly onto the kernel's groups of 32 (w = (q - 8) * scale + zero, so zero = min + 8 * scale);
scale and zero are rounded to bfloat16, which the kernel requires: the weights it sees differ
from the bfloat16-rounded dequantized ones by at most a bfloat16 rounding step. minivllm's kernel
uses the file's scales and mins as they are, and reads the 30 layers of SmolLM2 1.5x faster at one
row, 1.7x at 4-8 (docs/perf-log.md, round 5).
Like vLLM's GGUF layers (a GEMV kernel for few rows, dequantize-and-matmul for many), larger
batches keep using the dequantized bfloat16 matrix, where the int4 kernel is slower; and, as
there, one op makes that choice by rows (ops/csrc/gguf_linear.cpp: codes_kind and op_codes say
which kernel and codes it takes), so a recorded step replays either side of the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from minivllm.ops import cpu_kernels

Q4_1_GROUP = 32
# Rows up to which torch's int4 kernel is used. Measured on a 2-core AVX-512 CPU for a 3072x576
# layer: 4.3x faster than the bfloat16 matmul at 1 row, 2.6x at 4, 1.4x at 8, slower from ~14.
# Against the oneDNN-packed bfloat16 weights (linear.py), decoding SmolLM2 with 4 sequences takes
# 20-22 ms per step with int4 vs 25-29 without, with 8 sequences 33 vs 33-36.
INT4_MAX_ROWS = 8
# Rows up to which minivllm's Q4_1 kernel is used. It reads each few tiles of codes once for all
# the rows, 8 at a time, so past 8 rows it stays ahead of the packed bfloat16 matrix, which reads
# 4x the bytes: SmolLM2's 30 layers of linears (2-core Zen 4, 2026-12-07) 8.2 vs 13.0 ms at 9
# rows, 12.0 vs 15.8 at 16, 22.0 vs 24.1 at 32, about even at 64 (the kernel compute-bound there).
Q4_1_MAX_ROWS = 32
Q4_1_TILE = 16  # rows per tile of q4_1_linear's layout


class GroupQuantized:
    """A matrix stored as codes `q` [N, K] and per-32-column group tensors [N, K // 32]."""

    def narrow(self, dim: int, start: int, size: int) -> GroupQuantized:
        """Rows (dim 0) or columns (dim 1, whole groups only) start..start+size: a
        tensor-parallel rank's share."""
        if dim == 1 and (start % Q4_1_GROUP or size % Q4_1_GROUP):
            raise ValueError(
                f"A quantized matrix splits between ranks at groups of {Q4_1_GROUP} columns, not at "
                f"{start}..{start + size}."
            )
        return replace(self, **{
            f.name: getattr(self, f.name).narrow(dim, *(
                (start, size) if f.name == "q" or dim == 0 else (start // Q4_1_GROUP, size // Q4_1_GROUP)
            ))
            for f in fields(self)  # type: ignore[arg-type]
        })


@dataclass
class Q4_1Weight(GroupQuantized):
    """A Q4_1 matrix as stored: w[n, k] = scale[n, k // 32] * q[n, k] + min[n, k // 32]."""

    q: torch.Tensor  # [N, K] int32 in [0, 16)
    scale: torch.Tensor  # [N, K // 32] float32
    min: torch.Tensor  # [N, K // 32] float32


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [N, K // 2] uint8, the kernel's layout
    scales_and_zeros: torch.Tensor  # [K // 32, N, 2] bfloat16
    max_rows = INT4_MAX_ROWS
    codes_kind = "int4"

    def op_codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.packed, self.scales_and_zeros

    @classmethod
    def from_q4_1(cls, shards: list[Q4_1Weight]) -> Int4Weight:
        """Pack shards stacked along the output rows (the packing is row by row)."""
        q = torch.cat([s.q for s in shards])
        scale = torch.cat([s.scale for s in shards])
        zero = torch.cat([s.min for s in shards]) + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, scales_and_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> x @ W^T [M, N] bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, Q4_1_GROUP, self.scales_and_zeros)


@dataclass
class Q4_1Tiles:
    """Q4_1 codes, scales and mins in q4_1_linear's layout (see its header): per tile of 16 rows
    and block of 32 columns, 256 bytes of codes, then 16 float16 scales and 16 mins."""

    weight: torch.Tensor  # [N / 16, K / 32, 320] uint8
    max_rows = Q4_1_MAX_ROWS
    codes_kind = "q4_1_tiles"

    def op_codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, None

    @classmethod
    def from_q4_1(cls, shards: list[Q4_1Weight]) -> Q4_1Tiles:
        """Pack shards stacked along the output rows; together they must have a multiple of 16
        rows (a tile may span two shards)."""
        q = torch.cat([s.q for s in shards])
        n, k = q.shape
        tiles, blocks = n // Q4_1_TILE, k // Q4_1_GROUP
        # Column 32b + 8u + 2s + e of row 16t + j is nibble s of the 16-bit word (t, b, u, j, e):
        # split s into (byte of the word, nibble of the byte).
        nibbles = q.view(tiles, Q4_1_TILE, blocks, 4, 2, 2, 2).permute(0, 2, 3, 1, 6, 4, 5)
        codes = (nibbles[..., 0] | (nibbles[..., 1] << 4)).to(torch.uint8).reshape(tiles, blocks, -1)
        # The file's float16 scale and min (held as float32, so the cast back is exact).
        scale_min = torch.stack([torch.cat([s.scale for s in shards]), torch.cat([s.min for s in shards])])
        scale_min = scale_min.half().view(2, tiles, Q4_1_TILE, blocks).permute(1, 3, 0, 2).contiguous()
        return cls(torch.cat([codes, scale_min.view(torch.uint8).reshape(tiles, blocks, -1)], dim=-1))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> x @ W^T [M, N] bfloat16."""
        return torch.ops.minivllm_cpu.q4_1_linear(x if x.stride(-1) == 1 else x.contiguous(), self.weight)


def pack_q4_1(shards: list[Q4_1Weight]) -> Q4_1Tiles | Int4Weight | None:
    """Codes for whichever kernel runs here: minivllm's where it is built (AVX512-BF16), torch's
    int4 kernel otherwise; None where the rows do not tile by 16 (both kernels need that), and
    the layer keeps its dequantized weight only."""
    if sum(s.q.shape[0] for s in shards) % Q4_1_TILE:
        return None
    if cpu_kernels.enabled() and hasattr(torch.ops.minivllm_cpu, "q4_1_linear"):
        return Q4_1Tiles.from_q4_1(shards)
    return Int4Weight.from_q4_1(shards)


# Rows up to which the Q8_0 kernel is used (a 49152x576 lm_head, 2-core AVX-512 CPU: 0.85 ms
# against 3.0 ms for the bfloat16 matmul at 1 row, 1.2 vs 3.1 at 4, even at 8).
Q8_0_MAX_ROWS = 8


@dataclass
class Q8_0Weight(GroupQuantized):
    """A Q8_0 matrix as stored: w[n, k] = scale[n, k // 32] * q[n, k]."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // 32] float16
    max_rows = Q8_0_MAX_ROWS
    codes_kind = "q8_0"

    def op_codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.q, self.scale

    @classmethod
    def cat(cls, shards: list[Q8_0Weight]) -> Q8_0Weight:
        """Shards stacked along the output rows (a fused q/k/v or gate/up)."""
        return cls(torch.cat([s.q for s in shards]), torch.cat([s.scale for s in shards]))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M <= Q8_0_MAX_ROWS, K], float32 or bfloat16 -> x @ W^T [M, N] float32, computed in
        float32 from the exact weights (a bfloat16 copy of W rounds each one)."""
        out = torch.empty(x.shape[0], self.q.shape[0], dtype=torch.float32)
        torch.ops.minivllm_cpu.q8_0_linear(out, x, self.q, self.scale)
        return out

"""minivllm's Q4_1 kernel (ops/csrc/q4_1_linear.cpp): x @ W^T from the GGUF file's codes, scales
and mins, against the exact product in float64 (the result must be that product rounded once to
bfloat16, up to float32 sums), on the real SmolLM2 matrices and on random ones, for any number
of rows (past 8, the rows of each group of 8 come out as that group alone gives them); the
packing keeps fused shards apart; bad shapes are refused; and layers pick it only where it runs
and for at most Q4_1_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.gguf_loader import iterate_gguf_q4_1
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quant import Q4_1_MAX_ROWS, Int4Weight, Q4_1Tiles, Q4_1Weight, pack_q4_1

NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.3.mlp.up_proj.weight", "model.layers.29.mlp.down_proj.weight")


@pytest.fixture(scope="module", autouse=True)
def q4_1_kernel(cpu_kernels):
    if not hasattr(torch.ops.minivllm_cpu, "q4_1_linear"):
        pytest.skip("q4_1_linear is built only for CPUs with AVX512-BF16")


@pytest.fixture(scope="module")
def file_codes(smollm2_gguf) -> dict[str, Q4_1Weight]:
    return {name: w for name, w in iterate_gguf_q4_1(str(smollm2_gguf)) if name in NAMES}


def exact_weight(w: Q4_1Weight) -> torch.Tensor:
    """The file's weights, w = scale * q + min, in float64."""
    n, k = w.q.shape
    blocks = w.q.view(n, -1, 32).double() * w.scale.double()[..., None] + w.min.double()[..., None]
    return blocks.view(n, k)


def random_q4_1(n: int, k: int, seed: int) -> Q4_1Weight:
    """Codes over the whole range; scales and mins as float16 values (what a file can hold)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    minimum = (-8 * scale + 0.01 * torch.randn(n, k // 32, generator=gen)).half().float()
    return Q4_1Weight(q, scale, minimum)


def assert_rounded_exact(out: torch.Tensor, exact: torch.Tensor) -> None:
    """out is exact rounded to bfloat16: within half a bfloat16 step of it (at most 2^-8 of |exact|),
    plus a float32-sum slack far below that step."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    err = (out.double() - exact).abs()
    bound = exact.abs() * 2.0**-8 + 1e-5 * exact.abs().max()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("rows", [*range(1, 10), 16, 23, Q4_1_MAX_ROWS])
def test_file_matrices_give_the_exact_product(file_codes, rows):
    gen = torch.Generator().manual_seed(rows)
    for name in NAMES:
        w = file_codes[name]
        x = torch.randn(rows, w.q.shape[1], generator=gen).to(torch.bfloat16)
        out = Q4_1Tiles.from_q4_1([w]).matmul(x)
        assert_rounded_exact(out, x.double() @ exact_weight(w).T)


@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (304, 1536), (2048, 64)])
def test_random_matrices_any_tile_and_block_count(n, k):
    w = random_q4_1(n, k, seed=n + k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    assert_rounded_exact(Q4_1Tiles.from_q4_1([w]).matmul(x), x.double() @ exact_weight(w).T)


def test_more_exact_than_torch_int4(file_codes):
    """torch's int4 kernel needs bfloat16 scales and zeros; this one keeps the file's."""
    w = file_codes[NAMES[2]]
    x = torch.randn(4, w.q.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = x.double() @ exact_weight(w).T
    err_ours = (Q4_1Tiles.from_q4_1([w]).matmul(x).double() - exact).abs().mean()
    err_int4 = (Int4Weight.from_q4_1([w]).matmul(x).double() - exact).abs().mean()
    assert err_ours < err_int4


@pytest.mark.parametrize("rows", [9, 17, 40])
def test_rows_past_a_group_are_the_groups_alone(rows):
    """Each group of 8 rows is computed as a call with those rows alone would (the same
    accumulation), whatever the tile count (19 tiles: parts of passes of 4)."""
    tiles = Q4_1Tiles.from_q4_1([random_q4_1(304, 1536, seed=rows)])
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    assert torch.equal(tiles.matmul(x), torch.cat([tiles.matmul(x[r:r + 8]) for r in range(0, rows, 8)]))


def test_strided_and_transposed_rows():
    """Rows read through their stride (a slice of a wider tensor), and a transposed x."""
    w = random_q4_1(64, 128, seed=1)
    tiles = Q4_1Tiles.from_q4_1([w])
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, 7:135]
    assert x.stride() == (300, 1)
    assert torch.equal(tiles.matmul(x), tiles.matmul(x.contiguous()))
    xt = x.contiguous().T.contiguous().T  # same values, column-major
    assert torch.equal(tiles.matmul(xt), tiles.matmul(x.contiguous()))
    assert_rounded_exact(tiles.matmul(x), x.double() @ exact_weight(w).T)


def test_fused_shards_pack_like_the_parts(file_codes):
    """q and k packed as one fused matrix give each projection's rows bit for bit."""
    q_w, k_w = file_codes[NAMES[0]], file_codes[NAMES[1]]
    x = torch.randn(2, q_w.q.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = Q4_1Tiles.from_q4_1([q_w, k_w]).matmul(x)
    n_q = q_w.q.shape[0]
    assert torch.equal(out[:, :n_q], Q4_1Tiles.from_q4_1([q_w]).matmul(x))
    assert torch.equal(out[:, n_q:], Q4_1Tiles.from_q4_1([k_w]).matmul(x))


def test_bad_inputs_are_refused():
    tiles = Q4_1Tiles.from_q4_1([random_q4_1(32, 64, seed=4)])
    op = torch.ops.minivllm_cpu.q4_1_linear
    with pytest.raises(RuntimeError, match="for x of 96 columns"):
        op(torch.zeros(1, 96, dtype=torch.bfloat16), tiles.weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.zeros(1, 64), tiles.weight)
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        op(torch.zeros(1, 64, dtype=torch.bfloat16), tiles.weight.view(-1, 1, 320))
    assert op(torch.zeros(0, 64, dtype=torch.bfloat16), tiles.weight).shape == (0, 32)


def test_pack_picks_the_kernel_that_runs(monkeypatch):
    """minivllm's layout where its kernel is on, torch's int4 otherwise; no codes at all where the
    rows do not tile by 16 (neither kernel takes them)."""
    assert isinstance(pack_q4_1([random_q4_1(32, 64, seed=5)]), Q4_1Tiles)
    assert pack_q4_1([random_q4_1(24, 64, seed=5)]) is None
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert isinstance(pack_q4_1([random_q4_1(32, 64, seed=5)]), Int4Weight)
    assert pack_q4_1([random_q4_1(24, 64, seed=5)]) is None


def test_a_layer_takes_the_codes_up_to_its_bound():
    """Up to Q4_1_MAX_ROWS rows the layer runs the kernel on the file's weights; past it the
    dequantized bfloat16 matrix (the same product up to its rounding)."""
    w = random_q4_1(64, 128, seed=6)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Linear(128, 64)
        finally:
            torch.set_default_dtype(torch.float32)
    layer.weight.weight_loader(layer.weight, exact_weight(w).to(torch.bfloat16))
    layer.load_quantized(w)
    assert isinstance(layer.quantized, Q4_1Tiles) and layer.quantized.max_rows == Q4_1_MAX_ROWS
    gen = torch.Generator().manual_seed(7)
    at_bound = torch.randn(Q4_1_MAX_ROWS, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(layer(at_bound), layer.quantized.matmul(at_bound))
    past = torch.randn(Q4_1_MAX_ROWS + 1, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(layer(past), torch.nn.functional.linear(past, layer.weight))

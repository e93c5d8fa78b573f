"""minivllm's bfloat16 GEMM (ops/csrc/bf16_gemm.cpp) against the float64 product: float32 sums of
exact products, rounded to bfloat16 once, whatever the row count (both ways the threads split
the work, every row tile tail), depth (chunks of K and their tails), bias and input layout; and
a row's result does not depend on the rows beside it or on the thread count."""

from __future__ import annotations

import pytest
import torch

from minivllm.platforms.cpu_gemm import minivllm_gemm_built

pytestmark = pytest.mark.skipif(not minivllm_gemm_built(), reason="bf16_gemm is built for AVX-512 CPUs only")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.minivllm_cpu.bf16_gemm(x, torch.ops.minivllm_cpu.bf16_pack_weight(weight), bias)


def _assert_rounded_once(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within the float32 sums' error (K sums of at most sum |x||w|, each rounding by 2^-24) and
    half a bfloat16 step (2^-8 of the value) of the float64 product."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    sums_error = (x.double().abs() @ weight.double().abs().T) * x.shape[-1] * 2**-24
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= (exact.abs() + sums_error) * 2**-8 + sums_error).all()


@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 100, 191, 192, 250, 1000])
@pytest.mark.parametrize(("k", "n"), [(3, 32), (80, 96), (576, 960), (1600, 64)])
def test_matches_float64_product(rows, k, n):
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        _assert_rounded_once(_gemm(x, weight, b), x, weight, b)


def test_input_layouts_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=gen).bfloat16()
    wide = torch.randn(2, 7, 96, generator=gen).bfloat16()
    for x in (wide[..., :48], wide[..., ::2]):  # row-strided and column-strided views, 3-D
        out = _gemm(x, weight)
        assert out.shape == (2, 7, 64)
        _assert_rounded_once(out.reshape(14, 64), x.reshape(14, 48), weight, None)


def test_row_results_do_not_depend_on_batch_or_threads():
    """Each output sums its K products in the same order whatever else is computed: a row alone,
    in a decode-sized batch (threads split the weight) or a prompt-sized one (threads split the
    rows), on one thread or two, gives the same bits."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 700, generator=gen).bfloat16()
    x = torch.randn(500, 700, generator=gen).bfloat16()
    whole = _gemm(x, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_gemm(x, weight), whole)
    finally:
        torch.set_num_threads(threads)
    for row in (0, 37, 499):
        assert torch.equal(_gemm(x[row : row + 1], weight), whole[row : row + 1])
        assert torch.equal(_gemm(x[row : row + 30], weight)[0], whole[row])


def test_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        torch.ops.minivllm_cpu.bf16_pack_weight(torch.zeros(40, 8, dtype=torch.bfloat16))
    packed = torch.ops.minivllm_cpu.bf16_pack_weight(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        torch.ops.minivllm_cpu.bf16_gemm(torch.zeros(2, 9, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        torch.ops.minivllm_cpu.bf16_gemm(torch.zeros(2, 8), packed, None)

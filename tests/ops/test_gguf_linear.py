"""The gguf_linear op (ops/csrc/gguf_linear.cpp): a GGUF Linear's codes up to its row bound, its
dequantized weight past it, chosen inside the op. Each branch must give exactly what the two
kernels give when called on their own (each is checked against the exact product in its own
test file), for every kind of codes and every layout of the dense weight, with and without a
bias; and a trace recorded at one side of the bound must replay the other side with the other
weight, which is why the choice lives in the op (worker/step_traces.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from minivllm.model.layers.linear import Linear, linear
from minivllm.model.layers.quant import Int4Weight, Q4_1Tiles, Q4_1Weight, Q8_0Weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")

N, K = 64, 128


def _q4_1(seed: int) -> Q4_1Weight:
    gen = torch.Generator().manual_seed(seed)
    scale = (torch.rand(N, K // 32, generator=gen) * 0.02).half().float()
    return Q4_1Weight(torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen), scale,
                      (-8 * scale).half().float())


def _codes(kind: str):
    if kind == "q4_1_tiles":
        if not hasattr(torch.ops.minivllm_cpu, "q4_1_linear"):
            pytest.skip("q4_1_linear is built only for CPUs with AVX512-BF16")
        return Q4_1Tiles.from_q4_1([_q4_1(0)])
    if kind == "int4":
        return Int4Weight.from_q4_1([_q4_1(0)])
    gen = torch.Generator().manual_seed(1)
    return Q8_0Weight(torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8),
                      (torch.rand(N, K // 32, generator=gen) * 0.01).half())


def _dense(layout: str) -> torch.Tensor:
    weight = (torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    if layout == "plain":
        return weight
    if layout == "onednn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no oneDNN")
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    if not hasattr(torch.ops.minivllm_cpu, "bf16_pack_weight"):
        pytest.skip("minivllm's bfloat16 GEMM is built only for CPUs with AVX-512")
    return torch.ops.minivllm_cpu.bf16_pack_weight(weight)


@pytest.mark.parametrize("kind", ["q4_1_tiles", "int4", "q8_0"])
@pytest.mark.parametrize("layout", ["plain", "onednn", "panels"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_side_of_the_bound_is_its_kernel(kind, layout, with_bias):
    codes, weight = _codes(kind), _dense(layout)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) if with_bias else None
    gen = torch.Generator().manual_seed(4)
    for rows in (1, codes.max_rows, codes.max_rows + 1, 3 * codes.max_rows + 5):
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
        out = torch.ops.minivllm_cpu.gguf_linear(x, weight, bias, codes.max_rows, codes.codes_kind, *codes.op_codes())
        if rows <= codes.max_rows:
            expected = codes.matmul(x).to(torch.bfloat16)
            expected = expected if bias is None else expected + bias
        else:
            expected = linear(x, weight, bias)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected), (rows, kind, layout)


def test_unknown_codes_are_refused():
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="unknown codes kind q5_k"):
        torch.ops.minivllm_cpu.gguf_linear(x, _dense("plain"), None, 8, "q5_k", torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="q8_0 codes need their scales"):
        torch.ops.minivllm_cpu.gguf_linear(x, _dense("plain"), None, 8, "q8_0", torch.zeros(1), None)


def _layer(codes_in_op: bool) -> Linear:
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Linear(K, N)
        finally:
            torch.set_default_dtype(torch.float32)
    w = _q4_1(5)
    dequantized = (w.q.float().view(N, -1, 32) * w.scale[..., None] + w.min[..., None]).view(N, K)
    layer.weight.weight_loader(layer.weight, dequantized.to(torch.bfloat16))
    layer.load_quantized(w)
    layer.rows_choice_in_op = codes_in_op
    layer.process_weights_after_loading()  # the dense weight packed as the model's are
    return layer


def test_a_trace_replays_both_sides_of_the_bound():
    """Recorded on a step of one row, a trace replays a step past the bound with the dequantized
    matrix, as the eager layer does; a trace of the Python choice would keep the codes."""
    layer = _layer(codes_in_op=True)
    bound = layer.quantized.max_rows
    gen = torch.Generator().manual_seed(6)
    one, many = (torch.randn(n, K, generator=gen).to(torch.bfloat16) for n in (1, bound + 7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = torch.jit.trace(layer, (one,), check_trace=False)
        python_choice = torch.jit.trace(_layer(codes_in_op=False), (one,), check_trace=False)
    assert torch.equal(trace(one), layer(one))
    assert torch.equal(trace(many), layer(many))
    assert torch.equal(layer(many), linear(many, layer.weight, None))
    assert torch.equal(python_choice(many), layer.quantized.matmul(many))  # the branch it was recorded on
    assert not torch.equal(python_choice(many), trace(many))


def test_the_op_and_the_python_choice_agree():
    gen = torch.Generator().manual_seed(7)
    in_op, in_python = _layer(codes_in_op=True), _layer(codes_in_op=False)
    for rows in (1, 9, in_op.quantized.max_rows, in_op.quantized.max_rows + 1, 100):
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
        assert torch.equal(in_op(x), in_python(x))

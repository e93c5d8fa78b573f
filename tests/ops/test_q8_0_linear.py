"""The Q8_0 lm_head path: codes read from the file rebuild the gguf package's dequantization bit
for bit, the q8_0_linear kernel computes x @ W^T from them in float32 (closer to the exact
product than a bfloat16 copy of W), and a GGUF model on CPU uses it for steps of few rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import model_runner

from minivllm.model.gguf_loader import gguf_lm_head_q8_0, iterate_gguf_weights
from minivllm.model.layers.quant import Q8_0_MAX_ROWS, Q8_0Weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(scope="module")
def lm_head(smollm2_gguf):
    path = str(smollm2_gguf)
    codes = gguf_lm_head_q8_0(path)
    dense = next(w for name, w in iterate_gguf_weights(path) if name == "model.embed_tokens.weight")
    return codes, dense


def test_codes_rebuild_gguf_dequantization_exactly(lm_head):
    codes, dense = lm_head
    assert codes.q.dtype == torch.int8 and codes.scale.dtype == torch.float16
    assert codes.q.shape == dense.shape == (49152, 576)
    rebuilt = (codes.q.view(49152, -1, 32).float() * codes.scale.float()[..., None]).view(dense.shape)
    assert torch.equal(rebuilt, dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, Q8_0_MAX_ROWS])
def test_q8_0_linear_matches_the_exact_product(lm_head, rows, dtype):
    codes, dense = lm_head
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
    exact = x.double() @ dense.double().T
    out = codes.matmul(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 49152)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-4)
    if dtype == torch.bfloat16:  # the matmul it replaces, on bfloat16-rounded weights, is worse
        err_bf16 = (F.linear(x, dense.to(torch.bfloat16)).double() - exact).abs().max()
        assert (out.double() - exact).abs().max() < err_bf16 / 100


def test_q8_0_linear_on_strided_rows_and_random_matrix():
    """Not only the file's matrix: random codes and scales, x rows taken from a wider tensor."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (300, 64), dtype=torch.int8, generator=gen)
    scale = (torch.rand(300, 2, generator=gen) * 0.1).half()
    x = torch.randn(3, 100, generator=gen)[:, 10:74]
    w = (q.view(300, 2, 32).double() * scale.double()[..., None]).view(300, 64)
    torch.testing.assert_close(Q8_0Weight(q, scale).matmul(x).double(), x.double() @ w.T, rtol=1e-6, atol=1e-5)


def test_q8_0_linear_rejects_bad_shapes():
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        Q8_0Weight(q, torch.zeros(8, 2, dtype=torch.float16)).matmul(torch.zeros(9, 64))
    with pytest.raises(RuntimeError, match="scales must be float16"):
        Q8_0Weight(q, torch.zeros(8, 2)).matmul(torch.zeros(1, 64))


@pytest.mark.parametrize(("dtype", "kernels_on", "expected"), [
    ("bfloat16", "1", True), ("float32", "1", True), ("bfloat16", "0", False),
])
def test_model_uses_q8_0_lm_head_for_few_rows(smollm2_gguf, make_llm, monkeypatch, lm_head, dtype, kernels_on, expected):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model object
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", kernels_on)
    llm = make_llm(smollm2_gguf, dtype=dtype, max_model_len=256)
    model = model_runner(llm).model
    assert (model.lm_head_q8_0 is not None) == expected
    if expected:
        _, dense = lm_head
        hidden = torch.randn(Q8_0_MAX_ROWS + 1, 576).to(getattr(torch, dtype))
        exact = hidden.double() @ dense.double().T
        # Few rows: the file's exact weights. More rows: the dense weights in the model dtype.
        torch.testing.assert_close(model.compute_logits(hidden[:2]).double(), exact[:2], rtol=0, atol=1e-4)
        tol = 1e-4 if dtype == "float32" else 0.5
        torch.testing.assert_close(model.compute_logits(hidden).double(), exact, rtol=0, atol=tol)

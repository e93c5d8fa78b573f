"""The sampler's row-wise argmax on CPU (ops/csrc/argmax.cpp, chosen by platforms/cpu.py) against
numpy's argmax, which has the same contract as torch's: the first index of the maximum, or of
the first NaN. Row lengths around the vector width, ties, infinities, NaN, strided rows; bad
inputs are refused; inputs the kernel does not take go to torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.platforms import get_platform

argmax = get_platform("cpu").argmax


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def numpy_argmax(x: torch.Tensor) -> np.ndarray:
    return np.argmax(x.numpy(), axis=-1)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_random_rows(rows: int, n: int):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n))
    got = torch.ops.minivllm_cpu.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    np.testing.assert_array_equal(got.numpy(), numpy_argmax(x))


def test_ties_take_the_first_index():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1037, generator=g)
    for r in range(40):
        # the maximum repeated at 2-4 positions, some in the body and some in the scalar tail
        where = torch.randperm(1037, generator=g)[: 2 + r % 3]
        if r % 2:
            where[0] = 1030
        x[r, where] = 7.0
    got = torch.ops.minivllm_cpu.argmax_rows(x)
    np.testing.assert_array_equal(got.numpy(), numpy_argmax(x))
    np.testing.assert_array_equal(got.numpy(), x.argmax(dim=-1).numpy())


def test_infinities_and_nan():
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    x[0] = -torch.inf  # every value -inf: index 0
    x[1, 40] = torch.inf
    x[1, 70] = torch.inf
    x[2, 50] = torch.nan  # NaN wins over larger values
    x[2, 10] = 1e30
    x[3, 99] = torch.nan  # in the scalar tail
    x[3, 98] = torch.nan
    x[4, 20] = torch.nan
    x[4, 5] = torch.nan
    x[5, :] = torch.nan
    got = torch.ops.minivllm_cpu.argmax_rows(x)
    np.testing.assert_array_equal(got.numpy(), numpy_argmax(x))
    assert got.tolist() == [0, 40, 50, 98, 5, 0]


def test_strided_rows():
    wide = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    x = wide[:, 7:250]  # rows 300 apart, 243 long
    got = torch.ops.minivllm_cpu.argmax_rows(x)
    np.testing.assert_array_equal(got.numpy(), numpy_argmax(x.contiguous()))


def test_bad_inputs_are_refused():
    ops = torch.ops.minivllm_cpu
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="empty"):
        ops.argmax_rows(torch.randn(3, 0))


def test_cpu_platform_argmax_picks_the_kernel_only_where_it_runs(monkeypatch):
    calls = []
    kernel = torch.ops.minivllm_cpu.argmax_rows

    class Spy:
        def argmax_rows(self, x):
            calls.append(tuple(x.shape))
            return kernel(x)

    class Ops:
        minivllm_cpu = Spy()

    monkeypatch.setattr(torch, "ops", Ops())
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    for inp in (x, x.double(), x.bfloat16(), x.t()):  # only the first one is the kernel's
        np.testing.assert_array_equal(argmax(inp).numpy(), numpy_argmax(inp.float()))
    assert calls == [(4, 100)]
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    np.testing.assert_array_equal(argmax(x).numpy(), numpy_argmax(x))
    assert calls == [(4, 100)]

"""Which GEMM runs bfloat16 linears on CPU (platforms/cpu_gemm.py): the environment's choice
when given, else minivllm's only where it timed faster at both row counts."""

from __future__ import annotations

import pytest

from minivllm.platforms import cpu_gemm


@pytest.fixture
def choice(monkeypatch):
    """use_minivllm_gemm() afresh under MINIVLLM_CPU_BF16_GEMM=value (cached per process)."""
    def decide(value: str) -> bool:
        monkeypatch.setenv("MINIVLLM_CPU_BF16_GEMM", value)
        cpu_gemm.use_minivllm_gemm.cache_clear()
        return cpu_gemm.use_minivllm_gemm()
    yield decide
    cpu_gemm.use_minivllm_gemm.cache_clear()


def _no_timing():
    raise AssertionError("timed although the choice was given")


@pytest.mark.parametrize(("onednn", "ours", "chosen"), [
    ([2.0, 9.0], [1.0, 8.0], True),
    ([2.0, 9.0], [1.0, 9.5], False),  # slower on prompts
    ([2.0, 9.0], [2.5, 8.0], False),  # slower on decodes
])
def test_auto_keeps_onednn_unless_minivllm_wins_both(choice, monkeypatch, onednn, ours, chosen):
    monkeypatch.setattr(cpu_gemm, "minivllm_gemm_built", lambda: True)
    monkeypatch.setattr(cpu_gemm, "_time_both", lambda: (onednn, ours))
    assert choice("auto") is chosen


def test_a_given_choice_is_not_timed(choice, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_time_both", _no_timing)
    monkeypatch.setattr(cpu_gemm, "minivllm_gemm_built", lambda: True)
    assert choice("onednn") is False
    assert choice(" MiniVLLM ") is True


def test_auto_without_the_kernel_keeps_onednn_and_refuses_to_force_it(choice, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_time_both", _no_timing)
    monkeypatch.setattr(cpu_gemm, "minivllm_gemm_built", lambda: False)
    assert choice("auto") is False
    with pytest.raises(ValueError, match="MINIVLLM_CPU_BF16_GEMM=minivllm needs minivllm's CPU kernels"):
        choice("minivllm")


def test_a_bad_value_is_refused(choice):
    with pytest.raises(ValueError, match="must be auto, onednn or minivllm, got 'fast'"):
        choice("fast")


@pytest.mark.skipif(not cpu_gemm.minivllm_gemm_built(), reason="bf16_gemm is built for AVX-512 CPUs only")
def test_timing_runs_both_gemms():
    onednn, ours = cpu_gemm._time_both()
    assert len(onednn) == len(ours) == len(cpu_gemm.PROBE_ROWS)
    assert all(0 < t < 1 for t in onednn + ours)

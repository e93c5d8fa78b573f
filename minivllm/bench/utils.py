"""What every benchmark command shares: the environment record, the JSON file, the plots, and
the speculative decoding figures of a run."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any, Protocol

import minivllm


def environment() -> dict[str, Any]:
    """Versions and hardware, so a result file says where it was measured."""
    env: dict[str, Any] = {
        "minivllm": minivllm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class SpecDecodingCounters(Protocol):
    """Cumulative draft verification counters, as in minivllm.core.outputs.SpecDecodingStats."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]


def spec_decode_report(before: SpecDecodingCounters | None, after: SpecDecodingCounters | None) -> dict[str, Any]:
    """A run's speculative decoding figures from the counters before and after it, with vLLM's
    definitions: acceptance rate = accepted / draft tokens, mean acceptance length (tokens per
    verifying step, the bonus token included) = 1 + accepted / drafts, and per position j,
    accepted_per_pos[j] / drafts. Empty when the engine does not speculate (`after` is None);
    rates are 0 (length 1) when nothing was drafted."""
    if after is None:
        return {}

    def delta(name: str) -> int:
        return int(getattr(after, name) - (getattr(before, name) if before is not None else 0))

    drafts, draft_tokens, accepted = (delta(n) for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    per_pos = [int(a - b) for a, b in zip_longest(after.num_accepted_tokens_per_pos,
                                                  before.num_accepted_tokens_per_pos if before else [], fillvalue=0)]
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "spec_decode_per_position_acceptance_rates": [n / drafts if drafts else 0.0 for n in per_pos],
    }


def spec_decode_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of a spec_decode_report (or of a result holding one; none without)."""
    if "spec_decode_num_drafts" not in report:
        return []
    per_pos = " ".join(f"{100 * r:.1f}" for r in report["spec_decode_per_position_acceptance_rates"])
    return [
        ("Spec decode drafts", str(report["spec_decode_num_drafts"])),
        ("Spec decode draft tokens", str(report["spec_decode_num_draft_tokens"])),
        ("Spec decode accepted tokens", str(report["spec_decode_num_accepted_tokens"])),
        ("Spec decode acceptance rate (%)", f"{100 * report['spec_decode_acceptance_rate']:.1f}"),
        ("Spec decode mean acceptance length", f"{report['spec_decode_acceptance_length']:.2f}"),
        ("Spec decode per-position acceptance (%)", per_pos),
    ]


def print_rows(rows: Sequence[tuple[str, Any]]) -> None:
    for label, value in rows:
        print(f"{label:<40}{value!s:>15}")


def load_hf_model(model_path: str, dtype: str) -> tuple[Any, float]:
    """The same model through transformers (from an HF directory or a .gguf file), and its load time."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=getattr(torch, dtype)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return model, time.perf_counter() - start


def write_json(path: str, config: dict[str, Any], results: dict[str, Any]) -> None:
    payload = {"config": {k: v for k, v in config.items() if not callable(v)}, "environment": environment(), **results}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    return plt


def plot_bars(path: str, title: str, labels: Sequence[str], values: Sequence[float], ylabel: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.8 * len(labels)), 4))
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cdfs(path: str, title: str, series: dict[str, Sequence[float]], xlabel: str,
              timeline: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
    """One CDF panel per series (values in ms), plus an optional (seconds, tokens/s) panel."""
    import numpy as np

    plt = _pyplot()
    panels = len(series) + (timeline is not None)
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.5), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items(), strict=False):
        data = np.sort(np.asarray(values, dtype=float))
        if len(data):
            ax.plot(data, np.arange(1, len(data) + 1) / len(data))
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    if timeline is not None:
        ax = axes[0][-1]
        ax.plot(*timeline)
        ax.set_title("output throughput")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

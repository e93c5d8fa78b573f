"""What every benchmark command shares: the environment record, the JSON file, the plots."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from typing import Any

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

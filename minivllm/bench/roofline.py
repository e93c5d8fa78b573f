"""`minivllm bench roofline`: a model's physical limits on this device, from rates measured in the
same run, to put beside `bench latency` and `bench throughput`.

- Bandwidth floor of a decode step: a step reads every weight once (and each sequence's KV), so
  one stream's time per output token is at least (weight bytes + KV bytes of its context) /
  memory bandwidth. The bandwidth is a large device-to-device copy's (bytes read + written).
- Matmul floor of a workload: its prompt and output tokens each cost 2 FLOPs per weight of
  every linear layer, the sampled ones the LM head's too, and attention 4 * heads * head_dim
  FLOPs per layer per (query, key) pair it computes; at the measured dense bfloat16 matmul rate
  (a large square product) that is the least time the workload takes, and its output tokens
  over that time the most throughput it can have.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from minivllm.bench.utils import print_rows, write_json

if TYPE_CHECKING:
    import torch

GB = 1e9


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="A model directory (its config.json is all that is read).")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available).")
    parser.add_argument("--input-len", type=int, default=1024, help="Prompt tokens of the single stream.")
    parser.add_argument("--num-prompts", type=int, default=256, help="Requests of the throughput workload.")
    parser.add_argument("--throughput-input-len", type=int, default=512)
    parser.add_argument("--throughput-output-len", type=int, default=256)
    parser.add_argument("--matmul-size", type=int, default=8192, help="Side of the square product timed.")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="Size of the copy timed.")
    parser.add_argument("--output-json", type=str, default=None)


def main(args: argparse.Namespace) -> None:
    import torch

    from minivllm.platforms import resolve_device
    from minivllm.transformers_utils.config import get_config, resolve_model_path

    config = get_config(resolve_model_path(args.model))
    dtype = getattr(torch, args.dtype)
    device = torch.device(resolve_device(args.device))
    shape = ModelShape.from_config(config, dtype.itemsize)
    bandwidth = measure_copy_bandwidth(device, int(args.copy_gib * (1 << 30)))
    matmul_rate = measure_matmul_rate(device, dtype, args.matmul_size)
    context = args.input_len
    tpot_floor = (shape.weight_bytes + shape.kv_bytes_per_token * context) / bandwidth
    num_in, num_out, n = args.throughput_input_len, args.throughput_output_len, args.num_prompts
    flops = n * shape.request_flops(num_in, num_out)
    time_floor = flops / matmul_rate
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "weight_bytes": shape.weight_bytes,
        "copy_bandwidth_GBps": bandwidth / GB,
        "matmul_TFLOPs": matmul_rate / 1e12,
        "tpot_floor_ms": tpot_floor * 1e3,
        "tpot_floor_context": context,
        "throughput_workload": {"num_prompts": n, "input_len": num_in, "output_len": num_out},
        "throughput_flops": flops,
        "throughput_time_floor_s": time_floor,
        "output_throughput_ceiling_tok_s": n * num_out / time_floor,
    }
    print_rows([
        ("weights", f"{shape.weight_bytes / GB:.2f} GB"),
        ("copy bandwidth (read + write)", f"{bandwidth / GB:.0f} GB/s"),
        (f"dense {args.dtype} matmul", f"{matmul_rate / 1e12:.0f} TFLOP/s"),
        (f"TPOT floor, 1 stream at {context} tokens", f"{tpot_floor * 1e3:.2f} ms"),
        (f"{n} x {num_in} in / {num_out} out: matmul floor", f"{time_floor:.2f} s, "
                                                            f"{n * num_out / time_floor:.0f} output tok/s"),
    ])
    if args.output_json:
        write_json(args.output_json, vars(args), results)


class ModelShape:
    """What the floors need of a decoder's config: weight bytes, FLOPs per token, KV bytes."""

    def __init__(self, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 vocab: int, tied: bool, itemsize: int) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        mlp = 3 * hidden * intermediate  # gate, up, down
        self.layer_linear_params = layers * (attention + mlp)
        self.lm_head_params = vocab * hidden
        embedding = 0 if tied else vocab * hidden
        self.weight_bytes = (self.layer_linear_params + self.lm_head_params + embedding) * itemsize
        self.kv_bytes_per_token = 2 * layers * kv_heads * head_dim * itemsize

    @classmethod
    def from_config(cls, config: Any, itemsize: int) -> ModelShape:
        from minivllm.config import get_head_size

        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   get_head_size(config), config.intermediate_size, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)), itemsize)

    def request_flops(self, num_in: int, num_out: int) -> float:
        """One request's: every token through the layers' linears, the logits of the tokens
        sampled (the prompt's last and each output token but the last), causal attention."""
        tokens = num_in + num_out - 1  # the last output token is never fed back
        linear = 2 * self.layer_linear_params * tokens + 2 * self.lm_head_params * num_out
        pairs = tokens * (tokens + 1) / 2  # the query at position p sees p + 1 keys
        return linear + 4 * self.layers * self.heads * self.head_dim * pairs


def _timed(fn, device: torch.device, iters: int) -> float:
    """Mean seconds per call after warm-up."""
    for _ in range(3):
        fn()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _synchronize(device)
    return (time.perf_counter() - start) / iters


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, iters=10)
    return 2 * num_bytes / seconds


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n product of random matrices."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device, iters=10)
    return 2 * n**3 / seconds

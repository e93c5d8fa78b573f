"""ModelRunner: turns one SchedulerOutput into one forward pass and one ModelRunnerOutput.

Per step: apply the scheduler's diff to the persistent InputBatch, build the flat inputs
(token ids, positions, slot mapping) with vectorised numpy over the batch rows, run the model
over all scheduled tokens at once (decode-only steps of a few requests replayed from a trace on
CPU, see decode_graph.py), compute logits only at the positions that are sampled, sample, and
copy the sampled ids to the host once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.attention.backend import CommonAttentionMetadata, get_attn_backend
from minivllm.core.kv_cache_manager import cdiv
from minivllm.core.outputs import LogprobsArrays, ModelRunnerOutput
from minivllm.model.loader import get_model
from minivllm.sample.sampler import LogprobsTensors, Sampler, gather_logprobs
from minivllm.worker.decode_graph import DecodeGraph
from minivllm.worker.input_batch import CachedRequestState, InputBatch

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.sched.output import SchedulerOutput


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.dtype = getattr(torch, self.model_config.dtype)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.attn_backend = get_attn_backend(device, self.dtype, self.model_config.get_head_size())
        self.sampler = Sampler()
        self.model: Any = None
        # The step's forward: the model, or on CPU the model with decode steps replayed from a
        # trace (bound with the KV caches, which the trace holds).
        self.forward: Any = None
        self.kv_caches: list[torch.Tensor] = []
        # Every request the worker knows, including preempted ones that left the batch.
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_blocks_per_req=cdiv(self.max_model_len, self.block_size),
            vocab_size=self.model_config.hf_config.vocab_size,
            device=device,
        )
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len), dtype=np.int64)

    # ---- set-up ---------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        first = layers[0]
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(layers) * self.block_size * first.num_kv_heads * first.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's K/V blocks and hand each attention layer its view."""
        self.kv_caches = []
        for attn in self.model.attention_layers():
            shape = self.attn_backend.get_kv_cache_shape(
                num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim
            )
            kv_cache = _zeros(shape, self.dtype, self.device)
            attn.kv_cache = kv_cache
            self.kv_caches.append(kv_cache)
        eager = self.model_config.enforce_eager or self.device.type != "cpu"
        self.forward = self.model if eager else DecodeGraph(self.model)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens tokens without a KV cache, to measure peak memory."""
        num_tokens = self.max_num_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(input_ids, positions, None)
        self.model.compute_logits(hidden[-self.input_batch.max_num_reqs :])

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        input_ids, positions, attn_metadata, logits_rows, logits_indices, query_start_loc = (
            self._prepare_inputs(scheduler_output)
        )
        # Only the sampled rows go through the last layer's o_proj and MLP, unless every row
        # is sampled (decodes) or prompt logprobs need every row's final state.
        prompt_logprobs_rows = np.flatnonzero(batch.sampling.num_prompt_logprobs[: batch.num_reqs] >= 0)
        pruned = len(logits_rows) < len(input_ids) and not len(prompt_logprobs_rows)
        hidden_states = self.forward(input_ids, positions, attn_metadata, logits_indices if pruned else None)
        prompt_logprobs = self._compute_prompt_logprobs(hidden_states, query_start_loc, prompt_logprobs_rows)
        sampled_token_ids: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        logprobs = None
        if len(logits_rows):
            logits = self.model.compute_logits(hidden_states if pruned else hidden_states[logits_indices])
            sampler_output = self.sampler(logits, batch.sampling.make_metadata(logits_rows))
            batch.sampling.record_sampled(logits_rows, sampler_output.sampled_token_ids)
            # NOTE: the step's one device-to-host copy.
            sampled = sampler_output.sampled_token_ids.tolist()
            for row, token_id in zip(logits_rows.tolist(), sampled, strict=True):
                sampled_token_ids[row] = [token_id]
                batch.append_token(row, token_id)
                self.requests[batch.req_ids[row]].output_token_ids.append(token_id)
            if sampler_output.logprobs_tensors is not None:
                logprobs = _to_arrays(sampler_output.logprobs_tensors)
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _compute_prompt_logprobs(
        self, hidden_states: torch.Tensor, query_start_loc: np.ndarray, rows: np.ndarray
    ) -> dict[str, LogprobsArrays]:
        """Logprobs of the prompt tokens this step's chunk predicts, for the requests that ask
        (their batch rows are `rows`).

        The hidden state at position p predicts prompt token p + 1. Positions already reported
        (before a preemption) are skipped. Logits are computed a slice at a time: a whole prompt's
        [tokens, vocab] logits could take gigabytes.
        """
        batch = self.input_batch
        results: dict[str, LogprobsArrays] = {}
        for row in rows.tolist():
            state = self.requests[batch.req_ids[row]]
            num_logprobs = int(batch.sampling.num_prompt_logprobs[row])
            num_prompt = len(state.prompt_token_ids)
            if state.num_prompt_logprobs_done >= num_prompt:
                continue
            computed = int(batch.num_computed_tokens_cpu[row])
            scheduled = int(query_start_loc[row + 1] - query_start_loc[row])
            first = max(computed, state.num_prompt_logprobs_done - 1, 0)
            last = min(computed + scheduled, num_prompt - 1)  # exclusive: positions first..last-1
            if first >= last:
                continue
            flat = int(query_start_loc[row]) + first - computed
            targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1], device=self.device)
            parts = []
            for offset in range(0, last - first, _PROMPT_LOGPROBS_SLICE):
                n = min(_PROMPT_LOGPROBS_SLICE, last - first - offset)
                logits = self.model.compute_logits(hidden_states[flat + offset : flat + offset + n])
                parts.append(
                    gather_logprobs(logits.log_softmax(dim=-1), num_logprobs, targets[offset : offset + n])
                )
            results[state.req_id] = _to_arrays(LogprobsTensors(*(torch.cat(ts) for ts in zip(*parts, strict=True))))
            state.num_prompt_logprobs_done = last + 1
        return results

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
            batch.remove_request(req_id)

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
                block_ids=list(new_req.block_ids),
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
                state.block_ids = list(new_block_ids)
            else:
                state.block_ids.extend(new_block_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add_request(state)
            else:
                batch.num_computed_tokens_cpu[row] = num_computed
                batch.append_block_ids(row, new_block_ids)

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, Any, np.ndarray, torch.Tensor, np.ndarray]:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids), np.int32, num_reqs
        )
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        # Row and in-request offset of every flat token, without a Python loop over tokens.
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = self._arange[:total] - np.repeat(query_start_loc[:-1], num_scheduled)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions = num_computed[req_indices] + offsets
        input_ids = batch.token_ids_cpu[req_indices, positions]
        block_numbers = batch.block_table[req_indices, positions // self.block_size]
        slot_mapping = block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = num_computed + num_scheduled

        # Sample only where the request has computed all its known tokens (not mid-prompt).
        logits_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = torch.from_numpy(query_start_loc[logits_rows + 1].astype(np.int64) - 1)

        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            num_computed_tokens=num_computed,
            block_table=batch.block_table[:num_reqs],
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            block_size=self.block_size,
            device=self.device,
        )
        attn_metadata = self.attn_backend.build_metadata(common)
        return (
            torch.from_numpy(input_ids.astype(np.int64)).to(self.device),
            torch.from_numpy(positions).to(self.device),
            attn_metadata,
            logits_rows,
            logits_indices.to(self.device),
            query_start_loc,
        )


_PROMPT_LOGPROBS_SLICE = 512


def _to_arrays(t: LogprobsTensors) -> LogprobsArrays:
    return LogprobsArrays(t.logprob_token_ids.cpu().numpy(), t.logprobs.cpu().numpy(), t.token_ranks.cpu().numpy())


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU without touching its pages.

    NOTE: the cache must hold zeros, not garbage: padded decode reads touch unused slots, and a
    NaN there would survive its zero attention weight (0 * NaN = NaN). torch.zeros writes every
    page (seconds for a few GiB); numpy's zeros uses calloc, whose fresh pages the kernel
    already zeroed, so memory is only committed as the cache fills.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)

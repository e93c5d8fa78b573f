"""What the proposers that run a model share: KV cache pages of their own in the target's
blocks, attention metadata built from the target's block table, and the k forwards of a step.

The first forward covers the step's tokens as the target ran them, so the drafter's KV keeps up
with every token the target computed (prefill chunks included); its logits at each sampling
request's newest token give draft 1. Then k - 1 single-token forwards, one per draft, for the
requests that sampled. Drafts are the argmax: deterministic proposals, which the rejection
sampler treats as one-hot (exact for random sampling too). The scheduler gives every sampling
request k lookahead slots past its scheduled tokens for the drafter's rows.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.selector import get_attn_backend
from minivllm.spec_decode import DraftInputs, Proposer

if TYPE_CHECKING:
    from minivllm.config import ModelConfig, VllmConfig
    from minivllm.platforms.interface import Platform
    from minivllm.worker.block_table import BlockTable


class ModelProposer(Proposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, platform: Platform, dtype: str) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.model_config: ModelConfig = spec.draft_model_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.device = device
        self.platform = platform
        self.kv_cache_dtype = dtype
        self.attn_backend: AttentionBackend = get_attn_backend(
            platform, getattr(torch, dtype), self.model_config.get_head_size())

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> list[list[int]]:
        batch = inputs.batch
        sampled = inputs.sampled_rows
        num_scheduled = np.diff(inputs.query_start_loc)
        num_computed = batch.num_computed_tokens_cpu[: batch.num_reqs].astype(np.int64)
        # Where each sampling request's newest token sits in its scheduled tokens: after the
        # accepted drafts, in place of the first rejected one (or after the last).
        num_verified = np.fromiter(map(len, inputs.draft_token_ids), np.int64, len(sampled))
        num_new = np.fromiter(map(len, inputs.sampled_token_ids), np.int64, len(sampled))
        new_offset = num_scheduled[sampled] - num_verified + num_new - 1
        # Drafts each request has room for: a request never grows past max_model_len.
        room = np.minimum(self.num_speculative_tokens, self.max_model_len - (num_computed[sampled] + new_offset) - 2)
        drafting = room > 0
        table = batch.block_table[0]
        first, position, state = self.first_forward(inputs, table, num_computed, new_offset, drafting)
        rows, room = sampled[drafting], room[drafting]
        drafts = np.zeros((len(rows), self.num_speculative_tokens), dtype=np.int64)
        drafts[:, 0] = first
        alive = np.arange(len(rows))  # the drafting requests that want one more draft
        for k in range(1, self.num_speculative_tokens):
            keep = room[alive] > k
            if not keep.any():
                break
            alive, position, state = alive[keep], position[keep] + 1, self.select(state, keep)
            drafts[alive, k], state = self.next_forward(table, drafts[alive, k - 1], position, rows[alive], state)
        result: list[list[int]] = [[] for _ in sampled]
        for i, ids, n in zip(np.flatnonzero(drafting).tolist(), drafts.tolist(), room.tolist(), strict=True):
            result[i] = ids[:n]
        return result

    @abstractmethod
    def first_forward(self, inputs: DraftInputs, table: BlockTable, num_computed: np.ndarray, new_offset: np.ndarray,
                      drafting: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        """The forward over the step's tokens: draft 1 of each drafting request (`drafting`:
        which sampled rows draft; `new_offset`: where each sampled row's newest token sits in its
        scheduled tokens), the position of the row that gave it, and what the next forward feeds
        besides the token (per drafting request)."""

    @abstractmethod
    def next_forward(self, table: BlockTable, token_ids: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                     state: Any) -> tuple[np.ndarray, Any]:
        """One token per request (batch rows `rows`) at `positions`: the next drafts, and the
        next state."""

    @staticmethod
    def select(state: Any, keep: np.ndarray) -> Any:
        """The state of the requests kept."""
        return state

    def attn_metadata(self, table: BlockTable, rows: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                      query_start_loc: np.ndarray, seq_lens: np.ndarray) -> Any:
        """The drafter backend's metadata for flat tokens of the batch rows `rows` (req_indices
        index into `rows`), written where the target's block table puts their positions."""
        block_table = table.block_table[rows]
        block_size = table.block_size
        slots = block_table[req_indices, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return self.attn_backend.build_metadata(CommonAttentionMetadata.from_arrays(
            query_start_loc.astype(np.int32), seq_lens.astype(np.int32), block_table, self.tensor(slots), block_size,
            self.device))

    def single_token_metadata(self, table: BlockTable, rows: np.ndarray, positions: np.ndarray) -> Any:
        """Metadata of one token per request at `positions`."""
        one = np.arange(len(rows))
        return self.attn_metadata(table, rows, one, positions, np.arange(len(rows) + 1), positions + 1)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def argmax(self, logits: torch.Tensor) -> np.ndarray:
        return self.platform.argmax(logits).cpu().numpy()

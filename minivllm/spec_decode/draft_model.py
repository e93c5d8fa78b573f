"""Drafting with a smaller model of the same vocabulary (vLLM's draft_model method).

The drafter keeps a KV cache of its own: its attention layers get pages in the same blocks as
the target's (one KV cache group, so one block table serves both; the pages may differ in dtype
and shape). Each step it runs k forwards on the same device, right after the target's sampling:

1. Over the step's tokens as the target ran them, each request's segment followed by one more
   row, with its newest token written where it belongs: a request that verified k drafts and
   accepted a of them has its new token at offset n - k + a of its n scheduled tokens (the extra
   row when all were accepted; the rows after it hold rejected drafts, written over by later
   forwards before anything reads them). So the drafter's KV always covers every token the
   target computed, prefill chunks included, and its logits at the new token give draft 1.
2. k - 1 single-token forwards for the requests that sampled, each feeding the previous draft.

Drafts are the drafter's argmax: a deterministic proposal, which the rejection sampler treats as
one-hot (exact for random sampling too). The scheduler gives every sampling request k lookahead
slots past its scheduled tokens for the drafter's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.selector import get_attn_backend
from minivllm.model.layers.attention import Attention
from minivllm.model.loader import get_model
from minivllm.spec_decode import DraftInputs, Proposer

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.platforms.interface import Platform
    from minivllm.worker.block_table import BlockTable


class DraftModelProposer(Proposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, platform: Platform) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.model_config = spec.draft_model_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.device = device
        self.platform = platform
        self.kv_cache_dtype = self.model_config.dtype
        self.attn_backend = get_attn_backend(platform, getattr(torch, self.kv_cache_dtype),
                                             self.model_config.get_head_size())
        self.model: torch.nn.Module | None = None

    def load_model(self, target_model: torch.nn.Module) -> dict[str, Attention]:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        return {f"draft_model.{name}": m for name, m in self.model.named_modules() if isinstance(m, Attention)}

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> list[list[int]]:
        assert self.model is not None and inputs.query_start_loc is not None and inputs.input_ids_np is not None
        batch = inputs.batch
        num_reqs = batch.num_reqs
        query_start_loc = inputs.query_start_loc
        num_scheduled = np.diff(query_start_loc)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        sampled = inputs.sampled_rows
        # Where each sampling request's newest token sits in its segment, and its position.
        num_verified = np.fromiter(map(len, inputs.draft_token_ids), np.int64, len(sampled))
        num_new = np.fromiter(map(len, inputs.sampled_token_ids), np.int64, len(sampled))
        new_offset = num_scheduled[sampled] - num_verified + num_new - 1
        new_position = num_computed[sampled] + new_offset
        # Drafts each request has room for (a request never grows past max_model_len).
        num_drafts = np.minimum(self.num_speculative_tokens, self.max_model_len - new_position - 2)
        drafting = num_drafts > 0

        # Forward 1: the step's segments, plus the extra row of each drafting request.
        segment_lens = num_scheduled.astype(np.int64)
        segment_lens[sampled[drafting]] += 1
        starts = np.concatenate(([0], np.cumsum(segment_lens)))
        req_indices = np.repeat(np.arange(num_reqs), segment_lens)
        offsets = np.arange(starts[-1]) - starts[req_indices]
        positions = num_computed[req_indices] + offsets
        token_ids = np.zeros(starts[-1], dtype=np.int64)
        from_step = offsets < num_scheduled[req_indices]
        token_ids[from_step] = inputs.input_ids_np[query_start_loc[req_indices[from_step]] + offsets[from_step]]
        new_rows = starts[sampled[drafting]] + new_offset[drafting]
        token_ids[new_rows] = [ids[-1] for ids, d in zip(inputs.sampled_token_ids, drafting, strict=True) if d]
        table = batch.block_table[0]
        first = self._forward(table, token_ids, positions, np.arange(num_reqs), req_indices, starts, num_computed,
                              num_computed + segment_lens, new_rows)

        # Forwards 2..k: one token per drafting request, fed its previous draft.
        rows, position, room = sampled[drafting], new_position[drafting], num_drafts[drafting]
        drafts = np.zeros((len(rows), self.num_speculative_tokens), dtype=np.int64)
        drafts[:, 0] = first
        for k in range(1, self.num_speculative_tokens):
            active = np.flatnonzero(room > k)
            if not len(active):
                break
            fed_position = position[active] + k
            one = np.arange(len(active))
            drafts[active, k] = self._forward(table, drafts[active, k - 1], fed_position, rows[active], one,
                                              np.arange(len(active) + 1), fed_position, fed_position + 1, None)
        result: list[list[int]] = [[] for _ in sampled]
        for i, ids, n in zip(np.flatnonzero(drafting).tolist(), drafts.tolist(), room.tolist(), strict=True):
            result[i] = ids[:n]
        return result

    def _forward(self, table: BlockTable, token_ids: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                 req_indices: np.ndarray, query_start_loc: np.ndarray, num_computed: np.ndarray,
                 seq_lens: np.ndarray, logits_rows: np.ndarray | None) -> np.ndarray:
        """One forward of the drafter over flat tokens of the batch rows `rows` (req_indices
        index into `rows`); the argmax at `logits_rows` (None: at every token)."""
        assert self.model is not None
        block_table = table.block_table[rows]
        block_size = table.block_size
        slots = block_table[req_indices, positions // block_size].astype(np.int64) * block_size + positions % block_size
        metadata = self.attn_backend.build_metadata(CommonAttentionMetadata(
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            num_computed_tokens=num_computed.astype(np.int32),
            block_table=block_table,
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_size=block_size,
            device=self.device,
        ))
        pruned = None if logits_rows is None else self._tensor(logits_rows)
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), (metadata,), pruned)
        return self.platform.argmax(self.model.compute_logits(hidden)).cpu().numpy()

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

"""Drafting with a smaller model of the same vocabulary (vLLM's draft_model method), in its own
dtype.

Its first forward runs the step's tokens as the target ran them, each request's segment followed
by one more row, with the request's newest token written where it belongs: a request that
verified k drafts and accepted a of them has its new token at offset n - k + a of its n scheduled
tokens (the extra row when all were accepted; rows after it hold rejected drafts, written over
by later forwards before anything reads them). Its logits at the new token give draft 1; each
next forward feeds the previous draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.model.layers.attention import Attention
from minivllm.model.loader import get_model
from minivllm.spec_decode import DraftInputs
from minivllm.spec_decode.model_proposer import ModelProposer

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.platforms.interface import Platform
    from minivllm.worker.block_table import BlockTable


class DraftModelProposer(ModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, platform: Platform) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        super().__init__(vllm_config, device, platform, spec.draft_model_config.dtype)
        self.model: Any = None

    def load_model(self, target_model: torch.nn.Module) -> dict[str, Attention]:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        return {f"draft_model.{name}": m for name, m in self.model.named_modules() if isinstance(m, Attention)}

    def first_forward(self, inputs: DraftInputs, table: BlockTable, num_computed: np.ndarray, new_offset: np.ndarray,
                      drafting: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        query_start_loc = inputs.query_start_loc
        num_scheduled = np.diff(query_start_loc)
        sampled = inputs.sampled_rows
        segment_lens = num_scheduled.astype(np.int64)
        segment_lens[sampled[drafting]] += 1
        starts = np.concatenate(([0], np.cumsum(segment_lens)))
        req_indices = np.repeat(np.arange(len(segment_lens)), segment_lens)
        offsets = np.arange(starts[-1]) - starts[req_indices]
        positions = num_computed[req_indices] + offsets
        token_ids = np.zeros(starts[-1], dtype=np.int64)
        from_step = offsets < num_scheduled[req_indices]
        token_ids[from_step] = inputs.input_ids_np[query_start_loc[req_indices[from_step]] + offsets[from_step]]
        new_rows = starts[sampled[drafting]] + new_offset[drafting]
        token_ids[new_rows] = [ids[-1] for ids, d in zip(inputs.sampled_token_ids, drafting.tolist(), strict=True)
                               if d]
        metadata = self.attn_metadata(table, np.arange(len(segment_lens)), req_indices, positions, starts,
                                      num_computed + segment_lens)
        hidden = self.model(self.tensor(token_ids), self.tensor(positions), (metadata,), self.tensor(new_rows))
        return self.argmax(self.model.compute_logits(hidden)), positions[new_rows], None

    def next_forward(self, table: BlockTable, token_ids: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                     state: Any) -> tuple[np.ndarray, Any]:
        metadata = self.single_token_metadata(table, rows, positions)
        hidden = self.model(self.tensor(token_ids), self.tensor(positions), (metadata,))
        return self.argmax(self.model.compute_logits(hidden)), None

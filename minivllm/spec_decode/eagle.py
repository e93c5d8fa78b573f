"""EAGLE-1 and EAGLE-3 drafting: a one-layer head over the target's hidden states (vLLM's eagle
and eagle3 methods), sharing the target's embedding (and, for EAGLE-1, its lm_head).

The head's row at position p reads the token at p + 1 and the target's hidden state at p
(EAGLE-3: the target's residual stream at three layers, concatenated) and predicts the token at
p + 2. So its first forward runs the step's positions with the tokens shifted left by one, read
from the batch rows after sampling: a sampling request's newest token is the input of the row
just before it, whose logits give draft 1 (rows after it hold rejected drafts, written over
later). Each next forward feeds the previous draft with the head's own hidden state from the row
that drafted it, one position further.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.model.layers.attention import Attention
from minivllm.model.loader import default_dtype, iterate_safetensors_weights
from minivllm.model.models.llama_eagle import (
    Eagle3LlamaForCausalLM,
    EagleLlamaForCausalLM,
    eagle3_aux_layers,
)
from minivllm.spec_decode import DraftInputs
from minivllm.spec_decode.model_proposer import ModelProposer

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.platforms.interface import Platform
    from minivllm.worker.block_table import BlockTable


class EagleProposer(ModelProposer):
    needs_hidden_states = True

    def __init__(self, vllm_config: VllmConfig, device: torch.device, platform: Platform) -> None:
        # The head computes in the target's dtype: it shares the target's embedding.
        super().__init__(vllm_config, device, platform, vllm_config.model_config.dtype)
        spec = vllm_config.speculative_config
        assert spec is not None
        self.head_cls = Eagle3LlamaForCausalLM if spec.method == "eagle3" else EagleLlamaForCausalLM
        self.head: Any = None

    def load_model(self, target_model: torch.nn.Module) -> dict[str, Attention]:
        target_config = target_model.config
        with default_dtype(getattr(torch, self.kv_cache_dtype)), torch.device(self.device):
            head = self.head_cls(self.model_config.hf_config, self.attn_backend, target_config.hidden_size)
        loaded = head.load_weights(iterate_safetensors_weights(self.model_config.model))
        missing = head.expected_weight_names() - loaded
        if missing:
            raise ValueError(f"EAGLE head {self.model_config.model!r} lacks weights: {sorted(missing)[:8]}")
        head.bind_target(target_model)
        if self.head_cls is Eagle3LlamaForCausalLM:
            target_model.model.aux_hidden_state_layers = eagle3_aux_layers(target_config.num_hidden_layers)
        self.head = head.eval()
        return {f"eagle_head.{name}": m for name, m in head.named_modules() if isinstance(m, Attention)}

    def first_forward(self, inputs: DraftInputs, table: BlockTable, num_computed: np.ndarray, new_offset: np.ndarray,
                      drafting: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        assert inputs.hidden_states is not None
        batch = inputs.batch
        query_start_loc = inputs.query_start_loc
        num_scheduled = np.diff(query_start_loc)
        num_reqs = len(num_scheduled)
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = num_computed[req_indices] + np.arange(query_start_loc[-1]) - query_start_loc[req_indices]
        # The token after each position, from the rows as they are after sampling (a position
        # past the end of the context only ever feeds rows that are written over).
        next_positions = np.minimum(positions + 1, self.max_model_len - 1)
        token_ids = batch.token_ids_cpu[req_indices, next_positions]
        sampled = inputs.sampled_rows[drafting]
        logits_rows = query_start_loc[sampled] + new_offset[drafting] - 1
        metadata = self.attn_metadata(table, np.arange(num_reqs), req_indices, positions, query_start_loc,
                                      num_computed + num_scheduled)
        hidden, feed = self.head(self.tensor(token_ids), self.tensor(positions), inputs.hidden_states, (metadata,))
        rows = self.tensor(logits_rows)
        drafts = self.argmax(self.head.compute_draft_logits(hidden[rows]))
        return drafts, positions[logits_rows], feed[rows]

    def next_forward(self, table: BlockTable, token_ids: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                     state: Any) -> tuple[np.ndarray, Any]:
        metadata = self.single_token_metadata(table, rows, positions)
        hidden, feed = self.head(self.tensor(token_ids), self.tensor(positions), state, (metadata,))
        return self.argmax(self.head.compute_draft_logits(hidden)), feed

    @staticmethod
    def select(state: Any, keep: np.ndarray) -> Any:
        return state[torch.from_numpy(keep).to(state.device)]

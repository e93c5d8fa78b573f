"""Speculative decoding: proposers that draft tokens for the target model to verify in one
forward pass.

After sampling, the model runner hands the proposer the step (DraftInputs) and gets back draft
tokens for each request that sampled; they travel to the scheduler in ModelRunnerOutput, which
keeps those the request can use and schedules them after its last known token in the next
step; the rejection sampler (sample/rejection_sampler.py) verifies them there. Every proposer
drafts deterministically (lookup or argmax), so the verification treats each draft as a
one-hot distribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from minivllm.config import VllmConfig
    from minivllm.model.layers.attention import Attention
    from minivllm.platforms.interface import Platform
    from minivllm.worker.input_batch import InputBatch


@dataclass
class DraftInputs:
    """One step, as a proposer sees it after sampling."""

    batch: InputBatch  # the sampled tokens already recorded in their rows
    sampled_rows: np.ndarray  # the batch rows that sampled, in order
    sampled_token_ids: list[list[int]]  # per sampled row: its accepted drafts and one more token
    draft_token_ids: list[list[int]]  # per sampled row: the drafts it verified in this step
    # The target's forward of the step: its flat token ids on the host, and where each batch
    # row's tokens start (num_reqs + 1 entries).
    input_ids_np: np.ndarray
    query_start_loc: np.ndarray
    # The target's hidden states of every token of the step, for a proposer that drafts from
    # them (needs_hidden_states): the final ones, or EAGLE-3's aux states concatenated.
    hidden_states: torch.Tensor | None = None


class Proposer(ABC):
    """Drafts up to num_speculative_tokens tokens per request that sampled."""

    kv_cache_dtype: str | None = None
    """The dtype of its attention layers' KV cache pages (a proposer with a model)."""
    needs_hidden_states = False
    """Whether it drafts from the target's hidden states of every token (EAGLE): the target then
    keeps them all (no last-layer pruning, no replayed forward)."""

    def load_model(self, target_model: torch.nn.Module) -> dict[str, Attention]:
        """Load what it runs, after the target (whose embedding and lm_head a head may share);
        its attention layers by name, which get KV cache pages of their own."""
        return {}

    @abstractmethod
    def propose(self, inputs: DraftInputs) -> list[list[int]]:
        """Draft tokens for each sampled row, in order (possibly empty)."""


def make_proposer(vllm_config: VllmConfig, device: torch.device, platform: Platform) -> Proposer:
    """The proposer of the engine's speculative_config."""
    spec = vllm_config.speculative_config
    assert spec is not None
    if spec.method == "ngram":
        from minivllm.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.lookup_min, spec.lookup_max,
                             vllm_config.model_config.max_model_len)
    if spec.method == "draft_model":
        from minivllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(vllm_config, device, platform)
    from minivllm.spec_decode.eagle import EagleProposer

    return EagleProposer(vllm_config, device, platform)

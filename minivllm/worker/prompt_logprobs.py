"""Prompt logprobs: the logprob of every prompt token given the ones before it, for requests that
ask (SamplingParams.prompt_logprobs), computed from each prefill chunk's hidden states.

The hidden state at position p predicts prompt token p + 1. A resumed request recomputes its
prompt, so the positions already reported are remembered per request and skipped. Logits are
computed a slice at a time: a whole prompt's [tokens, vocab] logits could take gigabytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from minivllm.core.outputs import LogprobsArrays
from minivllm.sample.sampler import LogprobsTensors, gather_logprobs
from minivllm.worker.input_batch import CachedRequestState, InputBatch

PROMPT_LOGPROBS_SLICE = 512


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,  # [num_tokens, hidden], every scheduled token's final state
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    rows: np.ndarray,  # batch rows of the requests that ask for prompt logprobs
) -> dict[str, LogprobsArrays]:
    """Logprobs of the prompt tokens this step's chunk predicts, per request id."""
    results: dict[str, LogprobsArrays] = {}
    for row in rows.tolist():
        state = requests[batch.req_ids[row]]
        num_prompt = len(state.prompt_token_ids)
        computed = int(batch.num_computed_tokens_cpu[row])
        scheduled = int(query_start_loc[row + 1] - query_start_loc[row])
        first = max(computed, state.num_prompt_logprobs_done - 1, 0)
        last = min(computed + scheduled, num_prompt - 1)  # exclusive: positions first..last-1
        if state.num_prompt_logprobs_done >= num_prompt or first >= last:
            continue
        flat = int(query_start_loc[row]) + first - computed
        targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1], device=hidden_states.device)
        num_logprobs = int(batch.sampling.num_prompt_logprobs[row])
        parts = []
        for offset in range(0, last - first, PROMPT_LOGPROBS_SLICE):
            n = min(PROMPT_LOGPROBS_SLICE, last - first - offset)
            logits = compute_logits(hidden_states[flat + offset : flat + offset + n])
            parts.append(gather_logprobs(logits.log_softmax(dim=-1), num_logprobs, targets[offset : offset + n]))
        results[state.req_id] = LogprobsTensors(*(torch.cat(ts) for ts in zip(*parts, strict=True))).to_arrays()
        state.num_prompt_logprobs_done = last + 1
    return results

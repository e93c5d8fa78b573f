"""The token embedding and the lm_head, split between tensor-parallel ranks by vocabulary rows.

Each rank holds ceil(vocab / tp) rows (the last rank's tail zero-padded, so every rank's share
has one shape). The embedding looks up the ids in its range, zeroes the others, and the ranks
sum their lookups (all-reduce): each id is found on exactly one rank. The lm_head multiplies by
its rows and the ranks' logits are concatenated (all-gather): every rank gets the whole
vocabulary, because every rank samples (and must pick the same tokens, for its own copy of each
request's state), as vLLM V1 does. With one rank both are a plain embedding and matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import get_tp_group
from minivllm.model.layers.quant import GroupQuantized
from minivllm.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_rows = cdiv(num_embeddings, self.tp.world_size)
        self.vocab_start = self.tp.rank_in_group * self.shard_rows
        self.num_real_rows = max(0, min(self.shard_rows, num_embeddings - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.shard_rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def rank_rows(self, loaded: torch.Tensor | GroupQuantized) -> torch.Tensor | GroupQuantized:
        """This rank's rows of a [vocab, ...] checkpoint tensor (without the padding)."""
        return loaded.narrow(0, self.vocab_start, self.num_real_rows)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if loaded_weight.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"Shape mismatch: embedding ({self.num_embeddings}, {param.shape[1]}) vs checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        param.data[: self.num_real_rows].copy_(self.rank_rows(loaded_weight))
        param.data[self.num_real_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's vocab rows (real ones, or padded)] -> [rows, vocab] on every rank."""
        if self.tp.world_size == 1:
            return local_logits
        if local_logits.shape[1] < self.shard_rows:
            local_logits = F.pad(local_logits, (0, self.shard_rows - local_logits.shape[1]))
        return self.tp.all_gather(local_logits, dim=-1)[:, : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied lm_head: its own rows, used only through gather_logits (the model multiplies)."""

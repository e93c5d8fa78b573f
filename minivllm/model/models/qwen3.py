"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from minivllm.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

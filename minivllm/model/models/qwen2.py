"""Qwen2: the Llama decoder with a bias on the q/k/v projection (and none on o_proj)."""

from __future__ import annotations

from minivllm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

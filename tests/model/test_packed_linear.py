"""Linear weights packed for oneDNN on CPU in bfloat16: the same products as F.linear on the plain
weight (bit for bit), at every row count, and the loader packs exactly the layers it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm import SamplingParams
from minivllm.attention.selector import get_attn_backend
from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.layers.linear import Linear, QKVParallelLinear, linear
from minivllm.model.loader import get_model
from minivllm.platforms import get_platform

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not get_platform("cpu").use_packed_linear(torch.bfloat16),
                                reason="torch built without oneDNN")


def _loaded(layer: Linear, gen: torch.Generator) -> Linear:
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
def test_packed_linear_equals_f_linear(rows):
    """Fused QKV with bias and a plain projection: packed output == F.linear on the weight the
    layer was loaded with, for contiguous and strided inputs; and both are as close to the float64
    product as a bfloat16 result can be."""
    gen = torch.Generator().manual_seed(rows)
    with torch.device(CPU):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layers = [QKVParallelLinear(576, 64, 9, 3, bias=True), Linear(1536, 576)]
        finally:
            torch.set_default_dtype(torch.float32)
    for layer in layers:
        _loaded(layer, gen)
        weight = layer.weight.detach().clone()
        bias = None if layer.bias is None else layer.bias.detach().clone()
        layer.process_weights_after_loading()
        assert layer.weight.is_mkldnn and layer.weight.shape == weight.shape
        wide = torch.randn(rows, 2 * layer.input_size, generator=gen).bfloat16()
        for x in (wide[:, : layer.input_size], wide[:, ::2]):  # a row-strided and a column-strided view
            out = layer(x)
            assert torch.equal(out, F.linear(x, weight, bias))
            exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
            tol = exact.abs().max().item() * 2**-7
            torch.testing.assert_close(out.double(), exact, rtol=0, atol=tol)


def _model(model_dir, dtype: str):
    config = EngineArgs(model=str(model_dir), dtype=dtype).create_engine_config().model_config
    return get_model(config, CPU, get_attn_backend(get_platform("cpu"), getattr(torch, dtype), config.get_head_size()))


@pytest.mark.parametrize("tied", [False, True])
def test_loader_packs_bfloat16_cpu_weights(make_tiny_model, tied):
    """bfloat16: every Linear is packed, the lm_head (tied or not) gets a packed copy while it and
    the embedding keep their plain weights, and the logits equal F.linear's."""
    model = _model(make_tiny_model("llama", tie_word_embeddings=tied), "bfloat16")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all(m.weight.is_mkldnn for m in linears)
    assert not model.model.embed_tokens.weight.is_mkldnn and not model.lm_head.weight.is_mkldnn
    assert model.lm_head_packed is not None
    hidden = torch.randn(5, 64).bfloat16()
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight).float())


def test_loader_keeps_plain_weights_for_float32_and_when_switched_off(make_tiny_model, monkeypatch):
    """float32 keeps F.linear (the reference's GEMM); MINIVLLM_CPU_PACKED_LINEAR=0 turns packing off."""
    model_dir = make_tiny_model("llama")
    model = _model(model_dir, "float32")
    assert not any(p.is_mkldnn for p in model.parameters()) and model.lm_head_packed is None
    monkeypatch.setenv("MINIVLLM_CPU_PACKED_LINEAR", "0")
    model = _model(model_dir, "bfloat16")
    assert not any(p.is_mkldnn for p in model.parameters())
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x, model.lm_head.weight), F.linear(x, model.lm_head.weight))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generation_identical_with_and_without_packing(make_tiny_model, make_llm, monkeypatch, arch):
    """Greedy tokens and logprobs of a batch with prompts of mixed lengths (prefill and decode
    steps of many row counts) are identical with packing on and off."""
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(make_tiny_model(arch))
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 40000, (n,), generator=gen).tolist()}
               for n in (3, 17, 64, 130, 9, 250)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for packed in ("1", "0"):
        monkeypatch.setenv("MINIVLLM_CPU_PACKED_LINEAR", packed)
        llm = make_llm(model_dir, dtype="bfloat16")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]

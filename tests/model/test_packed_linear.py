"""Linear weights packed on CPU in bfloat16, for oneDNN's GEMM or minivllm's
(platforms/cpu_gemm.py picks one per process): oneDNN's gives the same products as F.linear on
the plain weight (bit for bit), minivllm's the float64 product rounded once, at every row count;
the loader packs exactly the layers it should for each."""

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
from minivllm.platforms.cpu_gemm import minivllm_gemm_built, use_minivllm_gemm

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not get_platform("cpu").use_packed_linear(torch.bfloat16),
                                reason="torch built without oneDNN")
needs_minivllm_gemm = pytest.mark.skipif(not minivllm_gemm_built(), reason="minivllm's bf16_gemm needs AVX-512")


@pytest.fixture
def gemm(monkeypatch):
    """Set which GEMM this process packs for (the choice is made once per process, so it is
    cleared around each test)."""
    def choose(name: str) -> None:
        monkeypatch.setenv("MINIVLLM_CPU_BF16_GEMM", name)
        use_minivllm_gemm.cache_clear()
    yield choose
    use_minivllm_gemm.cache_clear()


def _loaded(layer: Linear, gen: torch.Generator) -> Linear:
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("which", ["onednn", pytest.param("minivllm", marks=needs_minivllm_gemm)])
def test_packed_linear_matches_f_linear(gemm, rows, which):
    """Fused QKV with bias and a plain projection, for contiguous and strided inputs: oneDNN's
    packed output == F.linear on the weight the layer was loaded with; minivllm's is the float64
    product rounded to bfloat16 (its float32 sums may round the other way: one bfloat16 step at
    most); both as close to the float64 product as a bfloat16 result can be."""
    gemm(which)
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
        if which == "onednn":
            assert layer.weight.is_mkldnn and layer.weight.shape == weight.shape
        else:
            assert layer.weight.shape == (weight.shape[0] // 32, weight.shape[1], 32)
        wide = torch.randn(rows, 2 * layer.input_size, generator=gen).bfloat16()
        for x in (wide[:, : layer.input_size], wide[:, ::2]):  # a row-strided and a column-strided view
            out = layer(x)
            exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
            if which == "onednn":
                assert torch.equal(out, F.linear(x, weight, bias))
            else:
                assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
            tol = exact.abs().max().item() * 2**-7
            torch.testing.assert_close(out.double(), exact, rtol=0, atol=tol)


def _model(model_dir, dtype: str):
    config = EngineArgs(model=str(model_dir), dtype=dtype).create_engine_config().model_config
    return get_model(config, CPU, get_attn_backend(get_platform("cpu"), getattr(torch, dtype), config.get_head_size()))


@pytest.mark.parametrize("tied", [False, True])
def test_loader_packs_bfloat16_cpu_weights(make_tiny_model, gemm, tied):
    """bfloat16 with oneDNN's GEMM: every Linear is packed, the lm_head (tied or not) gets a
    packed copy while it and the embedding keep their plain weights, and the logits equal
    F.linear's."""
    gemm("onednn")
    model = _model(make_tiny_model("llama", tie_word_embeddings=tied), "bfloat16")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all(m.weight.is_mkldnn for m in linears)
    assert not model.model.embed_tokens.weight.is_mkldnn and not model.lm_head.weight.is_mkldnn
    assert model.lm_head_packed is not None
    hidden = torch.randn(5, 64).bfloat16()
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight).float())


@needs_minivllm_gemm
def test_loader_packs_for_minivllm_gemm(make_tiny_model, gemm):
    """minivllm's GEMM: weights of whole 32-row panels become panels (QKV 128 rows, o and down 64,
    the lm_head), the others (gate_up: 2 x 37 rows) keep oneDNN's packing; the logits are the
    float64 product rounded once."""
    gemm("minivllm")
    model = _model(make_tiny_model("llama", intermediate_size=37), "bfloat16")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, layer in linears.items():
        if layer.output_size % 32 == 0:
            assert layer.weight.shape == (layer.output_size // 32, layer.input_size, 32), name
        else:
            assert layer.weight.is_mkldnn, name
    assert {n.rsplit(".", 1)[-1] for n, m in linears.items() if m.weight.is_mkldnn} == {"gate_up_proj"}
    hidden = torch.randn(5, 64).bfloat16()
    exact = hidden.double() @ model.lm_head.weight.double().T
    logits = model.compute_logits(hidden).double()
    assert ((logits - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_loader_keeps_plain_weights_for_float32_and_when_switched_off(make_tiny_model, gemm, monkeypatch):
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
def test_generation_identical_with_and_without_packing(make_tiny_model, make_llm, gemm, monkeypatch, arch):
    """Greedy tokens and logprobs of a batch with prompts of mixed lengths (prefill and decode
    steps of many row counts) are identical with oneDNN's packing on and off."""
    gemm("onednn")
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

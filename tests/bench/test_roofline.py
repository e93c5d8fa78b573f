"""`minivllm bench roofline` (bench/roofline.py): the weight bytes and FLOPs it puts under its
floors, against published and hand-computed figures, and a run on this machine's CPU."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from minivllm.bench import roofline

LLAMA_3_1_8B = SimpleNamespace(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)


def test_llama_3_1_8b_weights_are_its_published_parameter_count():
    """8,030,261,248 parameters, of which 266,240 are RMSNorm weights (65 vectors of 4096),
    which the floor leaves out; two bytes each in bfloat16. KV: 2 x 32 layers x 8 x 128."""
    shape = roofline.ModelShape.from_config(LLAMA_3_1_8B, itemsize=2)
    assert shape.weight_bytes == 2 * (8_030_261_248 - 65 * 4096)
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_request_flops_by_hand():
    """One layer, hidden 2, one head of dim 2 (one KV head), MLP 3, vocab 5: q, k, v, o 2 x 2
    each and gate, up, down 2 x 3 each: 34 weights; LM head 10. A 2-token prompt and 2 output
    tokens feed 3 tokens: 2 x 34 x 3 + 2 x 10 x 2 = 244 FLOPs in linears; they attend to
    1 + 2 + 3 = 6 keys, 4 x 1 x 2 FLOPs each: 48."""
    shape = roofline.ModelShape(hidden=2, layers=1, heads=1, kv_heads=1, head_dim=2, intermediate=3, vocab=5,
                                tied=True, itemsize=4)
    assert shape.request_flops(num_in=2, num_out=2) == 244 + 48


def test_runs_here(make_tiny_model, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    roofline.add_cli_args(parser)
    out = tmp_path / "roofline.json"
    roofline.main(parser.parse_args([
        "--model", str(make_tiny_model("llama")), "--device", "cpu", "--dtype", "float32", "--matmul-size", "128",
        "--copy-gib", "0.01", "--num-prompts", "4", "--output-json", str(out)]))
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_GBps"] > 0 and result["matmul_TFLOPs"] > 0
    # The floor is the weights (and 1024 tokens of KV) over the bandwidth measured.
    expected = (result["weight_bytes"] + 1024 * 2 * 2 * 2 * 16 * 4) / (result["copy_bandwidth_GBps"] * 1e9)
    assert abs(result["tpot_floor_ms"] - expected * 1e3) < 1e-9
    assert "TPOT floor" in capsys.readouterr().out

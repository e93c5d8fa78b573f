#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU (an H200 for the figures in docs/PERFORMANCE.md),
# its own python3 with torch, triton and transformers, and this checkout's .gpu/ folder (made by
# scripts/gpu_prepare.sh), run the GPU tests, then the benchmarks. Writes three files to RESULTS:
# tests.log, bench.log and bench.json (every benchmark's JSON, by name). Each step has its own
# time limit, and all of them end within $GPU_CHECK_SECONDS (default 540, so that the script fits
# one 10-minute command; expected 5-6 minutes on an H200); a failed step does not stop the next.
#
#   scripts/gpu_check.sh RESULTS [--quick]
#
# --quick: the benchmarks on a small model with few requests (to check the script itself, on
# any machine; on one without CUDA the tests are skipped and the benchmarks run on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
results=$(realpath -m "${1:?usage: scripts/gpu_check.sh RESULTS [--quick]}")
quick=${2:-}
mkdir -p "$results"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-540}))
limit() {  # the step's own limit, or less where the deadline comes first
    local left=$((deadline - SECONDS)); echo $(( $1 < left ? $1 : (left > 0 ? left : 1) ))
}
py=${PYTHON:-python3}
site=/tmp/minivllm-gpu-site
work=$(mktemp -d)
if ! $py -c "import msgspec, zmq, gguf, fastapi, uvicorn" 2>/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/wheels/*.whl \
        || { echo "installing .gpu/wheels failed (run scripts/gpu_prepare.sh first)"; exit 1; }
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MINIVLLM_CPU_KERNELS=0 \
    MINIVLLM_TEST_TOKENIZER_DIR="$PWD/.gpu/tokenizer"
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" \
    | tee "$results/tests.log"

# 1. Tests: the engine against transformers on CUDA, CUDA graphs on vs off, Triton attention
#    against the reference backend and the formula.
timeout "$(limit 200)" $py -m pytest -q -p no:cacheprovider tests/gpu tests/worker/test_cuda_graph.py \
    tests/attention/test_triton_attention.py 2>&1 | tee -a "$results/tests.log"

# 2. Benchmarks, on a Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 query / 8 KV heads,
#    MLP 14336) in bfloat16 with random weights (load_format dummy) and SmolLM2's tokenizer and
#    vocabulary (49,152 tokens, so that every sampled id decodes; the 8B's own is 128,256).
model=$work/llama-3.1-8b-shaped
mkdir -p "$model" && cp .gpu/tokenizer/* "$model"/
if [ "$quick" = --quick ]; then
    shape='"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 32'
    prompts=16 in_len=128 tp_in=64 tp_out=32 out_len=16 copy=0.05 matmul=512
else
    shape='"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128'
    prompts=256 in_len=1024 tp_in=512 tp_out=256 out_len=128 copy=4 matmul=8192
fi
cat > "$model/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", $shape, "vocab_size": 49152,
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
JSON
engine=(--model "$model" --load-format dummy --dtype bfloat16 --max-model-len 2048)
bench() {  # NAME SECONDS [ENV=VALUE ...] -- bench arguments
    local name=$1 limit=$2; shift 2
    local env=(); while [ "$1" != -- ]; do env+=("$1"); shift; done; shift
    echo "=== $name: $*" | tee -a "$results/bench.log"
    env "${env[@]}" timeout "$(limit "$limit")" $py -m minivllm.entrypoints.cli bench "$@" --output-json "$work/$name.json" \
        2>&1 | tr '\r' '\n' | grep -v -E '^(INFO|DEBUG)|Processed prompts' | tee -a "$results/bench.log"
}
bench roofline 60 -- roofline --model "$model" --input-len $in_len --num-prompts $prompts \
    --throughput-input-len $tp_in --throughput-output-len $tp_out --copy-gib $copy --matmul-size $matmul
latency=(latency "${engine[@]}" --input-len $in_len --output-len $out_len --batch-size 1 --num-iters-warmup 1 --num-iters 3)
bench latency_graphs 60 -- "${latency[@]}"
bench latency_eager 60 -- "${latency[@]}" --enforce-eager
bench latency_torch_ref 90 MINIVLLM_ATTENTION_BACKEND=TORCH_REF -- "${latency[@]}"
throughput=(throughput "${engine[@]}" --input-len $tp_in --output-len $tp_out --temperature 0)
bench throughput_graphs 120 -- "${throughput[@]}" --num-prompts $prompts --max-num-seqs $prompts
bench throughput_eager 120 -- "${throughput[@]}" --num-prompts $prompts --max-num-seqs $prompts --enforce-eager
bench throughput_triton_64 60 -- "${throughput[@]}" --num-prompts 64 --max-num-seqs 64 --enforce-eager
bench throughput_torch_ref_64 90 MINIVLLM_ATTENTION_BACKEND=TORCH_REF -- "${throughput[@]}" --num-prompts 64 --max-num-seqs 64
$py - "$work" "$results/bench.json" <<'PY'
import glob, json, os, sys
work, out = sys.argv[1:]
merged = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "*.json")))}
json.dump(merged, open(out, "w"), indent=1)
print("wrote", out, "with", ", ".join(merged))
PY
rm -rf "$work"

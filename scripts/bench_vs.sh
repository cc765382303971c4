#!/usr/bin/env bash
# Throughput of several trees in one call, rounds interleaved: scripts/bench_vs.sh LABEL
# DIR[,DIR...] ROUNDS [bench throughput args]. Each DIR holds a `pagedserve` package (e.g.
# `git archive REV pagedserve | tar -x -C DIR`, carried to the device); "." is this tree.
# Prints output tok/s per tree and round, and writes each run's JSON under $OUT.
set -uo pipefail
label=$1 dirs=$2 rounds=$3
shift 3
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
# Each tree runs from its own folder: `python3 -m` puts the working directory first on
# sys.path, so from this repository's root every DIR would import this tree's package.
in_tree() { local abs=$(cd "$1" && pwd); shift; env -C "$abs" PYTHONPATH="$abs${PYTHONPATH:+:$PYTHONPATH}" "$@"; }
for dir in ${dirs//,/ }; do
  in_tree "$dir" python3 -c "import os, pagedserve, sys; sys.exit(0 if pagedserve.__file__ \
.startswith(os.getcwd() + '/') else 'bench_vs: $dir imports ' + pagedserve.__file__)" || exit 1
done
for round in $(seq "$rounds"); do
  for dir in ${dirs//,/ }; do
    name=$(basename "$(cd "$dir" && pwd)")
    in_tree "$dir" python3 -m pagedserve.cli bench throughput "$@" \
      --out "$OUT/vs_${label}_${name}_$round.json" 2>&1 \
      | grep -E "^pagedserve|_s "
  done
done
python3 - "$OUT" "$label" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob(f"vs_{sys.argv[2]}_*.json")):
    ours = json.loads(path.read_text())["pagedserve"]
    host = {k: round(v, 3) for k, v in ours.items() if k.endswith("_s") and k != "output_tok_s"}
    print(f"{path.stem:40s} {ours['output_tok_s']:10.1f} {host}")
PY

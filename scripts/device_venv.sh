#!/usr/bin/env bash
# The virtualenv `make serve DEVICE=cuda|rocm|hpu` runs in (the CPU's is `make setup`'s .venv).
#   scripts/device_venv.sh DEVICE VENV
# Environment, from the Makefile:
#   PYTHON      the interpreter to build the venv from (default python3)
#   TORCH       a torch requirement or wheel to install; empty: PYTHON's own torch when it has
#               one (the venv sees it, nothing is installed), else TORCH_PIN for the device
#   TORCH_PIN   that fallback: PyPI's Linux wheel is the CUDA build; ROCm's comes from ROCM_INDEX
#   WHEELS      a folder of wheels: install from it alone (a machine without a package index);
#               it must hold what PYTHON lacks; without a setuptools wheel there, PYTHON's own
#               setuptools builds the package
#   CONSTRAINTS the lock (`make lock`) for PYTHON's version, or empty: what PYTHON lacks is
#               installed at the locked versions; what it has (the machine's torch, triton,
#               transformers) is kept as it is
set -euo pipefail
device=$1 venv=$2
python=${PYTHON:-python3}
pip_args=(-q) build_args=()
if [ -n "${WHEELS:-}" ]; then
  pip_args+=(--no-index --find-links "$WHEELS")
  ls "$WHEELS"/setuptools-*.whl >/dev/null 2>&1 || build_args=(--no-build-isolation)
fi

case $device in
  cuda|rocm) ;;
  hpu) # Gaudi's torch comes only with Intel's software stack, never from a package index.
    if [ -n "${TORCH:-}" ] || ! "$python" -c 'import habana_frameworks.torch' 2>/dev/null; then
      echo "DEVICE=hpu needs Intel Gaudi's PyTorch (habana_frameworks.torch), which $python" \
           "lacks: use the Gaudi software stack's python (PYTHON=...) or its container" >&2
      exit 2
    fi ;;
  *) echo "DEVICE must be cpu, cuda, rocm or hpu, got '$device'" >&2; exit 2 ;;
esac

if [ -z "${TORCH:-}" ] && "$python" -c 'import torch' 2>/dev/null; then
  # No pip of its own: PYTHON's, seen through its site folders, installs into the venv (and
  # venv then needs no ensurepip, which some distributions leave out).
  "$python" -m venv --system-site-packages --without-pip "$venv"
  # --system-site-packages reaches the base interpreter only; when PYTHON itself runs in a
  # virtualenv or conda env (where a machine's torch often lives), its site folders are added.
  purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$python" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$purelib/device-python-site.pth"
else
  "$python" -m venv "$venv"
  index=()
  if [ "$device" = rocm ] && [ -z "${WHEELS:-}" ]; then index=(--index-url "$ROCM_INDEX"); fi
  "$venv/bin/python" -m pip install "${pip_args[@]}" "${index[@]}" "${TORCH:-$TORCH_PIN}"
fi
echo "$device: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')" \
     "($("$venv/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))'))"
pin=()
if [ -n "${CONSTRAINTS:-}" ]; then
  # The lock less every package the venv already sees: pinning those would replace the
  # machine's own builds (or fail offline).
  kept=$(mktemp)
  "$venv/bin/python" -m pip list --format=freeze 2>/dev/null | sed 's/==.*//' \
    | tr 'A-Z_' 'a-z-' > "$kept.names"
  while IFS= read -r line; do
    name=$(printf '%s' "${line%%==*}" | tr 'A-Z_' 'a-z-')
    case $line in \#*|'') continue ;; esac
    grep -qxF "$name" "$kept.names" || printf '%s\n' "$line"
  done < "$CONSTRAINTS" > "$kept"
  pin=(-c "$kept")
fi
"$venv/bin/python" -m pip install "${pip_args[@]}" "${build_args[@]}" "${pin[@]}" -e ".[server]"

#!/usr/bin/env bash
# The accelerator check in one command, for a fresh machine with one CUDA GPU (H100/H200 class):
#
#     bash scripts/device_check.sh [OUT_DIR]          # default runs/device-check; about 8 minutes
#     bash scripts/device_check.sh OUT_DIR --tiny     # the same on the CPU with tiny sizes (the test suite's)
#
# Writes OUT_DIR/device.json, device.md and device.log (docs/throughput.md says what they hold) and
# OUT_DIR/environment.txt. It downloads nothing at run time: the corpus and tokenizers ship with the
# package, the Hugging Face reference model is built from its config, and the source is used in place
# (PYTHONPATH=src), so no build step needs an index either. Packages already installed are used as they
# are (the CUDA build of torch above all); a missing one is installed with pip only when an index can be
# reached. Exit code: bubblefree's (0 every part passed, 1 a part failed, 2 no usable CUDA device).
set -u
out="${1:-runs/device-check}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2   # absolute: the script moves to the repository root
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BUBBLEFREE_CACHE="${BUBBLEFREE_CACHE:-/tmp/bubblefree-cache}"    # writable anywhere; the BPE is built once
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
    "$py" --version
} >"$out/environment.txt" 2>&1

# Runtime needs (pyproject.toml's dependencies) and the check's references (transformers; pytorch-optimizer
# is optional: without it only the optimizer pairs with a torch reference are timed).
missing=$("$py" - <<'PY'
import importlib.util
need = {"torch": "torch", "numpy": "numpy", "tokenizers": "tokenizers", "matplotlib": "matplotlib",
        "tqdm": "tqdm", "transformers": "transformers", "pytorch_optimizer": "pytorch-optimizer==4.1.0"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None and mod != "torch"))
PY
)
if [ -n "$missing" ]; then
    echo "device_check: installing $missing" | tee -a "$out/environment.txt"
    timeout 120 "$py" -m pip install -q $missing >>"$out/environment.txt" 2>&1 \
        || echo "device_check: could not install $missing (no index?); going on without" | tee -a "$out/environment.txt"
fi

"$py" - >>"$out/environment.txt" 2>&1 <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    x = torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16)
    print("bf16 matmul ok:", float((x @ x)[0, 0]) == 1024.0)
PY
cat "$out/environment.txt"

# 470 s inside bubblefree (its own deadline, each part with its budget); the timeout is the last resort.
timeout --signal=TERM --kill-after=20 540 "$py" -m bubblefree bench device --out "$out" "${@:2}"
code=$?
[ -f "$out/device.md" ] && cat "$out/device.md"
exit $code

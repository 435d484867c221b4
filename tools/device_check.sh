#!/usr/bin/env bash
# The accelerator check: kernel path, kernel-vs-XLA difference, attention memory, bf16
# matmul peak, base/big train step MFU beside torch bf16 autocast, decoding tokens/s.
# Under 8 minutes on one H200; `--profile cpu` runs every stage on small shapes.
#
#   tools/device_check.sh [--profile auto|gpu|tpu|cpu] [--json results.json]
#
# It needs jax, flax, optax, numpy and torch (for the comparison), nothing of the data
# stack. Wheels of missing packages placed in .whl/ are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# JAX and torch share the GPU in the comparison: JAX takes 60% of it, not 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"
exec python3 -m flaxformer_lite.benchmarks.device_check "$@"

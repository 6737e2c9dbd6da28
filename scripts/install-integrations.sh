#!/usr/bin/env bash
# The serving stacks kvcodec plugs into (docs/integrations/), for their tests: LMCache, SGLang, vLLM.
# Their full dependency sets pull CUDA builds of torch and gigabytes of GPU libraries; here each
# package goes in with --no-deps, plus the few pure-Python or small packages that the interfaces
# kvcodec uses need to import on a CPU-only machine. Nothing here replaces the venv's torch.
# Usage: scripts/install-integrations.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
pip="$venv/bin/python -m pip --disable-pip-version-check -q"

# LMCache: the serde registry, memory objects, L1 manager, L2 adapters (fs, resp, plugin).
$pip install --no-deps "lmcache==0.5.6"
$pip install cryptography numba py-cpuinfo aiohttp cachetools aiofiles

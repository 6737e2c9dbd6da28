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

# Rule: never let one of these pull torch (or CUDA libraries): anything that depends on torch goes in
# with --no-deps.

# LMCache: the serde registry, memory objects, L1 manager, L2 adapters (fs, resp, plugin).
$pip install --no-deps "lmcache==0.5.6"
$pip install cryptography numba py-cpuinfo aiohttp cachetools aiofiles

# SGLang: the HiCacheStorage interface and its backend factory. `import sglang` imports triton at the
# top level (so triton, without its torch pin); the host memory pool module additionally needs
# torchvision, which has no build for the CPU torch here: it is not installed, and not imported.
$pip install --no-deps "sglang==0.5.23" "triton==3.8.0"
$pip install orjson pybase64 msgspec pyzmq ipython pillow requests

# vLLM: KVConnectorBase_V1, its config, scheduler and request classes and the connector factory.
# Its kernels and CUDA stack are not installed (--no-deps); torch-bound packages with --no-deps.
$pip install --no-deps "vllm==0.33.0" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" "llguidance<1.8.0,>=1.7.0"
$pip install cbor2 oss-harmony openai cloudpickle uvloop partial-json-parser

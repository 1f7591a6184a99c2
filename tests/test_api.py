"""The Python API, through the public names only (`import fp8fix`; `fp8fix.convert(...)`), as
docs/python-api.md shows it; and its agreement with the CLI's options."""

from __future__ import annotations

import importlib
import inspect as pyinspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest
import torch

import fp8fix
from fp8fix import vocab
from tests.builders import build, phi3
from tests.conftest import load_tensors, raw


class PathLikeOnly(os.PathLike[str]):
    """A path object that is neither str nor pathlib.Path."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def test_every_public_name_resolves_and_submodules_do_not_rebind_them() -> None:
    for name in fp8fix.__all__:
        assert getattr(fp8fix, name) is not None, name
    assert sorted(dir(fp8fix)) == sorted(fp8fix.__all__)
    for module in ("fp8fix.conversion", "fp8fix.inspection", "fp8fix.verification", "fp8fix.cli"):
        importlib.import_module(module)  # submodules named unlike the functions: nothing is rebound

    assert all(callable(getattr(fp8fix, f)) for f in ("convert", "inspect", "verify", "push", "architectures"))
    assert pyinspect.isfunction(fp8fix.convert) and pyinspect.isfunction(fp8fix.verify)
    with pytest.raises(AttributeError):
        fp8fix.no_such_name  # noqa: B018
    assert (Path(fp8fix.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("kind", [str, Path, PathLikeOnly])
def test_convert_verify_inspect_from_python(tmp_path: Path, kind: type) -> None:
    src = build(tmp_path / "src", phi3(), scale="shard")
    out = tmp_path / "out"
    result = fp8fix.convert(kind(src), kind(out), layout="fused", verify=True)
    assert isinstance(result, fp8fix.ConvertResult) and result.written and result.plan.layout == "fused"
    assert result.verification is not None and result.verification.ok
    assert all(m.action == "requantize" for m in result.plan.modules if m.fused_module.endswith("qkv_proj"))
    record = result.to_json()
    assert record["schema_version"] == 2 and record["layout"] == "fused" and record["written"]
    report = fp8fix.verify(kind(src), kind(out))
    assert isinstance(report, fp8fix.VerifyReport) and report.ok and report.to_json()["schema_version"] == 2
    inspected = fp8fix.inspect(kind(src))
    assert isinstance(inspected, fp8fix.InspectReport) and inspected.architecture == "Phi3ForCausalLM"
    assert inspected.loaders["vLLM >= 0.32"]["verdict"] == "fails"  # per-shard scales on a fused module
    weight = "model.layers.0.mlp.down_proj.weight"
    assert raw(load_tensors(out)[weight]) == raw(load_tensors(src)[weight])


def test_options_are_validated_before_any_work(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    cases = [
        (dict(layout="bogus"), "layout must be one of 'unfused', 'per-shard', 'fused', 'channel' or None, not 'bogus'"),
        (dict(to="e5m2"), "to must be one of 'e4m3fn', 'e4m3fnuz', 'bf16', 'float16' or None"),
        (dict(target="sglang"), "target must be one of 'auto', 'vllm', 'vllm-legacy', 'transformers', not 'sglang'"),
        (dict(output_format="gguf"), "output_format must be one of 'keep', 'compressed-tensors' or None"),
        (dict(jobs=0), "jobs must be a whole number of processes, at least 1 or 'auto', not 0"),
        (dict(jobs="all"), "jobs must be a whole number of processes, at least 1 or 'auto', not 'all'"),
        (dict(arch_files="one.json"), "arch_files must be a list of paths"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as raised:
            fp8fix.convert(src, tmp_path / "out", **options)  # type: ignore[arg-type]
        assert message in str(raised.value), options
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="jobs must be"):
        fp8fix.verify(src, src, jobs=-2)


def test_errors_are_the_public_types_and_name_keyword_arguments(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(fp8fix.UsageError) as raised:
        fp8fix.convert(src, tmp_path / "out")
    assert "pass overwrite=True to replace it" in str(raised.value) and "--overwrite" not in str(raised.value)
    with pytest.raises(fp8fix.UsageError, match=f"SOURCE {tmp_path / 'missing'}: no such folder"):
        fp8fix.inspect(tmp_path / "missing")
    with pytest.raises(fp8fix.UnsupportedCheckpoint) as refused:
        fp8fix.convert(build(tmp_path / "block", phi3(), fmt="block-fp8"), tmp_path / "o2", layout="channel")
    assert "layout=" in str(refused.value) or "output_format=" in str(refused.value) or "--" not in str(refused.value)


def test_an_explicit_registry_applies_to_that_call_only(tmp_path: Path) -> None:
    config = {**phi3().config, "architectures": ["MyPhiForCausalLM"]}
    model = phi3()
    model.config = config
    src = build(tmp_path / "src", model)
    entry = tmp_path / "mine.json"
    entry.write_text(json.dumps(fp8fix.architecture_template("MyPhiForCausalLM")))
    with pytest.raises(fp8fix.UnsupportedCheckpoint, match="MyPhiForCausalLM is not in fp8fix's registry"):
        fp8fix.convert(src, tmp_path / "refused")
    result = fp8fix.convert(src, tmp_path / "out", arch_files=[entry])
    assert result.written and {m.fused_module for m in result.plan.modules} == {
        "self_attn.qkv_proj",
        "mlp.gate_up_proj",
    }
    extended = fp8fix.Registry.builtin().with_arch_files([entry])
    assert fp8fix.verify(src, tmp_path / "out", registry=extended).ok
    assert "MyPhiForCausalLM" in [a.name for a in fp8fix.architectures(registry=extended)]
    assert "MyPhiForCausalLM" not in [a.name for a in fp8fix.architectures()]  # nothing global changed


def test_progress_is_off_by_default(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    src = build(tmp_path / "src", phi3())
    capfd.readouterr()
    fp8fix.convert(src, tmp_path / "out", to="e4m3fnuz")
    fp8fix.verify(src, tmp_path / "out")
    assert capfd.readouterr() == ("", "")
    assert load_tensors(tmp_path / "out")["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fnuz


def test_a_hub_repo_id_from_python(tmp_path: Path) -> None:
    """`fp8fix.convert("org/name", ...)` downloads through huggingface_hub (here: a prepared offline cache)."""
    from tests.test_hub import SHA

    cache = tmp_path / "cache" / "models--org--tiny-fp8"
    build(cache / "snapshots" / SHA, phi3())
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(SHA)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"))
    code = f"import fp8fix; r = fp8fix.convert('org/tiny-fp8', {str(tmp_path / 'out')!r}); print(r.written)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert "base_model: org/tiny-fp8" in (tmp_path / "out" / "README.md").read_text()


#: CLI options that shape the CLI's output or chain commands, with no keyword argument in the API.
CLI_ONLY = {
    "as_json",
    "quiet",
    "verbose",
    "strict",
    "push_to_hub",
    "private",
    "create_pr",
    "commit_message",
    "commit_description",
    "commit_size",
}
#: convert's options for a streamed conversion, which are `convert_to_hub`'s (test below).
STREAMED = {"max_disk", "part", "finalize"}
#: The CLI's `--arch-file` arrives as a Registry (validated by click); the API takes either; the API's
#: `progress` is the CLI's default (on unless -q or --json).
API_ONLY = {"arch_files", "progress"}


@pytest.mark.parametrize(
    "command,function",
    [("convert", "convert"), ("inspect", "inspect"), ("verify", "verify"), ("push", "push")],
)
def test_cli_options_are_the_api_keyword_arguments(command: str, function: str) -> None:
    """One option set: every CLI option is the API keyword of the same name, with the same choices and
    default (`jobs`: "auto" on the command line, one process from Python)."""
    from fp8fix.cli import main

    cli = {p.name: p for p in main.commands[command].params}  # type: ignore[attr-defined]
    api = pyinspect.signature(getattr(fp8fix, function)).parameters
    cli_names = set(cli) - (CLI_ONLY if command != "push" else {"as_json", "quiet"})
    cli_names -= STREAMED if command == "convert" else set()
    api_names = set(api) - API_ONLY
    assert cli_names == api_names, cli_names ^ api_names
    for name, param in cli.items():
        if name not in api or name in ("source", "output", "registry", "repo_id", "folder", "jobs"):
            continue
        default = api[name].default
        cli_default = param.default
        if cli_default is None or type(cli_default).__name__ == "Sentinel":  # click's "no default given"
            cli_default = False if getattr(param, "is_flag", False) else None
        assert cli_default == default, name
        if isinstance(param.type, click.Choice):  # the same vocabulary (fp8fix/vocab.py) on both sides
            vocabulary = getattr(vocab, str(api[name].annotation).split(" |")[0])
            assert set(param.type.choices) == set(typing.get_args(vocabulary)), name


def test_convert_to_hub_takes_the_cli_options_of_a_streamed_convert() -> None:
    """`convert SOURCE --push-to-hub DEST` with no OUTPUT is `convert_to_hub(SOURCE, DEST)`: its keywords
    are the CLI's convert options, less those that need OUTPUT (refused there when streaming)."""
    from fp8fix.cli import main

    cli = {p.name for p in main.commands["convert"].params}  # type: ignore[attr-defined]
    api = set(pyinspect.signature(fp8fix.convert_to_hub).parameters) - API_ONLY
    needs_output = {"output", "verify", "dry_run", "overwrite", "jobs", "commit_size", "as_json", "quiet", "verbose"}
    assert api == (cli - needs_output - {"push_to_hub"}) | {"dest"}, api ^ ((cli - needs_output) | {"dest"})


JOBS_AFTER_TORCH = """
import sys
import fp8fix
src, out = sys.argv[1], sys.argv[2]
before = fp8fix.convert(src, out + "-a", to="e4m3fnuz", jobs=2)
import torch
after = [fp8fix.convert(src, out + f"-{i}", to="e4m3fnuz", jobs=2) for i in "bc"]
print(before.processes, [r.processes for r in after], after[0].to_json()["processes"])
"""


def test_jobs_after_torch_is_imported_says_it_ran_one_process(tmp_path: Path) -> None:
    """convert(jobs=2) from Python: two processes; after `import torch`, one, a RuntimeWarning once per
    calling line, and the result says how many ran (issue 27: it was silent)."""
    src = build(tmp_path / "src", phi3(), files=2)
    proc = subprocess.run(
        [sys.executable, "-c", JOBS_AFTER_TORCH, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "[1,", "1]", "1"]
    assert proc.stderr.count("RuntimeWarning") == 1 and "torch is imported in this process" in proc.stderr

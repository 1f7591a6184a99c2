"""Planning at scale (issue 30): each shard's outputs planned once per command, the loader facts derived once
per checkpoint described, scales read a shard at a time, and the faster paths answering what the slow ones do.

Counted, not timed (scripts/bench_tensor_count.py times them): a wrapper around the planner's per-shard step
and the fact derivation records every call while the real command runs on a real checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import fp8fix
from fp8fix.io.source_files import SourceFiles
from fp8fix.vocab import LAYOUTS, OUTPUT_FORMATS
from tests.builders import block_fp8_checkpoint, build, llama, phi3
from tests.conftest import run_cli


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter[str]]:
    """Every shard the planner plans (by file name) and every checkpoint whose loader facts are derived
    (by its root and whether it is SOURCE or a planned output)."""
    import fp8fix.plan.planner as planner
    import fp8fix.verdicts as verdicts

    seen: dict[str, Counter[str]] = {"shards": Counter(), "facts": Counter(), "tensors": Counter()}
    plan_shard, derive = planner.plan_shard, verdicts._derive_facts

    def counted_shard(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["shards"][name] += 1
        seen["tensors"][name] += len(args[1])  # (metadata, tensors, replacements)
        return plan_shard(name, *args, **kwargs)

    def counted_facts(model):  # type: ignore[no-untyped-def]
        ckpt = model.checkpoint
        seen["facts"]["source" if ckpt.has_data else "planned output"] += 1
        return derive(model)

    monkeypatch.setattr(planner, "plan_shard", counted_shard)
    monkeypatch.setattr(verdicts, "_derive_facts", counted_facts)
    return seen


def _block_llama(root: Path) -> Path:
    """A block-FP8 Llama (DeepSeek-style `weight_scale_inv` grids), nothing fused: the shape of the 100k-tensor
    checkpoints the issue measures."""
    config = {**llama(hidden=256, heads=2, kv_heads=1, intermediate=384, layers=2).config}
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    linears = {}
    for i in range(2):
        p = f"model.layers.{i}"
        linears |= {f"{p}.self_attn.q_proj": (256, 256), f"{p}.self_attn.k_proj": (128, 256)}
        linears |= {f"{p}.self_attn.v_proj": (128, 256), f"{p}.self_attn.o_proj": (256, 256)}
        linears |= {f"{p}.mlp.gate_proj": (384, 256), f"{p}.mlp.up_proj": (384, 256), f"{p}.mlp.down_proj": (256, 384)}
    return block_fp8_checkpoint(root, config, linears)


def test_convert_plans_each_shard_once_and_derives_the_facts_once(tmp_path: Path, calls) -> None:
    """`convert` (target auto) of a block-FP8 checkpoint with nothing fused: every shard planned once (the
    candidates are judged without planning their shards), the loader facts derived once (the output keeps
    every tensor and config.json: SOURCE's verdicts are its own)."""
    src = _block_llama(tmp_path / "src")
    shards = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()
    result = fp8fix.convert(src, tmp_path / "out")
    assert result.written and result.plan.layout == "unfused"
    assert calls["shards"] == Counter(set(shards)) and len(set(shards)) == 2
    assert calls["facts"] == Counter({"source": 1})
    assert all(v.verdict == result.plan.source_loaders[k].verdict for k, v in result.plan.loaders.items())


def test_dry_run_and_inspect_plan_no_more_than_convert(tmp_path: Path, calls) -> None:
    """`convert --dry-run` plans what convert writes, once; `inspect` plans no shard at all (its layout
    finding needs the candidates' verdicts only) and derives the facts once."""
    src = _block_llama(tmp_path / "src")
    fp8fix.convert(src, tmp_path / "out", dry_run=True)
    assert set(calls["shards"].values()) == {1} and calls["facts"] == Counter({"source": 1})
    calls["shards"].clear(), calls["facts"].clear()
    report = fp8fix.inspect(src)
    assert report.convert_supported
    assert calls["shards"] == Counter() and calls["facts"] == Counter({"source": 1})


@pytest.mark.parametrize("model", ["phi3", "llama"])
def test_candidates_that_rewrite_tensors_are_planned_once_each_and_the_chosen_not_again(
    tmp_path: Path, calls, model: str
) -> None:
    """Phi-3 (fused qkv / gate_up, one scale each) and a per-tensor Llama (q / k / v scales differ: the channel
    layout keeps them exact) of two layers unlike each other (nothing to judge by class): the candidates that
    rewrite tensors are planned whole to be judged, each once; the chosen one is not planned again where it
    was planned whole, once where it was judged as a sketch; the facts are derived for SOURCE once and for
    each rewriting candidate's output once."""
    src = build(tmp_path / "src", phi3() if model == "phi3" else llama())
    found = _candidates(src)
    rewriting = len([c for c in found if not c.plan.sketch])
    assert rewriting >= 2
    calls["shards"].clear(), calls["facts"].clear()
    result = fp8fix.convert(src, tmp_path / "out", dry_run=True)
    chosen = next(c for c in found if (c.layout, c.output_format) == (result.plan.layout, result.plan.output_format))
    refused = len(OUTPUT_FORMATS) * len(LAYOUTS) - len(
        found
    )  # (layout x format tries the planner refused, some after planning)
    planned = set(calls["shards"].values())
    assert len(planned) == 1 and rewriting <= planned.pop() <= rewriting + refused + chosen.plan.sketch
    assert calls["facts"] == Counter({"source": 1, "planned output": rewriting})


def test_candidates_judged_by_class_and_only_the_chosen_planned_whole(tmp_path: Path, calls) -> None:
    """A Phi-3 of 16 layers alike: the candidates are planned on the tensors outside the layers and one layer
    of each class (fewer than half the tensors), so the whole checkpoint's tensors are planned once, for the
    chosen output; the facts are derived for SOURCE, its classes, each rewriting candidate's output and the
    chosen output once each."""
    from tests.test_layer_classes import LAYERS, layers_alike

    src = build(tmp_path / "src", replace(phi3(), layers=LAYERS))
    layers_alike(src)
    total = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    found = _candidates(src)
    rewriting = len([c for c in found if not c.plan.sketch])
    assert rewriting >= 2 and not any(c.whole for c in found)
    calls["shards"].clear(), calls["facts"].clear(), calls["tensors"].clear()
    result = fp8fix.convert(src, tmp_path / "out", dry_run=True)
    assert not result.plan.sketch and sum(len(s.tensors) for s in result.plan.shards) >= total
    reduced = (sum(calls["tensors"].values()) - total) / rewriting  # tensors planned per candidate judged
    assert 0 < reduced < total / 2
    assert calls["facts"] == Counter({"source": 2, "planned output": rewriting + 1})


def _candidates(src: Path):  # type: ignore[no-untyped-def]
    from fp8fix.io.checkpoint import open_checkpoint
    from fp8fix.model import describe_checkpoint
    from fp8fix.plan.targets import candidates
    from fp8fix.registry.architectures import Registry

    return candidates(describe_checkpoint(open_checkpoint(src), Registry.builtin()))


def test_a_tensor_stored_in_two_shards_names_both_files(tmp_path: Path) -> None:
    """The duplicate check (now one dict update per shard) still names the tensor and the two files: a third
    shard the index lists holds a copy of the final norm, which an earlier shard holds."""
    import torch
    from safetensors.torch import save_file

    src = build(tmp_path / "src", llama())
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    holder = index["weight_map"]["model.norm.weight"]
    extra = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16), "extra.weight": torch.ones(2)}
    save_file(extra, str(src / "model-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"]["extra.weight"] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))
    result = run_cli("inspect", src)
    assert result.exit_code != 0
    assert f"tensor 'model.norm.weight' is stored twice: in {holder} and model-extra.safetensors" in result.output


def test_prefetched_reads_answer_what_direct_reads_do(tmp_path: Path) -> None:
    """`SourceFiles.prefetch` then `read`: byte for byte what a direct read gives, for ranges inside the
    prefetched spans, across their ends and outside them, and for another file."""
    data = bytes(range(256)) * 40_000  # 10 MB
    path, other = tmp_path / "a.bin", tmp_path / "b.bin"
    path.write_bytes(data)
    other.write_bytes(data[::-1])
    ranges = [(100, 104), (200, 232), (3_000_000, 3_000_016), (9_000_000, 9_000_400)]
    with SourceFiles() as files:
        files.prefetch(path, ranges)
        for start, end in [*ranges, (150, 210), (3_000_008, 3_100_000), (5_000_000, 5_000_004), (0, 8)]:
            assert files.read(path, start, end) == data[start:end]
        assert files.read(other, 100, 104) == data[::-1][100:104]


def test_a_bad_scale_among_many_in_a_shard_is_named(tmp_path: Path) -> None:
    """Scales are checked a shard at a time (one read per shard): a zero or NaN scale among them is still
    refused, named by tensor."""
    from tests.conftest import patch_bytes

    for value, shown in ((0.0, "holds 0.0"), (math.nan, "holds nan")):
        src = build(tmp_path / f"src-{shown[6:]}", llama())
        patch_bytes(src, "model.layers.1.mlp.down_proj.weight_scale", dict(enumerate(struct.pack("<f", value))))
        result = run_cli("convert", src, tmp_path / f"out-{shown[6:]}")
        assert result.exit_code != 0
        assert "scale 'model.layers.1.mlp.down_proj.weight_scale'" in result.output and shown in result.output


def test_json_output_is_indented_json_and_fast_for_long_lists() -> None:
    """`--json` text: what `json.dumps(indent=2)` prints for small payloads; long top-level lists one item per
    line (the C encoder); a figure that is not finite is null either way."""
    from fp8fix.cli_output import LONG_LIST, json_text

    small = {"schema_version": 3, "a": [1, {"b": [None, "é"]}], "c": {"d": {}}}
    assert json_text(small) == json.dumps(small, indent=2)
    big = {"modules": [{"module": f"m{i}", "rows": [i, 2]} for i in range(LONG_LIST + 1)], "x": {"y": 1}}
    text = json_text(big)
    assert json.loads(text) == big and text.count("\n") == LONG_LIST + 1 + 6
    with pytest.raises(ValueError):  # echo_json then prints null for it (tests/test_cli_contract.py)
        json_text({"figures": [math.inf]})


def test_the_collector_is_paused_while_planning_and_running_while_writing(tmp_path: Path, monkeypatch) -> None:
    """Python's cyclic collector is off while headers are planned (40% of the CPU at 100k tensors) and on while
    shards are written (a long conversion's memory never waits on it); the caller's setting is kept."""
    import gc

    import fp8fix.io.writer as writer
    import fp8fix.plan.planner as planner

    states: dict[str, set[bool]] = {"planning": set(), "writing": set()}
    plan_shard, write_shard = planner.plan_shard, writer._write_shard

    def planning(*args, **kwargs):  # type: ignore[no-untyped-def]
        states["planning"].add(gc.isenabled())
        return plan_shard(*args, **kwargs)

    def writing(*args, **kwargs):  # type: ignore[no-untyped-def]
        states["writing"].add(gc.isenabled())
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_shard", planning)
    monkeypatch.setattr(writer, "_write_shard", writing)
    src = build(tmp_path / "src", llama())
    assert gc.isenabled()
    fp8fix.convert(src, tmp_path / "out")
    assert states == {"planning": {False}, "writing": {True}} and gc.isenabled()
    gc.disable()
    try:
        fp8fix.convert(src, tmp_path / "out2")
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()


def test_windows_reuse_a_buffer_and_a_nested_loop_reads_into_its_own(tmp_path: Path) -> None:
    """`SourceFiles.windows`: a later loop of the same window size reads into the buffer the last one used
    (no fresh mapping to fault in per tensor); a loop inside another gets its own buffer, so the outer
    window still holds its bytes after the inner loop ran; every window is the file's bytes."""
    data = bytes(range(256)) * 64  # 16 KB
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    with SourceFiles() as files:
        first = [(bytes(buf[:n]), off, buf) for buf, off, n in files.windows(path, 0, 4096, 1024)]
        again = [(bytes(buf[:n]), off, buf) for buf, off, n in files.windows(path, 4096, 8192, 1024)]
        assert [d for d, _, _ in first + again] == [data[o : o + 1024] for _, o, _ in first + again]
        assert all(b is first[0][2] for _, _, b in first + again)  # one buffer for both loops (held: not freed)
        for outer, off, n in files.windows(path, 8192, 12288, 1024):
            inner = [bytes(buf[:m]) for buf, _, m in files.windows(path, 0, 2048, 1024)]
            assert inner == [data[:1024], data[1024:2048]]
            assert bytes(outer[:n]) == data[off : off + n]  # untouched by the inner loop
        odd = [bytes(buf[:n]) for buf, _, n in files.windows(path, 100, 700, 1024)]  # another size: its own
        assert odd == [data[100:700]]


def test_what_every_candidate_asks_of_source_is_worked_out_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--target auto` of a per-tensor Llama plans several compressed-tensors candidates: SOURCE's name lists
    matched against its tensor names (for compressed-tensors' `ignore`) and its plain linear modules (a pass
    over every tensor name) are worked out once for each checkpoint described, not once per candidate."""
    import fp8fix.model as model_module
    import fp8fix.plan.scheme as scheme

    src = build(tmp_path / "src", llama())
    # by the tensors' dict: SOURCE's is one object, each output's another (held, so no id is used twice)
    matched: Counter[int] = Counter()
    linears: Counter[int] = Counter()
    held: list[object] = []
    named, plain = scheme.named_modules, model_module.unquantized_linears

    def counted_named(model, entries, grammar):  # type: ignore[no-untyped-def]
        held.append(model.checkpoint.tensors)
        matched[id(model.checkpoint.tensors)] += 1
        return named(model, entries, grammar)

    def counted_plain(tensors):  # type: ignore[no-untyped-def]
        held.append(tensors)
        linears[id(tensors)] += 1
        return plain(tensors)

    monkeypatch.setattr(scheme, "named_modules", counted_named)
    monkeypatch.setattr(model_module, "unquantized_linears", counted_plain)
    found = _candidates(src)
    assert len([c for c in found if c.output_format == "compressed-tensors"]) >= 2
    matched.clear(), linears.clear()
    fp8fix.convert(src, tmp_path / "out", dry_run=True)
    assert matched and set(matched.values()) == {1}
    assert linears and set(linears.values()) == {1}

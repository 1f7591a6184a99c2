"""Issue 25: verify as an independent witness of what convert wrote beside the weights.

verify no longer asks convert's config code what config.json should be; it reads both configs
and checks what loaders take from them. Each test here makes one faithful conversion, changes
one thing a loader would read differently (or a file fp8fix writes that verify never looked
at: shard `__metadata__`, index keys), and expects verify to name it. The changes are made
by hand from the formats' own definitions, never with fp8fix's code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.builders import build, llama, phi3
from tests.conftest import load_tensors, run_cli

INDEX = "model.safetensors.index.json"


def convert(tmp_path: Path, model: Any = phi3, *options: str, **build_options: Any) -> tuple[Path, Path]:
    src = build(tmp_path / "src", model(), **build_options)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "-q", *options)
    assert result.exit_code == 0, result.output
    return src, out


def edit(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def problems(src: Path, out: Path) -> str:
    result = run_cli("verify", src, out)
    assert result.exit_code == 1, result.output
    return result.output


def _other(qc: dict[str, Any]) -> str:
    """The weight strategy the config does not say (tensor <-> channel)."""
    return {"tensor": "channel", "channel": "tensor"}[qc["config_groups"]["group_0"]["weights"]["strategy"]]


def quantization(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_a_faithful_unfused_conversion_passes(tmp_path: Path) -> None:
    src, out = convert(tmp_path, phi3, "--layout", "unfused", "--format", "keep")
    assert run_cli("verify", src, out, "-q").exit_code == 0


def test_a_renamed_list_that_names_more_modules_is_caught(tmp_path: Path) -> None:
    """Text may differ after a rename; meaning may not: an entry that also names q_proj is caught."""
    src, out = convert(tmp_path, phi3, "--layout", "unfused", "--format", "keep")
    edit(
        out / "config.json", lambda c: c["quantization_config"]["ignored_layers"].append("model.layers.0.mlp.down_proj")
    )
    assert "ignored_layers: names other modules" in problems(src, out)
    assert "also model.layers.0.mlp.down_proj" in problems(src, out)


def test_a_renamed_list_that_forgets_a_shard_is_caught(tmp_path: Path) -> None:
    src, out = convert(
        tmp_path,
        phi3,
        "--layout",
        "unfused",
        "--format",
        "keep",
        ignore=["lm_head", "model.layers.1.self_attn.qkv_proj"],
    )
    named = quantization(out)["ignored_layers"]
    assert "model.layers.1.self_attn.k_proj" in named  # the rename, as vLLM reads shard names
    edit(
        out / "config.json",
        lambda c: c["quantization_config"].__setitem__(
            "ignored_layers", [e for e in named if e != "model.layers.1.self_attn.k_proj"]
        ),
    )
    assert "not model.layers.1.self_attn.k_proj" in problems(src, out)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy=_other(q)), "weight scales"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].__setitem__("dynamic", True), "static"),
        (lambda q: q.pop("kv_cache_scheme"), "kv_cache_scheme missing"),
        (lambda q: q["ignore"].append("model.layers.0.mlp.down_proj"), "does not skip the FP8 modules"),
        (lambda q: q.__setitem__("ignore", []), "targets 1 Linear module(s) OUTPUT holds no FP8 weight"),
        (lambda q: q["config_groups"]["group_0"].__setitem__("targets", ["Attention"]), "targeting Linear"),
    ],
    ids=["strategy", "dynamic-input", "no-kv-scheme", "ignores-fp8", "quantizes-lm-head", "targets"],
)
def test_a_compressed_tensors_config_is_read_against_the_tensors(
    tmp_path: Path, change: Callable[[Any], Any], said: str
) -> None:
    """AutoFP8 written as compressed-tensors: what the config says is checked against OUTPUT's tensors."""
    src, out = convert(tmp_path, llama, "--format", "compressed-tensors")
    assert quantization(out)["ignore"] == ["lm_head"]
    edit(out / "config.json", lambda c: change(c["quantization_config"]))
    assert said in problems(src, out)


def test_a_model_key_outside_the_quantization_config_is_caught(tmp_path: Path) -> None:
    src, out = convert(tmp_path, llama)
    edit(out / "config.json", lambda c: c.update(rope_theta=1.0))
    assert "config.json: differs from SOURCE's: rope_theta is 1.0" in problems(src, out)


def test_shard_metadata_is_checked(tmp_path: Path, rewrite_header: Callable[..., None]) -> None:
    """Extra `__metadata__` keys, or an `fp8fix_encoding` that is not the weights' encoding, were never read."""
    src, out = convert(tmp_path, llama, "--to", "e4m3fnuz")
    shard = sorted(out.glob("*.safetensors"))[0]
    rewrite_header(shard, lambda h: h["__metadata__"].update(fp8fix_encoding="e4m3fn"))
    assert "__metadata__ differs" in problems(src, out)
    rewrite_header(shard, lambda h: h["__metadata__"].update(fp8fix_encoding="e4m3fnuz", note="added"))
    assert "__metadata__ differs from SOURCE's and the encoding's in note" in problems(src, out)


def test_index_keys_are_checked(tmp_path: Path) -> None:
    src, out = convert(tmp_path, llama)
    edit(out / INDEX, lambda i: i.update(extra={"a": 1}))
    assert f"{INDEX}: keys ['extra'] differ from SOURCE's" in problems(src, out)
    edit(out / INDEX, lambda i: (i.pop("extra"), i["metadata"].update(note="x")))
    assert "metadata differs from SOURCE's beyond total_size" in problems(src, out)


# --- the three properties verify must establish itself (issue 25: changing verify's code for them
# --- made no test fail). Each OUTPUT is tampered with by torch's own float8 casts, never fp8fix's code.


def _replace(folder: Path, tensors: dict[str, Any]) -> None:
    """Put `tensors` into whichever OUTPUT shard holds each (same name), keeping the shard's metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("*.safetensors")):
        held = load_file(shard)
        if not set(tensors) & set(held):
            continue
        with safe_open(shard, framework="pt") as f:
            metadata = f.metadata()
        held.update({k: v for k, v in tensors.items() if k in held})
        save_file(held, shard, metadata=metadata)


def test_codes_clipped_at_the_output_scale_are_caught(tmp_path: Path) -> None:
    """(a) fn -> fnuz with the scale left as it was: every code above 240 (e4m3fnuz's largest) is clipped.
    The values of the other codes are exact, so only the overflow check can see it."""
    src, out = convert(tmp_path, llama, "--layout", "unfused", "--format", "keep", "--to", "e4m3fnuz")
    source = load_tensors(src)
    name = "model.layers.0.self_attn.q_proj"
    codes = source[f"{name}.weight"].float()
    assert codes.abs().max() > 240  # the absmax export reaches 448
    clipped = codes.clamp(-240, 240).to(torch.float8_e4m3fnuz)
    _replace(out, {f"{name}.weight": clipped, f"{name}.weight_scale": source[f"{name}.weight_scale"]})
    said = problems(src, out)
    assert f"'{name}.weight'" in said and "clipped" in said


def test_a_kept_block_whose_scale_changed_by_three_is_caught(tmp_path: Path) -> None:
    """(b) A block split keeps every block that lies in one shard exactly: its scale may only change by a
    power of two. A block requantized to three times its scale (codes within half a step, so a value check
    alone would pass it as requantized) must be caught by that rule."""
    src = build(tmp_path / "src", phi3(), fmt="block-fp8")
    qkv = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    grid = load_tensors(src)[qkv]
    _replace(src, {qkv: torch.exp2(torch.log2(grid).round())})  # scales of one mantissa bit: x 3 is exact
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "-q", "--layout", "unfused", "--format", "keep").exit_code == 0
    o = load_tensors(out)
    changed = {}
    for shard in ("q_proj", "k_proj", "v_proj"):  # all of qkv_proj's blocks: one ratio, 3, for the module
        name = f"model.layers.0.self_attn.{shard}"
        codes, grid = o[f"{name}.weight"].float(), o[f"{name}.weight_scale_inv"].float()
        rows, cols = codes.shape

        def per_element(g: Any, rows: int = rows, cols: int = cols) -> Any:
            return g.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]

        tripled = grid * 3
        changed[f"{name}.weight"] = (codes * per_element(grid) / per_element(tripled)).to(torch.float8_e4m3fn)
        changed[f"{name}.weight_scale_inv"] = tripled
    _replace(out, changed)
    said = problems(src, out)
    assert "times the power of two" in said and "self_attn.q_proj" in said


def test_fnuz_steps_below_the_smallest_normal_are_e4m3fnuz_steps(tmp_path: Path) -> None:
    """(c) Requantized e4m3fnuz codes are checked within half an e4m3fnuz step. Below e4m3fnuz's smallest
    normal (2^-7, one exponent below e4m3fn's 2^-6) the step is 2^-10: a code one step off, toward the true
    value, is more than half a step off and must be caught (with e4m3fn's 2^-6 it would pass as 0.5 step).
    The reference is torch's float8_e4m3fnuz, not fp8fix's step function."""

    def model() -> Any:  # big enough that some codes fall below e4m3fnuz's smallest normal
        return phi3(hidden=512, heads=8, kv_heads=4, intermediate=64, layers=1)

    src, out = convert(tmp_path, model, "--layout", "fused", "--format", "keep", "--to", "e4m3fnuz", scale="shard")
    s, o = load_tensors(src), load_tensors(out)
    name = "model.layers.0.self_attn.qkv_proj"
    src_codes, src_scale = s[f"{name}.weight"].double(), s[f"{name}.weight_scale"].double()
    rows = [512, 256, 256]  # q: 8 heads of 64 rows; k, v: 4 each
    row_scales = torch.cat([src_scale[i].repeat(n) for i, n in enumerate(rows)]).reshape(-1, 1)
    out_scale = o[f"{name}.weight_scale"].double().max()
    target = src_codes * row_scales / out_scale  # the true value in e4m3fnuz code units
    got = o[f"{name}.weight"]
    assert torch.equal(got, target.float().to(torch.float8_e4m3fnuz))  # fp8fix's codes: torch's RNE
    raw = got.view(torch.uint8).clone()
    value = got.double()
    error = (value - target).abs() / 2.0**-10
    small = (target.abs() < 2.0**-7) & (value != 0) & (error < 0.4) & (raw & 0x7F > 1)
    assert small.any(), "no e4m3fnuz subnormal code to test with"
    r, c = small.nonzero()[0].tolist()
    toward = 1 if (target[r, c] > value[r, c]) == (target[r, c] > 0) else -1  # one code toward the true value
    if value[r, c] == target[r, c]:
        toward = -1
    raw[r, c] = int(raw[r, c]) + toward
    bumped = raw.view(torch.float8_e4m3fnuz)
    assert abs(float(bumped[r, c].double() - value[r, c])) == 2.0**-10  # the neighbouring code, one step
    _replace(out, {f"{name}.weight": bumped})
    assert f"'{name}.weight' (from '{name}.weight') row {r} column {c}" in problems(src, out)


@pytest.mark.parametrize(
    "old, new, said",
    [
        ("- fp8fix\n", "", "no `fp8fix` tag"),
        ("- Layout: **unfused**", "- Layout: **per-shard**", "says per-shard, but OUTPUT holds SOURCE's fused"),
        ("- e4m3fnuz\n", "", "no `e4m3fnuz` tag"),
        ("- FP8 encoding: e4m3fn -> e4m3fnuz", "- FP8: e4m3fn", "does not say the FP8 weights changed encoding"),
        ("Converted from `", "Made from `", "does not say what it was converted from"),
    ],
    ids=["tag", "layout", "fnuz-tag", "encoding", "converted-from"],
)
def test_the_model_card_facts_are_checked(tmp_path: Path, old: str, new: str, said: str) -> None:
    """The card was never read by verify: its layout, encoding and tags are facts a reader acts on."""
    src, out = convert(tmp_path, phi3, "--layout", "unfused", "--format", "keep", "--to", "e4m3fnuz")
    card = (out / "README.md").read_text()
    assert old in card
    (out / "README.md").write_text(card.replace(old, new, 1))
    assert f"README.md: {said}" in problems(src, out)


# --- config.json sizes against the tensors (verification/sizes.py) ---------------------------------------
# Shapes as the published checkpoints hold them (config.json and model.safetensors.index.json of each repo),
# a few tensors each; the expected keys are read off those files, not computed by fp8fix.

LLAMA_31_8B = {
    "config": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
    },
    "shapes": {
        "model.embed_tokens.weight": (128256, 4096),
        "model.layers.0.self_attn.q_proj.weight": (4096, 4096),
        "model.layers.0.self_attn.k_proj.weight": (1024, 4096),
        "model.layers.31.self_attn.v_proj.weight": (1024, 4096),
        "model.layers.0.self_attn.o_proj.weight": (4096, 4096),
        "model.layers.0.mlp.gate_proj.weight": (14336, 4096),
        "model.layers.0.mlp.up_proj.weight": (14336, 4096),
        "model.layers.0.mlp.down_proj.weight": (4096, 14336),
    },
}
PHI_3_MINI = {
    "config": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "vocab_size": 32064,
    },
    "shapes": {
        "model.embed_tokens.weight": (32064, 3072),
        "model.layers.0.self_attn.qkv_proj.weight": (9216, 3072),
        "model.layers.0.self_attn.o_proj.weight": (3072, 3072),
        "model.layers.31.mlp.gate_up_proj.weight": (16384, 3072),
        "model.layers.0.mlp.down_proj.weight": (3072, 8192),
    },
}
QWEN3_30B_A3B = {  # head_dim 128 with hidden 2048 / 32 heads = 64: head_dim is read, not derived
    "config": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_hidden_layers": 48,
        "vocab_size": 151936,
    },
    "shapes": {
        "model.embed_tokens.weight": (151936, 2048),
        "model.layers.47.self_attn.q_proj.weight": (4096, 2048),
        "model.layers.0.self_attn.k_proj.weight": (512, 2048),
        "model.layers.0.self_attn.o_proj.weight": (2048, 4096),
        "model.layers.0.mlp.experts.127.gate_proj.weight": (768, 2048),
        "model.layers.0.mlp.experts.0.down_proj.weight": (2048, 768),
    },
}
DEEPSEEK_V3 = {  # MLA attention (no rule); layer 61 is the MTP layer, outside num_hidden_layers
    "config": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "vocab_size": 129280,
    },
    "shapes": {
        "model.embed_tokens.weight": (129280, 7168),
        "model.layers.0.self_attn.q_b_proj.weight": (24576, 1536),
        "model.layers.0.mlp.gate_proj.weight": (18432, 7168),
        "model.layers.3.mlp.experts.255.up_proj.weight": (2048, 7168),
        "model.layers.3.mlp.shared_experts.down_proj.weight": (7168, 2048),
        "model.layers.61.mlp.experts.0.down_proj.weight": (7168, 2048),
    },
}


ATTENTION = "num_attention_heads / num_key_value_heads x head_dim"


def _with(model: dict[str, Any], **config: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    return {**model["config"], **config}, model["shapes"]


@pytest.mark.parametrize(
    "case,keys",
    [
        (_with(LLAMA_31_8B), set()),
        (_with(PHI_3_MINI), set()),
        (_with(QWEN3_30B_A3B), set()),
        (_with(DEEPSEEK_V3), {"num_hidden_layers"}),
        (_with(LLAMA_31_8B, intermediate_size=14464), {"intermediate_size"}),
        (_with(LLAMA_31_8B, num_key_value_heads=16), {ATTENTION}),
        (
            _with(LLAMA_31_8B, vocab_size=128000, hidden_size=4608),
            {"vocab_size", "hidden_size", ATTENTION},
        ),
        (_with(LLAMA_31_8B, num_hidden_layers=31), {"num_hidden_layers"}),
        (_with(PHI_3_MINI, intermediate_size=8320), {"intermediate_size"}),
        (_with(PHI_3_MINI, num_key_value_heads=8), {ATTENTION}),  # qkv rows: (32 + 2 x 8) x 96
        (_with(QWEN3_30B_A3B, moe_intermediate_size=1024), {"moe_intermediate_size"}),
        (_with(QWEN3_30B_A3B, head_dim=None), {ATTENTION}),  # 2048 / 32 = 64
        (_with(DEEPSEEK_V3, moe_intermediate_size=2304, num_hidden_layers=62), {"moe_intermediate_size"}),
    ],
)
def test_config_sizes_read_against_published_shapes(
    case: tuple[dict[str, Any], dict[str, tuple[int, ...]]], keys: set[str]
) -> None:
    from fp8fix.verification.sizes import size_disagreements

    config, shapes = case
    assert set(size_disagreements(config, shapes)) == keys


def test_verify_catches_a_padded_size_under_a_key_the_model_does_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry bug shared by convert and verify's padding check (experts' intermediate under the dense
    MLP's key) is repeated by that check, not by the sizes one: convert pads Qwen3-MoE's experts for TP 4
    and writes `intermediate_size` (no dense MLP reads it); moe_intermediate_size stays 384 for 512 rows."""
    import fp8fix.registry.parallel as parallel
    from tests.test_parallel import qwen3_moe

    wrong = tuple(
        (p, "intermediate_size" if key == "moe_intermediate_size" else key) for p, key in parallel.PADDED_SIZES
    )
    monkeypatch.setattr(parallel, "PADDED_SIZES", wrong)
    src = qwen3_moe(tmp_path / "src", moe_intermediate=384)
    edit(src / "config.json", lambda c: c.update(intermediate_size=384))  # what convert checks the experts by
    result = run_cli("convert", src, tmp_path / "out", "--tp", "4", "-q", check_output=False)
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["moe_intermediate_size"] == 384
    assert load_tensors(tmp_path / "out")["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0] == 512
    report = json.loads(run_cli("verify", src, tmp_path / "out", "--json").output)
    (line,) = [p for p in report["problems"] if "moe_intermediate_size" in p]
    assert "mlp.experts.0." in line and "384" in line and "512" in line
    assert not report["ok"]


# Gaps a random sample of verify's mutants found (docs/development.md): each test fails with its mutant.


@pytest.mark.parametrize("static", [True, False])
def test_the_activation_scheme_must_match_the_input_scales_output_holds(tmp_path: Path, static: bool) -> None:
    """compressed-tensors OUTPUT: input activations static exactly when OUTPUT holds input scales; the problem
    says which (`dynamic: OUTPUT holds no input scales`, word for word: a mutant changed its case)."""
    src = build(tmp_path / "src", phi3(), static_input=static)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "compressed-tensors").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = static
    (out / "config.json").write_text(json.dumps(config))
    result = run_cli("verify", src, out)
    expected = "static: OUTPUT holds input scales" if static else "dynamic: OUTPUT holds no input scales"
    assert result.exit_code == 1 and f"config.json: input activations must be {expected}" in result.output


def test_legacy_names_of_an_unfused_module_are_verified_under_their_new_names(tmp_path: Path) -> None:
    """AutoFP8's legacy `act_scale` of a fused module, unfused: OUTPUT holds q/k/v `input_scale`s, which
    verify must map to the source's `act_scale` (a mutant kept the leading dot of the new name)."""
    src = build(tmp_path / "src", phi3(), fmt="fp8-legacy")
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--format", "compressed-tensors", "--layout", "unfused", "--verify")
    assert result.exit_code == 0, result.output
    assert "model.layers.0.self_attn.q_proj.input_scale" in load_tensors(out)
    assert run_cli("verify", src, out).exit_code == 0


def test_index_metadata_beyond_total_size_must_be_sources(tmp_path: Path) -> None:
    """OUTPUT's index keeps SOURCE's metadata but for total_size: an entry SOURCE has and OUTPUT lost is
    a problem (a mutant compared OUTPUT's metadata with nothing)."""
    src = build(tmp_path / "src", phi3())
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"] = {**(index.get("metadata") or {}), "format": "pt"}
    index_path.write_text(json.dumps(index))
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep").exit_code == 0
    assert run_cli("verify", src, out).exit_code == 0
    written = json.loads((out / "model.safetensors.index.json").read_text())
    del written["metadata"]["format"]
    (out / "model.safetensors.index.json").write_text(json.dumps(written))
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "metadata differs from SOURCE's beyond total_size" in result.output


def test_a_config_key_that_is_null_in_source_and_absent_in_output_is_a_difference(tmp_path: Path) -> None:
    """`"rope_scaling": null` and no rope_scaling at all are different configs (a mutant took None for absent)."""
    src = build(tmp_path / "src", phi3())
    config = json.loads((src / "config.json").read_text())
    config["rope_scaling"] = None
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep").exit_code == 0
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] is None
    del written["rope_scaling"]
    (out / "config.json").write_text(json.dumps(written))
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "rope_scaling is absent; expected None" in result.output

"""`convert --to bf16` / `--to float16` (issue 28): every FP8 weight of every format, scale style and
architecture shape written as its code times its scale, rounded once, checked against torch: each SOURCE
weight dequantized here in float64 from the files and the builder's own description of the rows (not fp8fix's
reading of them), then rounded to nearest even at the output's precision with torch.frexp / torch.round (not
fp8fix's bit arithmetic). Nothing of the quantization is left (no FP8 tensor, no scale, no quantization
config, no ModelOpt side file), every other tensor is SOURCE's bytes, and verify catches what is off.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.builders import FORMATS, Model, build, glm, llama, mimo_v2, phi3
from tests.conftest import load_tensors, run_cli
from tests.test_experts import build_llama4
from tests.test_registry import MODELS

#: Every format the builders write, with each scale style it has.
STYLES = {
    "fp8": ("tensor", "shard", "channel"),
    "fp8-legacy": ("tensor", "shard"),
    "fp8-amd-kv": ("tensor",),
    "compressed-tensors": ("tensor", "shard", "channel"),
    "block-fp8": ("block",),
    "block-fp8-e8m0": ("block",),
    "block-fp8-bf16": ("block",),
    "ct-block": ("block",),
    "modelopt": ("tensor", "shard"),
    "quark": ("tensor", "shard", "channel"),
    "fbgemm": ("channel",),
}
BASIC: dict[str, Model] = {"phi3": phi3(), "glm": glm(), "llama": llama()}
SHAPES: dict[str, Model] = {**BASIC, **{f"registry-{n}": m for n, (m, _) in MODELS.items()}}
SOURCES = [
    (shape, fmt, scale)
    for shape, model in SHAPES.items()
    for fmt, scales in STYLES.items()
    for scale in scales
    if not (scale == "shard" and not model.fused)
]
SCALE_SUFFIXES = ("_scale", "_scale_inv", ".k_scale", ".v_scale", ".kv_scale", ".output_scale")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def round_once(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values rounded to nearest even at BF16's 8 or F16's 11 significant bits (F16's subnormals:
    to multiples of 2^-24), as float64: torch.round rounds halves to even."""
    bits = 8 if dtype == torch.bfloat16 else 11
    mantissa, exponent = torch.frexp(exact)
    normal = torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)
    if dtype == torch.float16:
        return torch.where(exact.abs() < 2.0**-14, torch.round(exact * 2.0**24) / 2.0**24, normal)
    return normal


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def exact_values(folder: Path, model: Model | None, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Every FP8 weight of `folder` times its scale, in float64, by tensor name: the scale expanded from the
    scale tensor's shape and the builder's rows (per shard: `model.fused`'s segments in storage order)."""
    tensors = tensors_of(folder)
    out = {}
    for name, w in tensors.items():
        if w.dtype not in FP8_DTYPES:
            continue
        stem = name.removesuffix(".weight")
        scale = next(
            tensors[n] for n in (f"{stem}.weight_scale", f"{stem}.weight_scale_inv", f"{stem}_scale") if n in tensors
        ).double()
        codes = w.double()
        if w.dim() == 3:  # stacked experts [E, in, out]: per tensor, per expert, per expert and shard, per column
            experts, _, cols = w.shape
            grid = scale.reshape(experts, -1) if scale.numel() > 1 else scale.reshape(1, 1)
            if grid.shape[1] not in (1, cols):  # one per shard of equal widths
                grid = grid.repeat_interleave(cols // grid.shape[1], dim=1)
            out[name] = codes * grid[:, None, :]
            continue
        rows, cols = w.shape
        if scale.numel() == 1:
            expanded = scale.reshape(1, 1)
        elif scale.dim() == 2 and scale.shape[1] > 1:  # a block grid
            assert block is not None
            expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        elif scale.numel() == rows:
            expanded = scale.reshape(rows, 1)
        else:  # one per fused shard
            assert model is not None
            fused = next(f for f in model.fused if stem.endswith(f.suffix))
            per_row = [scale[i].item() for i, n in fused.segments() for _ in range(n)]
            expanded = torch.tensor(per_row, dtype=torch.float64).reshape(rows, 1)
        out[name] = codes * expanded
    return out


def convert(src: Path, out: Path, *args: str) -> dict:
    result = run_cli("convert", src, out, *args, "--verify", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def tampered(out: Path, bad: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of the one-shard OUTPUT `out` at `bad` whose weights are `tensors` (its other files as they are)."""
    from safetensors.torch import save_file

    bad.mkdir()
    for f in out.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(bad / "model.safetensors"), {"format": "pt"})
    return bad


def check_plain_output(src: Path, out: Path, model: Model | None, block: tuple[int, int] | None, dtype: torch.dtype):
    """OUTPUT holds every FP8 weight of SOURCE rounded once to `dtype`, nothing of the quantization, and
    every other tensor as SOURCE has it."""
    expected = exact_values(src, model, block)
    source, output = tensors_of(src), tensors_of(out)
    assert expected, "no FP8 weight in SOURCE"
    for name, exact in expected.items():
        got = output[name]
        assert got.dtype == dtype and got.shape == exact.shape, (name, got.dtype, got.shape)
        assert torch.equal(got.double(), round_once(exact, dtype)), name
    dropped = {n for n in source if n.endswith(SCALE_SUFFIXES)}
    assert set(output) == set(source) - dropped
    for name in set(output) - set(expected):
        assert output[name].dtype == source[name].dtype and torch.equal(output[name], source[name]), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "compression_config" not in config
    assert config["torch_dtype"] == {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    assert not (out / "hf_quant_config.json").exists()


@pytest.mark.parametrize("shape,fmt,scale", SOURCES)
def test_every_format_and_shape_to_bf16(tmp_path: Path, shape: str, fmt: str, scale: str) -> None:
    model = SHAPES[shape]
    src = build(tmp_path / "src", model, fmt=fmt, scale=scale)
    report = convert(src, tmp_path / "out", "--to", "bf16")
    check_plain_output(src, tmp_path / "out", model, FORMATS[fmt].block, torch.bfloat16)
    assert report["unquantized"] == "BF16" and report["verification"]["ok"]
    assert {m["dtype"] for m in report["dequantized"]} == {"BF16"}
    assert all(m["max_error_steps"] <= 0.5 for m in report["dequantized"])
    if shape in BASIC:  # architectures every loader serves: a plain model loads everywhere
        verdicts = {name: v["verdict"] for name, v in report["loaders"].items()}
        if shape == "glm":  # but SGLang, whose Transformers backend refuses GLM, plain or not (measured)
            assert verdicts.pop("SGLang 0.5.23") == "fails"
        assert set(verdicts.values()) == {"loads"}, report["loaders"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- fp8fix" in card and "- fp8\n" not in card and "- bf16" in card


@pytest.mark.parametrize("fmt,scale", [("fp8", "shard"), ("block-fp8", "block"), ("quark", "channel")])
def test_float16(tmp_path: Path, fmt: str, scale: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale)
    report = convert(src, tmp_path / "out", "--to", "float16")
    check_plain_output(src, tmp_path / "out", phi3(), FORMATS[fmt].block, torch.float16)
    # the tensors that were not FP8 stay BF16 (check_plain_output: as SOURCE has them), and a note says the
    # loaders cast them to float16 (tests/loaders/test_unquantized_loads.py: they do, with torch's rounding)
    kept = [t for t in tensors_of(src).values() if t.dtype == torch.bfloat16]
    notes = [n for n in report["notes"] if "keep their dtype" in n]
    assert kept and notes == [
        f"tensors that were not FP8 keep their dtype (BF16: {len(kept)}): loaders building the float16 model "
        "cast them to float16 at load, rounding once, as for any checkpoint"
    ], report["notes"]


@pytest.mark.parametrize("scale", ["tensor", "shard"])
def test_e4m3fnuz_sources(tmp_path: Path, scale: str) -> None:
    """An e4m3fnuz checkpoint (fp8fix's own --to e4m3fnuz output) to BF16: the same values as from SOURCE."""
    src = build(tmp_path / "src", phi3(), scale=scale)
    convert(src, tmp_path / "fnuz", "--to", "e4m3fnuz")
    convert(tmp_path / "fnuz", tmp_path / "out", "--to", "bf16")
    check_plain_output(tmp_path / "fnuz", tmp_path / "out", phi3(), None, torch.bfloat16)
    # fn -> fnuz is exact, so BF16 from either is the same bytes
    convert(src, tmp_path / "direct", "--to", "bf16")
    fnuz, direct = load_tensors(tmp_path / "out"), load_tensors(tmp_path / "direct")
    assert all(torch.equal(fnuz[n], direct[n]) for n in direct)


@pytest.mark.parametrize("scale", ["tensor", "expert", "shard", "channel"])
def test_stacked_experts(tmp_path: Path, scale: str) -> None:
    src = build_llama4(tmp_path / "src", scale)
    convert(src, tmp_path / "out", "--to", "bf16")
    check_plain_output(src, tmp_path / "out", None, None, torch.bfloat16)


def test_pre_sharded_chunks_with_their_own_block_grids(tmp_path: Path) -> None:
    """MiMo-V2.5's qkv_proj: each chunk has a block grid of its own, so block rows restart per chunk."""
    src = mimo_v2(tmp_path / "src")
    convert(src, tmp_path / "out", "--to", "bf16")
    tensors, output = tensors_of(src), tensors_of(tmp_path / "out")
    config = json.loads((src / "config.json").read_text())
    chunks = config["num_key_value_heads"]  # builders.mimo_qkv_chunks: one chunk per kv head
    for name, w in tensors.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        scale = tensors[name.removesuffix("weight") + "weight_scale_inv"].double()
        parts = [(w.double(), scale)]
        if "qkv_proj" in name:
            n = w.shape[0] // chunks
            parts = [(w.double()[c * n : (c + 1) * n], scale.chunk(chunks)[c]) for c in range(chunks)]
        exact = torch.cat(
            [c * s.repeat_interleave(128, 0)[: c.shape[0]].repeat_interleave(128, 1)[:, : c.shape[1]] for c, s in parts]
        )
        assert torch.equal(output[name].double(), round_once(exact, torch.bfloat16)), name


def test_verify_catches_what_is_off(tmp_path: Path) -> None:

    src = build(tmp_path / "src", phi3(), fmt="fp8", scale="shard", files=1)
    out = tmp_path / "out"
    convert(src, out, "--to", "bf16")
    good = load_tensors(out)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    cases = {
        "one value a BF16 step off": ({**good, name: _nudged(good[name])}, None, f"'{name}' row 0 column 0"),
        "a scale left behind": ({**good, name[:-6] + "weight_scale": torch.tensor(1.0)}, None, "must not hold"),
        "written in F32": ({**good, name: good[name].float()}, None, f"'{name}'"),
        "quantization_config kept": (good, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        "torch_dtype float16": (good, {"torch_dtype": "float16"}, "torch_dtype is 'float16'"),
    }
    config = json.loads((out / "config.json").read_text())
    for why, (tensors, edit, message) in cases.items():
        bad = tampered(out, tmp_path / why.replace(" ", "-"), tensors)
        (bad / "config.json").write_text(json.dumps({**config, **(edit or {})}))
        result = run_cli("verify", src, bad)
        assert result.exit_code == 1 and message in result.output, (why, result.output)


def _nudged(t: torch.Tensor) -> torch.Tensor:
    """`t` with its first value moved to the next BF16 value (a whole step: no rounding explains it)."""
    bits = t.view(torch.int16).clone()
    bits.view(-1)[0] += 1
    return bits.view(torch.bfloat16)


def test_dequantize_rows_every_code_and_scale_class() -> None:
    """fp8fix's table lookup against torch on every code x scales of every class: powers of two, just above
    and just below one, tiny and huge (BF16 and F16), and row scales (per channel) times column blocks."""
    from fp8fix.numerics.dequantize import dequantize_rows

    codes = bytes(c for c in range(256) if c not in (0x7F, 0xFF))  # every non-NaN e4m3fn code
    cols = len(codes)
    fp8 = torch.frombuffer(bytearray(codes), dtype=torch.float8_e4m3fn).double()
    for out_dtype, torch_dtype, classes in (
        ("BF16", torch.bfloat16, [2.0**-3, 1.0, 2.0**-60, 2.0**100, 1.0000001, 0.99999994, 3.7e-30, 1.7e30]),
        ("F16", torch.float16, [2.0**-3, 1.0, 2.0**-16, 0.0013, 1.0000001, 0.99999994, 100.0 / 3]),
    ):
        for scale in classes:
            scale = float(np.float32(scale))  # a scale a checkpoint can hold
            data, stats = dequantize_rows(codes, "F8_E4M3", cols, cols, [scale], None, out_dtype)
            got = torch.frombuffer(bytearray(data), dtype=torch_dtype).double()
            assert torch.equal(got, round_once(fp8 * scale, torch_dtype)), (out_dtype, scale)
            assert stats.max_steps <= 0.5
        rows = [0.5, 0.013, 1.0000001]
        grid = codes[: 64 * 2] * 3  # three rows of 128 codes, two column blocks of 64
        data, _ = dequantize_rows(grid, "F8_E4M3", 128, 64, [1.0, 0.25], rows, out_dtype)
        got = torch.frombuffer(bytearray(data), dtype=torch_dtype).double().reshape(3, 128)
        values = torch.frombuffer(bytearray(grid), dtype=torch.float8_e4m3fn).double().reshape(3, 128)
        scales = torch.tensor(rows, dtype=torch.float64).reshape(3, 1) * torch.tensor([1.0] * 64 + [0.25] * 64)
        assert torch.equal(got, round_once(values * scales, torch_dtype)), out_dtype


def test_kept_lookup_arrays_and_tables_give_what_fresh_ones_do() -> None:
    """`--to bf16` keeps one index / output pair (`LookupArrays`) for every window and works a block row's tables
    out once: windows of other sizes, row scales and column scales through the same arrays give, value for
    value, what torch's one rounding of code x scale gives, as fresh arrays do."""
    from fp8fix.numerics.dequantize import LookupArrays, dequantize_rows, lookup_tables

    gen = np.random.default_rng(7)
    kept = LookupArrays()
    # (300, 128): 300 row scales make 76,800 table entries, past a uint16 index: the int32 index
    for rows, cols, block in ((6, 256, 128), (2, 256, 64), (300, 128, 128), (9, 128, 128), (1, 384, 128)):
        codes = gen.integers(0, 256, size=rows * cols, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        col_scales = [float(np.float32(s)) for s in gen.uniform(1e-4, 1e-2, size=cols // block)]
        row_scales = [float(np.float32(s)) for s in gen.uniform(0.5, 2.0, size=rows)]
        values = torch.frombuffer(bytearray(codes.tobytes()), dtype=torch.float8_e4m3fn).double().reshape(rows, cols)
        per_col = torch.tensor(col_scales, dtype=torch.float64).repeat_interleave(block)[None, :]
        for rows_given in (None, row_scales):
            tables = None if rows_given else lookup_tables("F8_E4M3", col_scales)
            data, _ = dequantize_rows(codes, "F8_E4M3", cols, block, col_scales, rows_given, "BF16", kept, tables)
            got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).double().reshape(rows, cols)
            scales = per_col * (torch.tensor(rows_given, dtype=torch.float64)[:, None] if rows_given else 1.0)
            assert torch.equal(got, round_once(values * scales, torch.bfloat16)), (rows, cols, rows_given is None)
            fresh, _ = dequantize_rows(codes, "F8_E4M3", cols, block, col_scales, rows_given, "BF16")
            assert bytes(data) == bytes(fresh)


def test_values_beyond_the_output_range_are_refused(tmp_path: Path) -> None:
    from fp8fix.numerics.dequantize import dequantize_rows

    with pytest.raises(ValueError, match="exceeds F16's largest"):
        dequantize_rows(bytes([0x7E]), "F8_E4M3", 1, 1, [1000.0], None, "F16")  # 448 x 1000
    with pytest.raises(ValueError, match="outside BF16's normal range"):
        dequantize_rows(bytes([0x01]), "F8_E4M3", 1, 1, [2.0**-125], None, "BF16")  # 2^-9 x 2^-125


def test_options_that_do_not_apply_to_a_plain_model(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    for extra in (["--layout", "fused"], ["--format", "compressed-tensors"], ["--dequantize", "*"]):
        result = run_cli("convert", src, tmp_path / "out", "--to", "bf16", *extra)
        assert result.exit_code == 2 and f"drop {extra[0]}" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_tp_composes_and_says_there_is_nothing_to_pad(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="block-fp8", scale="block")
    report = convert(src, tmp_path / "out", "--to", "bf16", "--tp", "8")
    assert any("--tp 8: nothing to pad" in note for note in report["notes"])
    check_plain_output(src, tmp_path / "out", llama(), FORMATS["block-fp8"].block, torch.bfloat16)


def test_kv_cache_scales_are_dropped_with_a_note(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    report = convert(src, tmp_path / "out", "--to", "bf16")
    assert any("4 kv-cache scale(s) dropped" in note for note in report["notes"]), report["notes"]


#: Formats whose config has a list of modules left unquantized that loaders read (fp8fix extends it).
DEQUANTIZE_FORMATS = {
    "fp8": "tensor",
    "fp8-legacy": "shard",
    "compressed-tensors": "channel",
    "block-fp8": "block",
    "ct-block": "block",
    "quark": "tensor",
}
#: Where each format lists modules left unquantized, and how a list names one (as its loaders match).
UNQUANTIZED_LISTS = {
    "fp8": ["modules_to_not_convert"],
    "fp8-legacy": ["modules_to_not_convert"],
    "block-fp8": ["modules_to_not_convert"],
    "compressed-tensors": ["ignore"],
    "ct-block": ["ignore"],
    "quark": ["exclude"],
}


@pytest.mark.parametrize("shape", ["phi3", "llama", "glm"])
@pytest.mark.parametrize("fmt", list(DEQUANTIZE_FORMATS))
def test_dequantize_some_modules(tmp_path: Path, fmt: str, shape: str) -> None:
    """`--dequantize '*.layers.0.self_attn.*'`: those modules in BF16 (rounded once), listed as unquantized
    where the format's loaders read it, every other FP8 weight kept as it is."""
    model = BASIC[shape]
    src = build(tmp_path / "src", model, fmt=fmt, scale=DEQUANTIZE_FORMATS[fmt])
    out = tmp_path / "out"
    report = convert(src, out, "--dequantize", "*.layers.0.self_attn.*", "--layout", "fused")
    exact = exact_values(src, model, FORMATS[fmt].block)
    source, output = tensors_of(src), tensors_of(out)
    chosen = {n for n in exact if ".layers.0.self_attn." in n}
    assert chosen and {m["weight"] for m in report["dequantized"]} == chosen
    for name in exact:
        if name in chosen:
            assert output[name].dtype == torch.bfloat16
            assert torch.equal(output[name].double(), round_once(exact[name], torch.bfloat16)), name
        else:
            assert output[name].dtype == source[name].dtype, name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    for key in UNQUANTIZED_LISTS[fmt]:
        listed = set(config[key])
        assert {n.removesuffix(".weight") for n in chosen} <= listed, (key, listed)
    assert report["verification"]["ok"]


@pytest.mark.parametrize("shape", ["phi3", "llama", "glm"])
@pytest.mark.parametrize("fmt", list(DEQUANTIZE_FORMATS))
def test_dequantize_of_every_fp8_module_points_to_to_bf16(tmp_path: Path, fmt: str, shape: str) -> None:
    """`--dequantize '*'` names every FP8 module: that is a plain BF16 model, which `--to bf16` writes without a
    quantization config (before: a config whose lists named every module, a card tagged `fp8`, and static input
    activations declared with no input scale left, which verify refused). Refused, pointing there, nothing
    written; a pattern that leaves FP8 modules converts, its card tagged `fp8` (from OUTPUT's tensors)."""
    src = build(tmp_path / "src", BASIC[shape], fmt=fmt, scale=DEQUANTIZE_FORMATS[fmt])
    refused = run_cli("convert", src, tmp_path / "all", "--dequantize", "*")
    assert refused.exit_code == 2 and "use --to bf16" in refused.output and not (tmp_path / "all").exists()
    out = tmp_path / "out"
    convert(src, out, "--dequantize", "*.layers.0.self_attn.*")  # with --verify, which checks the card's tags
    assert any(t.dtype in FP8_DTYPES for t in load_tensors(out).values())
    assert "fp8" in card_tags(out) and "fp8fix" in card_tags(out)


def card_tags(out: Path) -> list[str]:
    front = (out / "README.md").read_text().split("\n---\n")[0]
    return [line.removeprefix("- ") for line in front.splitlines() if line.startswith("- ")]


def test_tp_bf16_of_every_fp8_module_drops_the_fp8_tag(tmp_path: Path) -> None:
    """An attention-only block-FP8 Llama (heads of 64) at `--tp 8 --tp-bf16`: every FP8 weight is written in
    BF16, so OUTPUT's card must not carry the `fp8` tag (verify, run on every conversion here, refuses an
    `fp8` tag on a model with no FP8 weights: before, this conversion failed its verification)."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for m in ("q", "k", "v", "o"):
        name = f"model.layers.0.self_attn.{m}_proj"
        tensors[f"{name}.weight"] = (torch.randn(512, 512, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight_scale_inv"] = torch.rand(4, 4, generator=gen) * 1e-3 + 1e-4
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 64,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--tp", "8", "--tp-bf16", "-q")  # run_cli verifies the output
    assert result.exit_code == 0, result.output
    assert not any(t.dtype in FP8_DTYPES for t in load_tensors(out).values())
    assert "fp8" not in card_tags(out) and "fp8fix" in card_tags(out)


def test_dequantize_adds_the_modules_vllm_packs_with_them(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama())
    report = convert(src, tmp_path / "out", "--dequantize", "model.layers.1.self_attn.q_proj")
    assert {m["module"] for m in report["dequantized"]} == {
        f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")
    }
    assert any("vLLM packs them into one layer" in note for note in report["notes"])


def test_dequantize_lists_a_fused_module_by_its_shards_too(tmp_path: Path) -> None:
    """vLLM checks a fused-on-disk layer's shards by name (quant_utils.is_layer_skipped): both are listed."""
    src = build(tmp_path / "src", phi3())
    convert(src, tmp_path / "out", "--dequantize", "model.layers.0.self_attn.qkv_proj", "--layout", "fused")
    listed = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    prefix = "model.layers.0.self_attn."
    assert {prefix + m for m in ("qkv_proj", "q_proj", "k_proj", "v_proj")} <= set(listed)


@pytest.mark.parametrize(
    "build_args,pattern,code,message",
    [
        (("fp8", "tensor"), "*.nothing.*", 2, "names no FP8 module of this checkpoint"),
        (("modelopt", "tensor"), "*.o_proj", 3, "NVIDIA ModelOpt FP8 checkpoints have no config.json list"),
        (("fp8", "tensor"), "x" * 2000, 2, "a pattern of 2000 characters"),
    ],
)
def test_dequantize_refusals(
    tmp_path: Path, build_args: tuple[str, str], pattern: str, code: int, message: str
) -> None:
    src = build(tmp_path / "src", llama(), fmt=build_args[0], scale=build_args[1])
    result = run_cli("convert", src, tmp_path / "out", "--dequantize", pattern)
    assert result.exit_code == code and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_dequantize_refuses_routed_experts(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert")
    result = run_cli("convert", src, tmp_path / "out", "--dequantize", "*.experts.*")
    assert result.exit_code == 3 and "is a routed expert" in result.output, result.output

"""NVFP4 projections a runtime packs into one layer (q / k / v, gate / up) given the one global scale that layer uses
(issue 49): vLLM 0.19 - 0.32 multiply the whole layer by the largest multiplier (`weight_global_scale.max()`,
ModelOpt's `weight_scale_2.max()`), SGLang's weight-only NVFP4 refuses the layer. The default conversion (every
target but transformers, which reads each module's own) moves each module to the largest multiplier.

Expectations are worked out here, not by fp8fix's tables: the values through the OCP MX E2M1 table and torch's
float8_e4m3fn (every one of its 256 bytes decoded by torch), the shared multiplier from the source tensors, and
each group checked against every e4m3fn scale either side and every E2M1 value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8fix.numerics.nvfp4_shared import share_rows
from tests.builders import fp4_compressed_tensors, llama, modelopt_nvfp4
from tests.conftest import load_tensors, run_cli
from tests.test_fp4_modules import E2M1

#: Every e4m3fn byte's value, decoded by torch (NaN at 0x7F and 0xFF).
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
GRID = E4M3[:0x7F]  # the finite non-negative values, ascending
MAGNITUDES = torch.tensor(E2M1[:8], dtype=torch.float64)
PACKED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
ROWS = ["vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32", "SGLang 0.5.23"]


def elements(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [rows, cols / 2] as float64 [rows, cols], the lower nibble first."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return torch.tensor(E2M1, dtype=torch.float64)[nibbles]


def nearest_error(exact: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The least error of any E2M1 value times `scale` ([rows, groups]) at each `exact` [rows, groups, 16]."""
    candidates = MAGNITUDES * scale.abs()[..., None, None]  # [rows, groups, 1, 8]
    return (exact.abs()[..., None] - candidates).abs().min(dim=-1).values


def check_group_rules(
    src: torch.Tensor, src_scale: torch.Tensor, ratio: float, out: torch.Tensor, out_scale: torch.Tensor
):  # type: ignore[no-untyped-def]
    """Rows of SOURCE (packed, e4m3 scale bytes) moved by `ratio` into OUTPUT's: each scale an e4m3fn neighbour of
    s x ratio, each element the nearest E2M1 value, each group no worse than at the other neighbour. Returns the
    groups whose every value is kept."""
    rows, groups = src_scale.shape
    target = E4M3[src_scale.long()] * ratio
    lo = GRID[(torch.searchsorted(GRID, target, right=True) - 1).clamp(min=0)]
    hi = GRID[torch.searchsorted(GRID, target).clamp(max=len(GRID) - 1)]
    c = E4M3[out_scale.long()]
    assert bool(((c == lo) | (c == hi)).all())
    exact = elements(src).reshape(rows, groups, 16) * target[..., None]
    got = elements(out).reshape(rows, groups, 16) * c[..., None]
    error = (got - exact).abs()
    noise = exact.abs() * 1e-12
    assert bool((error <= nearest_error(exact, c) + noise).all())
    other = torch.where(c == lo, hi, lo)
    assert bool((error.amax(-1) <= nearest_error(exact, other).amax(-1) + noise.amax(-1)).all())
    return (error == 0).all(-1)


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.8004, 0.37, 2.0**-7])
def test_share_rows_follows_the_rules(ratio: float) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, cols = 48, 64
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 0x7F, (rows, cols // 16), dtype=torch.uint8, generator=gen)  # no NaN
    new_packed, new_scales, stats = share_rows(packed.numpy().tobytes(), scales.numpy().tobytes(), cols, ratio, 3.0)
    out = torch.frombuffer(bytearray(new_packed), dtype=torch.uint8).reshape(rows, cols // 2)
    out_scales = torch.frombuffer(bytearray(new_scales), dtype=torch.uint8).reshape(rows, cols // 16)
    kept = check_group_rules(packed, scales, ratio, out, out_scales)
    assert stats.groups == rows * cols // 16 and stats.groups_exact == int(kept.sum())
    if ratio == 1.0:  # the layer's own scale: every byte as it was
        assert torch.equal(out, packed) and torch.equal(out_scales, scales)
    if ratio == 0.5:  # a power of two: every group kept but where s / 2 falls off e4m3fn's subnormal grid
        on_grid = torch.isin(E4M3[scales.long()] * 0.5, GRID)
        assert bool(kept[on_grid].all()) and stats.max_abs == pytest.approx(
            float(
                (
                    (elements(out).reshape(rows, -1, 16) * E4M3[out_scales.long()][..., None] * 3.0)
                    - elements(packed).reshape(rows, -1, 16) * E4M3[scales.long()][..., None] * 1.5
                )
                .abs()
                .max()
            )
        )


def global_of(tensors: dict[str, torch.Tensor], module: str, modelopt: bool) -> float:
    return float(tensors[f"{module}.weight_scale_2" if modelopt else f"{module}.weight_global_scale"])


def multiplier(tensors: dict[str, torch.Tensor], module: str, modelopt: bool) -> float:
    g = global_of(tensors, module, modelopt)
    return g if modelopt else 1.0 / g


@pytest.mark.parametrize("make", [llama, lambda: llama(hidden=128, intermediate=256, layers=1)], ids=["small", "wider"])
@pytest.mark.parametrize("modelopt", [False, True], ids=["compressed-tensors", "modelopt"])
def test_default_conversion_gives_each_packed_layer_one_global_scale(tmp_path: Path, modelopt: bool, make) -> None:  # type: ignore[no-untyped-def]
    model = make()
    if modelopt:
        src = modelopt_nvfp4(tmp_path / "src", model, shared_global=False)
    else:
        src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, model, shared_global=False)
    before = json.loads(run_cli("inspect", src, "--json").stdout)["loaders"]
    assert {before[r]["verdict"] for r in ROWS[:3]} == {"loads-wrong"}
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--json")  # (and verify)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    src_t, out_t = load_tensors(src), load_tensors(out)
    weight = "weight" if modelopt else "weight_packed"
    moved = {m["module"]: m for m in plan["shared_fp4"]}
    layers = 0
    fp4 = {
        n.removesuffix(f".{weight}") for n, t in src_t.items() if n.endswith(f".{weight}") and t.dtype == torch.uint8
    }
    for module in sorted(fp4):
        parent, _, leaf = module.rpartition(".")
        for group in PACKED:
            if leaf != group[0]:
                continue
            members = [f"{parent}.{p}" for p in group]
            assert set(members) <= fp4
            layers += 1
            shared = max(multiplier(src_t, m, modelopt) for m in members)
            assert {multiplier(out_t, m, modelopt) for m in members} == {shared}
            for m in members:
                ratio = multiplier(src_t, m, modelopt) / shared
                scale = src_t[f"{m}.weight_scale"].view(torch.uint8)
                out_scale = out_t[f"{m}.weight_scale"].view(torch.uint8)
                kept = check_group_rules(src_t[f"{m}.{weight}"], scale, ratio, out_t[f"{m}.{weight}"], out_scale)
                if ratio == 1.0:
                    assert m not in moved and torch.equal(out_t[f"{m}.{weight}"], src_t[f"{m}.{weight}"])
                else:
                    assert moved[m]["groups_exact"] == int(kept.sum()) and moved[m]["ratio"] == pytest.approx(ratio)
    assert layers == 2 * model.layers and len(moved) > 0
    others = [n for n in src_t if not any(n.startswith(f"{m}.") for m in moved)]
    assert all(torch.equal(out_t[n], src_t[n]) for n in others)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    after = plan["loaders"]
    assert "loads-wrong" not in {after[r]["verdict"] for r in ROWS}
    assert after["SGLang 0.5.23"]["verdict"] == "not-judged"  # no longer refused: CUDA kernels only


def test_transformers_target_keeps_each_module_its_own(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=False)
    refused = run_cli("convert", src, tmp_path / "out", "--target", "transformers")
    assert refused.exit_code == 3 and "--to bf16" in refused.output and not (tmp_path / "out").exists()
    mixed = fp4_compressed_tensors(
        tmp_path / "mixed",
        {"self_attn.q_proj": "nvfp4", "self_attn.k_proj": "nvfp4", "self_attn.v_proj": "nvfp4", "proj": "fp8"},
        shared_global=False,
    )
    result = run_cli("convert", mixed, tmp_path / "mixed-out", "--target", "transformers", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["shared_fp4"] == []
    before, after = load_tensors(mixed), load_tensors(tmp_path / "mixed-out")
    assert all(torch.equal(after[n], t) for n, t in before.items() if "self_attn" in n and "o_proj" not in n)
    result = run_cli("convert", mixed, tmp_path / "mixed-auto", "--json")
    assert result.exit_code == 0 and len(json.loads(result.stdout)["shared_fp4"]) == 4  # 2 of 3 in each of 2 layers


def test_power_of_two_ratio_keeps_every_value(tmp_path: Path) -> None:
    """k_proj's global scale halved and its scales with it (the same values): q / v move by exactly 1/2."""
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=True)
    tensors = load_tensors(src)
    for i in range(2):
        k = f"model.layers.{i}.self_attn.k_proj"
        tensors[f"{k}.weight_global_scale"] = tensors[f"{k}.weight_global_scale"] / 2
        halved = tensors[f"{k}.weight_scale"].double() / 2
        assert bool(torch.isin(halved, GRID).all())  # (exact: no scale halves off the grid here)
        tensors[f"{k}.weight_scale"] = halved.to(torch.float8_e4m3fn)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    moved = json.loads(result.stdout)["shared_fp4"]
    assert sorted(m["module"].rsplit(".", 1)[1] for m in moved) == ["q_proj", "q_proj", "v_proj", "v_proj"]
    on_grid = [
        m
        for m in moved
        if bool(torch.isin(E4M3[tensors[m["module"] + ".weight_scale"].view(torch.uint8).long()] / 2, GRID).all())
    ]
    assert on_grid and all(m["groups_exact"] == m["groups"] and m["max_error"] == 0 for m in on_grid)


@pytest.mark.parametrize(
    "what",
    ["element", "scale-off-grid", "sibling-global", "worse-neighbour"],
)
def test_verify_catches_a_wrong_shared_module(tmp_path: Path, what: str) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=False)
    out = tmp_path / "out"
    assert run_cli("convert", src, out).exit_code == 0
    k = "model.layers.0.self_attn.k_proj"
    tensors = load_tensors(out)
    source = load_tensors(src)

    def element(t: dict[str, torch.Tensor]) -> None:
        t[f"{k}.weight_packed"][3, 5] ^= 0x01  # one element one E2M1 value off

    def scale_off_grid(t: dict[str, torch.Tensor]) -> None:
        b = t[f"{k}.weight_scale"].view(torch.uint8)
        b[2, 1] = min(0x7E, int(b[2, 1]) + 3)

    def sibling_global(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_proj.weight_global_scale"] = t[f"{k}.weight_global_scale"] * 1.5

    def worse_neighbour(t: dict[str, torch.Tensor]) -> None:
        """A group given the other e4m3fn neighbour, its elements the nearest there, where that errs more."""
        ratio = multiplier(source, k, False) / multiplier(t, k, False)
        target = E4M3[source[f"{k}.weight_scale"].view(torch.uint8).long()] * ratio
        lo = GRID[(torch.searchsorted(GRID, target, right=True) - 1).clamp(min=0)]
        hi = GRID[torch.searchsorted(GRID, target).clamp(max=len(GRID) - 1)]
        c = E4M3[t[f"{k}.weight_scale"].view(torch.uint8).long()]
        other = torch.where(c == lo, hi, lo)
        exact = elements(source[f"{k}.weight_packed"]).reshape(*target.shape, 16) * target[..., None]
        for r, g in torch.nonzero(other != c).tolist():
            alt = other[r, g]
            q = exact[r, g] / alt
            nibbles = [int((MAGNITUDES - v.abs()).abs().argmin()) | (8 if v < 0 else 0) for v in q]
            err = (torch.tensor([E2M1[n] for n in nibbles], dtype=torch.float64) * alt - exact[r, g]).abs().max()
            mine = (
                (elements(t[f"{k}.weight_packed"]).reshape(*target.shape, 16)[r, g] * c[r, g] - exact[r, g]).abs().max()
            )
            if err > mine * 1.001:
                t[f"{k}.weight_scale"].view(torch.uint8)[r, g] = int(torch.nonzero(E4M3 == alt)[0])
                row = t[f"{k}.weight_packed"][r]
                for i in range(0, 16, 2):
                    row[g * 8 + i // 2] = nibbles[i] | (nibbles[i + 1] << 4)
                return
        raise AssertionError("no group where the other neighbour errs more")

    changes = {
        "element": element,
        "scale-off-grid": scale_off_grid,
        "sibling-global": sibling_global,
        "worse-neighbour": worse_neighbour,
    }
    changes[what](tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    checked = run_cli("verify", src, out)
    assert checked.exit_code == 1 and ("k_proj" in checked.output or "q_proj" in checked.output), checked.output


def test_dry_run_and_card_say_it(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=False)
    dry = run_cli("convert", src, tmp_path / "out", "--dry-run")
    assert dry.exit_code == 0 and "nvfp4: 6 module(s) of 4 packed layer(s)" in dry.output
    assert not (tmp_path / "out").exists()
    assert run_cli("convert", src, tmp_path / "out").exit_code == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Nvfp4: 6 module(s) of 4 packed layer(s)" in card and "groups of 16 keep every value exactly" in card


def test_rows_in_many_windows_write_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module moved in windows of a few rows (each with its own scale bytes) is written byte for byte as in one."""
    from fp8fix.plan import fp4_shared

    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=False)
    assert run_cli("convert", src, tmp_path / "one").exit_code == 0
    monkeypatch.setattr(fp4_shared, "WINDOW_BYTES", 3 * 32)  # 3 rows of 64 elements a window (the last shorter)
    assert run_cli("convert", src, tmp_path / "many").exit_code == 0
    one, many = load_tensors(tmp_path / "one"), load_tensors(tmp_path / "many")
    assert one.keys() == many.keys() and all(torch.equal(one[n], many[n]) for n in one)


def test_a_nan_scale_is_refused_naming_it(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, shared_global=False)
    tensors = load_tensors(src)
    moved = json.loads(run_cli("convert", src, tmp_path / "dry", "--dry-run", "--json").stdout)["shared_fp4"]
    module = moved[0]["module"]
    tensors[f"{module}.weight_scale"].view(torch.uint8)[3, 2] = 0x7F  # e4m3fn NaN
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3 and not (tmp_path / "out").exists()
    assert f"'{module}.weight_scale'" in result.output and "row 3, group 2" in result.output, result.output

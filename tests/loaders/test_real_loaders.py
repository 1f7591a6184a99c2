"""fp8fix's verdicts against what the real loaders do (vLLM 0.32 CPU build, as on a GPU and with the ROCm
platform's FP8 switches; transformers 5.x on CPU).

Small Phi-3 checkpoints of several formats, as exported and after each `--layout`, are
loaded by the real loaders (see conftest.py); the weights each loader ends up computing
with are compared with the true values dequantized from the SOURCE files by this test,
independently of fp8fix. The outcome is `loads` (every FP8 layer exactly the source's
values), `rounded` (not exactly, but exactly what e4m3fn parameters make of the checkpoint's e4m3fnuz
codes: odd subnormal codes rounded, half an fp8 step at most), `loads-wrong` (loaded, but some layer is
not: unscaled, random or lost), or `fails` (the loader raised). Then fp8fix's own verdict for that loader, from
`fp8fix inspect --json` on the checkpoint, must say the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp8fix.registry.loader_rows import ERA_RELEASES
from tests.builders import Model, build, glm, llama, loadable, phi3
from tests.conftest import patch_bytes, run_cli
from tests.loaders.conftest import Loaded, interpreter, record, run_loaders

pytestmark = pytest.mark.loaders

#: fp8fix's loader rows that these real loaders answer for.
VERDICT_ROWS = {
    # the vLLM era rows, each run on its oldest and newest release (conftest.VLLM_ERAS)
    **{f"vllm-{release}": era for era, releases in ERA_RELEASES.items() for release in releases},
    "vllm": "vLLM >= 0.32",
    "vllm-rocm": "vLLM >= 0.32 on ROCm",
    "sglang": "SGLang 0.5.23",
    "transformers": "transformers",
}


#: Sources as each exporter writes them (tests/builders.py): name -> (format, scale); Phi-3 unless
#: MODELS names another architecture.
def loader_shape(source: str) -> str:
    """The architecture shape a source is built with, from its name."""
    return next((shape for shape in ("glm", "llama") if source.startswith(shape)), "phi3")


SOURCES = {
    "fp8-tensor": ("fp8", "tensor"),  # AutoFP8 per-tensor, the shipped example's format
    "fp8-channel": ("fp8", "channel"),  # quant_method fp8 with [out, 1] weight scales
    "fp8-legacy": ("fp8-legacy", "tensor"),  # AutoFP8's first releases: act_scale, kv_scale
    "ct-tensor": ("compressed-tensors", "tensor"),
    "ct-channel": ("compressed-tensors", "channel"),
    "fbgemm": ("fbgemm", "channel"),
    "block-fp8": ("block-fp8", "block"),  # DeepSeek-V3 / Qwen3 style weight_scale_inv per 32x32 block
    "glm-fp8": ("fp8", "tensor"),  # GlmForCausalLM: vLLM 0.32 serves it through its Transformers backend
    "glm-ct": ("compressed-tensors", "tensor"),
    # fused modules whose shards carry different scales (issue 14): only the channel layout is exact
    "fp8-shard": ("fp8", "shard"),
    "fp8-legacy-shard": ("fp8-legacy", "shard"),
    "ct-shard": ("compressed-tensors", "shard"),
    # issue 24: lm_head in BF16 and listed nowhere (the compressed-tensors rewrite must ignore it)
    "fp8-legacy-unlisted": ("fp8-legacy", "tensor"),
    "modelopt-tensor": ("modelopt", "tensor"),  # transformers reads no hf_quant_config.json
    "quark-tensor": ("quark", "tensor"),
    "quark-bare": ("quark", "tensor"),  # without layer_type_quant_config, which vLLM reads
    # Llama shapes: q/k/v and gate/up apart on disk, which vLLM packs
    "llama-fp8": ("fp8", "tensor"),
    "llama-fp8-amd-kv": ("fp8-amd-kv", "tensor"),  # AMD's k_proj.output_scale kv-cache scales
    "llama-ct-tensor": ("compressed-tensors", "tensor"),
}
#: build() options of sources that differ from an exporter's defaults.
BUILD_OPTIONS: dict[str, dict[str, object]] = {"fp8-legacy-unlisted": {"ignore": []}}

#: The matrix (issue 24): every format the registry reads x the Llama (q/k/v and gate/up apart), GLM
#: (gate_up fused, served by vLLM's Transformers backend) and Phi-3 (both fused) shapes x the scale styles
#: each format has: one scale per tensor, shards of a fused module with different scales, dynamic
#: activations, per-row scales; kv-cache scales in each format's own names (builders.FORMATS).
STYLES: dict[str, tuple[str, dict[str, object]]] = {
    "tensor": ("tensor", {}),
    "shard": ("shard", {}),
    "dynamic": ("tensor", {"static_input": False}),
    "channel": ("channel", {}),
    "block": ("block", {}),
}
FORMAT_STYLES = {
    "fp8": ("tensor", "shard", "dynamic", "channel"),
    "fp8-legacy": ("tensor", "shard"),
    "compressed-tensors": ("tensor", "shard", "dynamic", "channel"),
    "modelopt": ("tensor", "shard"),
    "quark": ("tensor", "shard", "channel"),
    "fbgemm": ("channel",),
    "block-fp8": ("block",),
    "ct-block": ("block",),  # compressed-tensors' block strategy (weight_scale names), as llm-compressor writes it
    "ct-block-w8a16": ("block",),  # ... without input_activations: weight-only FP8 blocks
    "fp8-amd-kv": ("tensor",),
}
for _shape in ("llama", "glm", "phi3"):
    for _fmt, _styles in FORMAT_STYLES.items():
        for _style in _styles:
            if (_style == "shard" and _shape == "llama") or (_fmt == "fp8-amd-kv" and _shape != "llama"):
                continue  # Llama fuses nothing on disk; AMD's kv names sit on k_proj / v_proj
            _scale, _options = STYLES[_style]
            _name = f"{_shape}.{_fmt}.{_style}"  # dots: never an output folder's name (SOURCE-layout)
            if (_fmt, _scale) in {SOURCES[n] for n in SOURCES if loader_shape(n) == _shape} and not _options:
                continue  # already a source above
            SOURCES[_name] = (_fmt, _scale)
            if _options:
                BUILD_OPTIONS[_name] = _options
#: config.json quantization_config keys removed from a source after it is built.
WITHOUT_KEYS = {"quark-bare": ("layer_quant_config", "layer_type_quant_config")}
LAYOUTS = ("as-exported", "unfused", "per-shard", "fused")
#: Outputs written as compressed-tensors (AutoFP8 sources only): case name -> convert options.
AS_COMPRESSED_TENSORS = {
    "unfused+ct": ("--layout", "unfused", "--format", "compressed-tensors"),
    "fused+ct": ("--layout", "fused", "--format", "compressed-tensors"),
}
#: The channel layout (compressed-tensors, one scale per row), on the sources it is written from.
CHANNEL = {"channel": ("--layout", "channel")}
#: Sources only their channel output is loaded from: what these loaders do with Quark and ModelOpt
#: checkpoints as exported is not judged here (fp8fix's verdicts on them come from the loaders' source).
CHANNEL_ONLY: dict[str, dict[str, object]] = {
    "quark-shard": {"fmt": "quark", "scale": "shard"},
    "modelopt-shard": {"fmt": "modelopt", "scale": "shard"},
    # dynamic activations: written as compressed-tensors' dynamic per-token input activations
    "fp8-dynamic-shard": {"fmt": "fp8", "scale": "shard", "static_input": False},
}
CHANNEL_SOURCES = [
    *(s for s in SOURCES if SOURCES[s][0] in ("fp8", "fp8-legacy", "compressed-tensors")),
    *CHANNEL_ONLY,
]
#: `--target`, on every source: case name -> convert options.
TARGETS = {"target-vllm": ("--target", "vllm"), "target-transformers": ("--target", "transformers")}
#: Encoding changes, on every source: case name -> convert options.
ENCODINGS = {"fnuz": ("--to", "e4m3fnuz"), "fnuz+fused": ("--layout", "fused", "--to", "e4m3fnuz")}
#: Cases a real loader cannot run here, for a reason outside weight loading.
CANNOT_RUN: dict[tuple[str, str], str] = {}


def legacy_names(folder: Path) -> bool:
    """The checkpoint still names activation scales the legacy AutoFP8 way (`act_scale`), from its headers."""
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            if any(k.endswith(".act_scale") for k in f.keys()):
                return True
    return False


def quant_method(folder: Path) -> str | None:
    """config.json's quantization_config.quant_method, as written in the checkpoint a case loads."""
    config = json.loads((folder / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def not_judged(source: str, layout: str, loader: str, folder: Path) -> str | None:
    """Why fp8fix must say `not-judged` for a case (worked out from the case, not from fp8fix), or None:
    FBGEMM FP8 in transformers runs on a GPU only (the CPU refusal is what runs here); the legacy AutoFP8 names
    in SGLang (the harness reads weights back, not the activation scales its act_scale would set)."""
    if loader == "transformers" and quant_method(folder) == "fbgemm_fp8":  # not its conversions (compressed-tensors)
        return "gpu-only"
    if loader == "sglang" and loader_shape(source) != "glm" and legacy_names(folder):
        return "activation-scales"  # it loads the weights; whether it uses act_scale is not read back here
    fused_refusal = loader in ("vllm-0.19.0", "vllm-0.20.2") and any(
        "qkv_proj.weight" in k for p in folder.glob("*.safetensors") for k in safe_open(p, "pt").keys()
    )
    if loader.startswith("vllm") and weight_only_blocks(folder) and not fused_refusal:
        # W8A16 block FP8: the CPU builds have no kernel for it; a GPU's is not run here (but 0.19 - 0.20
        # refuse a fused qkv_proj's block scales whatever the kernel: judged, as for every block format)
        return "cpu-kernel"
    return None


def weight_only_blocks(folder: Path) -> bool:
    """compressed-tensors block weights in a config group without input_activations (read off config.json)."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    groups = qc.get("config_groups") or {} if qc.get("quant_method") == "compressed-tensors" else {}
    return any(
        (g.get("weights") or {}).get("strategy") == "block" and not g.get("input_activations") for g in groups.values()
    )


CASES = (
    [(source, layout) for source in SOURCES for layout in LAYOUTS]
    + [(source, case) for source in SOURCES if SOURCES[source][0].startswith("fp8") for case in AS_COMPRESSED_TENSORS]
    + [(source, case) for source in CHANNEL_SOURCES for case in CHANNEL]
    + [(source, "auto") for source in SOURCES]  # what `convert SOURCE OUTPUT` writes
    + [(source, case) for source in SOURCES for case in ENCODINGS]
    + [(source, case) for source in SOURCES for case in TARGETS]
)


def loader_model(source: str) -> Model:
    return loadable({"glm": glm, "llama": llama, "phi3": phi3}[loader_shape(source)]())


@dataclass
class Case:
    source: str
    layout: str
    folder: Path
    truth: dict[str, torch.Tensor]
    convert_verdicts: dict[str, str]  # what `convert --json` said about OUTPUT ({} for a source)


class Truth(dict[str, torch.Tensor]):
    """The true weights by module, and `rows`: each row's true scale, by module (per-tensor, per-shard and
    per-row scales; none for block grids): where a loaded layer's rows had different scales, a loader (or
    fp8fix's `--layout fused`) had to requantize them to one."""

    rows: dict[str, torch.Tensor]


def true_weights(folder: Path, model: Model, as_e4m3fn: bool = False) -> Truth:
    """Every FP8 linear layer of SOURCE dequantized in float32, by module path: codes times the scale
    of their row (one scale, one per shard by the documented row counts, or one per row). `as_e4m3fn`: each
    e4m3fnuz code first cast into e4m3fn (torch's round to nearest even), as a loader that holds e4m3fn
    parameters computes with them: the `rounded` verdict's expectation."""
    tensors: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    shard_rows = {f.suffix: f.rows for f in model.fused}
    truth = Truth(lm_head=tensors["lm_head.weight"].float())  # BF16 in every source: no loader may quantize it
    truth.rows = {}
    for name, w in tensors.items():
        if not name.endswith(".weight") or w.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            continue
        if as_e4m3fn and w.dtype == torch.float8_e4m3fnuz:
            w = w.float().to(torch.float8_e4m3fn)
        module = name.removesuffix(".weight")
        scale = tensors.get(module + ".weight_scale", tensors.get(module + ".weight_scale_inv"))
        assert scale is not None, module
        scale = scale.float()
        if scale.dim() == 2 and scale.shape[1] > 1:  # a block grid: blocks of equal size
            block = (-(-w.shape[0] // scale.shape[0]), -(-w.shape[1] // scale.shape[1]))
            grid = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
            truth[module] = w.float() * grid
            continue
        if scale.numel() == 1:
            rows = scale.reshape(1, 1).expand(w.shape[0], 1)
        elif scale.numel() == w.shape[0]:
            rows = scale.reshape(-1, 1)
        else:
            counts = next(r for suffix, r in shard_rows.items() if module.endswith(suffix))
            rows = torch.cat([scale[i].expand(n) for i, n in enumerate(counts)]).reshape(-1, 1)
        truth[module] = w.float() * rows
        truth.rows[module] = rows.reshape(-1)
    return truth


@pytest.fixture(scope="session")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Case]:
    for loader in VERDICT_ROWS:  # skip (or, in CI, fail) before building anything
        interpreter(loader)
    root = tmp_path_factory.mktemp("real-loaders")
    out = {}
    for name, (fmt, scale) in SOURCES.items():
        model = loader_model(name)
        src = build(root / name, model, fmt=fmt, scale=scale, **BUILD_OPTIONS.get(name, {}))  # type: ignore[arg-type]
        if name in WITHOUT_KEYS:
            config = json.loads((src / "config.json").read_text())
            for key in WITHOUT_KEYS[name]:
                del config["quantization_config"][key]
            (src / "config.json").write_text(json.dumps(config))
        # the smallest e4m3fn subnormal (code 0x01), which e4m3fnuz at the doubled scale holds as an odd
        # subnormal code: what tells a loader that rounds fnuz into e4m3fn apart from one that does not
        patch_bytes(src, "model.layers.0.mlp.down_proj.weight", {0: 0x01})
        truth = true_weights(src, model)
        out[(name, "as-exported")] = Case(name, "as-exported", src, truth, {})
        options: dict[str, tuple[str, ...]] = {layout: ("--layout", layout) for layout in LAYOUTS[1:]}
        options["auto"] = ()
        options.update(ENCODINGS)
        options.update(TARGETS)
        if fmt.startswith("fp8"):
            options.update(AS_COMPRESSED_TENSORS)
        if name in CHANNEL_SOURCES:
            options.update(CHANNEL)
        for layout, args in options.items():
            folder = root / f"{name}-{layout}"
            result = run_cli("convert", src, folder, *args, "--json")
            assert result.exit_code == 0, result.output
            said = {row: v["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}
            out[(name, layout)] = Case(name, layout, folder, truth, said)
    for name, options in CHANNEL_ONLY.items():
        model = loader_model(name)
        src = build(root / name, model, **options)  # type: ignore[arg-type]
        folder = root / f"{name}-channel"
        result = run_cli("convert", src, folder, *CHANNEL["channel"], "--json")
        assert result.exit_code == 0, result.output
        said = {row: v["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}
        out[(name, "channel")] = Case(name, "channel", folder, true_weights(src, model), said)
    return out


@pytest.fixture(scope="session")
def loaded(cases: dict[tuple[str, str], Case], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case through each real loader, one process per loader."""
    root = tmp_path_factory.mktemp("loader-output")
    keys = list(cases)
    results = {}
    for loader, ran in run_loaders(VERDICT_ROWS, [cases[k].folder for k in keys], root).items():
        results[loader] = dict(zip(keys, ran, strict=True))
    return results


#: vLLM requantizes shards with different scales to their largest at load, through float16: measured
#: 0.502-0.516 fp8 step from the true values (issue 14), a bounded loss, not wrong weights.
REQUANTIZED_STEPS = 0.52


def bf16_exact(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The true values as a bf16 model computes with them: exactly; rounded once to bf16 (on CPU transformers
    dequantizes FP8 layers into the model's dtype); or, where its compressed-tensors layers hold the weight
    scale in the model's dtype (the default `from_pretrained`), the code times the scale rounded to bf16:
    within one bf16 ulp (2^-8 of the value; an fp8 step is 2^-4 of it, raw codes or wrong blocks far more)."""
    if got.shape != expected.shape:
        return False
    if torch.equal(got, expected) or torch.equal(got, expected.to(torch.bfloat16).float()):
        return True
    return bool(((got - expected).abs() <= expected.abs() * 2**-8).all())


def same_values(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """`bf16_exact`; or, for a layer requantized to one `scale` (by the loader, or by fp8fix's `--layout
    fused`), within REQUANTIZED_STEPS fp8 steps of that scale's grid (plus bf16's rounding)."""
    if got.shape != expected.shape:
        return False
    if bf16_exact(got, expected):
        return True
    if scale is None or scale.numel() != 1:
        return False
    codes = expected / scale
    _, exponent = torch.frexp(codes)
    step = torch.exp2((exponent - 1).clamp(min=-6).float() - 3) * scale  # e4m3fn: 3 mantissa bits
    bf16 = expected.abs() * 2**-8  # a loader computing in bf16 rounds once more (half an ulp: 2^-9)
    return bool(((got - expected).abs() <= REQUANTIZED_STEPS * step + bf16).all())


#: Layers a loader packs from several checkpoint modules, rows in this order (vLLM's packed_modules_mapping:
#: its own models and its Transformers backend fuse q/k/v and gate/up).
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def as_loaded(truth: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The true weights (or row scales) under the loader's layer names: modules it packs are concatenated
    by rows."""
    expected = dict(truth)
    for name in loaded:
        module, _, leaf = name.rpartition(".")
        parts = [f"{module}.{p}" for p in PACKED.get(leaf, ())]
        if name not in expected and parts and all(p in truth for p in parts):
            expected[name] = torch.cat([expected.pop(p) for p in parts])
    return expected


@cache
def fp8fix_grid(folder: Path) -> dict[str, torch.Tensor]:
    """The one-value weight scales of a checkpoint, by module: the grid of a module fp8fix requantized
    (`--layout fused`), for loaders that do not report the scale they computed with. None for e4m3fnuz
    weights: fp8fix's requantization is exact on their own grid, and a loader that rounds their odd
    subnormal codes into e4m3fn parameters (transformers) must not pass as requantizing."""
    scales = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if k.endswith(".weight") and f.get_slice(k).get_dtype() == "F8_E4M3FNUZ":
                    return {}
                if k.endswith(".weight_scale") and f.get_slice(k).get_shape() in ([], [1]):
                    scales[k.removesuffix(".weight_scale")] = f.get_tensor(k).float()
    return scales


@cache
def written_values(folder: Path) -> dict[str, torch.Tensor]:
    """The FP8 weights with one weight scale as the checkpoint holds them, codes times that scale, by module:
    where fp8fix requantized shards to one scale (`--layout fused`) this is what a loader reading the checkpoint
    exactly computes with (the loss is fp8fix's, reported by convert), unlike the SOURCE's truth."""
    tensors: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):  # a weight and its scale may sit in different files
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    values = {}
    for name, w in tensors.items():
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        if name.endswith(".weight") and scale is not None and scale.numel() == 1:
            if w.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
                values[name.removesuffix(".weight")] = w.float() * scale.float().reshape(())
    return values


def outcome(
    result: Loaded, truth: dict[str, torch.Tensor], folder: Path, rounded: dict[str, torch.Tensor] | None = None
) -> tuple[str, str]:
    """(loads | rounded | loads-wrong | fails, why) from what the loader computes with, against the truth:
    exactly (`bf16_exact`), or, for a layer whose rows' true scales differ (`Truth.rows`: requantized to one by
    the loader or by fp8fix), within REQUANTIZED_STEPS of the one scale's grid: `loads` where the checkpoint
    holds it so (fp8fix requantized it: `written_values`), `rounded` where the loader requantized it.
    `rounded` too: the truth as a loader holding e4m3fn parameters computes it from the checkpoint's e4m3fnuz
    codes (`true_weights(as_e4m3fn=True)`): a loader that is not exact but computes exactly that rounded its
    odd subnormal codes."""
    verdict, why = _outcome(result, truth, folder)
    if verdict == "loads-wrong" and rounded is not None and _outcome(result, rounded, folder)[0] != "loads-wrong":
        return "rounded", why
    return verdict, why


def rounded_truth(folder: Path, source: str) -> Truth | None:
    """`true_weights(as_e4m3fn=True)` of a checkpoint with e4m3fnuz weights, else None."""
    return true_weights(folder, loader_model(source), as_e4m3fn=True) if fnuz_weights(folder) else None


@cache
def fnuz_weights(folder: Path) -> bool:
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            if any(k.endswith(".weight") and f.get_slice(k).get_dtype() == "F8_E4M3FNUZ" for k in f.keys()):
                return True
    return False


def _outcome(result: Loaded, truth: dict[str, torch.Tensor], folder: Path) -> tuple[str, str]:
    if not result.loaded:
        needs_gpu = "requires a GPU" in result.error
        return ("needs-gpu" if needs_gpu else "fails"), result.error
    wrong, requantized_here = [], []
    rows = as_loaded(truth.rows, result.weights) if isinstance(truth, Truth) else None
    for module, expected in as_loaded(truth, result.weights).items():
        got = result.weights.get(module)
        if got is None and module in result.unreadable:
            continue
        if got is None:
            wrong.append(f"{module}: not loaded")
            continue
        # a requantized layer: rows of different true scales now on one (plain dict truth: any one-scale layer)
        requantized = rows is None or (module in rows and bool((rows[module] != rows[module][0]).any()))
        grid = result.weights.get(f"{module}::scale", fp8fix_grid(folder).get(module)) if requantized else None
        if not same_values(got, expected, grid):
            error = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
            wrong.append(f"{module}: differs (max abs error {error:.3g})")
        elif requantized and not bf16_exact(got, expected):
            written = written_values(folder).get(module)
            if written is None or not bf16_exact(got, written):  # not as the checkpoint holds it: requantized
                error = (got - expected).abs().max().item()
                requantized_here.append(f"{module}: requantized at load (max abs error {error:.3g})")
    if wrong:
        return "loads-wrong", "; ".join(wrong[:3])
    return ("rounded", "; ".join(requantized_here[:3])) if requantized_here else ("loads", "")


def inspect_verdict(folder: Path, loader: str) -> str:
    return str(inspect_rows(folder)[VERDICT_ROWS[loader]]["verdict"])


@cache
def inspect_rows(folder: Path) -> dict[str, dict]:
    """`fp8fix inspect --json`'s loader rows of a case's folder (each folder is written once: read once)."""
    return dict(json.loads(run_cli("inspect", folder, "--json").output)["loaders"])


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("source,layout", CASES)
def test_fp8fix_says_what_the_loader_does(
    cases: dict[tuple[str, str], Case], loaded: dict[str, dict], source: str, layout: str, loader: str
) -> None:
    if (loader, source) in CANNOT_RUN:
        pytest.skip(CANNOT_RUN[(loader, source)])
    case = cases[(source, layout)]
    real, why = outcome(loaded[loader][(source, layout)], case.truth, case.folder, rounded_truth(case.folder, source))
    said = inspect_verdict(case.folder, loader)
    if case.convert_verdicts:  # convert judged what it wrote, as inspect judges what it reads
        assert case.convert_verdicts[VERDICT_ROWS[loader]] == said
    expected_not_judged = not_judged(source, layout, loader, case.folder)
    if expected_not_judged == "activation-scales" and real == "fails":
        expected_not_judged = None  # what it loads is unmeasured; that it refuses is measured
    record(loader, f"{source}/{layout}", said, real, expected_not_judged is not None, why)
    if expected_not_judged is not None:
        assert said == "not-judged", f"fp8fix inspect says {said} where nothing measured it ({expected_not_judged})"
        if expected_not_judged == "gpu-only":  # what its reason says ran: the CPU refusal
            assert real == "needs-gpu", why
        if expected_not_judged == "cpu-kernel":  # the same: 0.19.0 asserts, later releases find no kernel
            assert real == "fails" and ("Failed to find a kernel" in why or "AssertionError" in why), why
        return
    assert said == real, f"fp8fix inspect says {said}, the real {loader} {real}: {why[:300]}"


#: transformers with amd-quark installed, which its Quark quantizer needs: the transformers row's other outcome.
AMD_QUARK = "transformers-amd-quark"
#: The cases of Quark sources (their outputs stay Quark or become compressed-tensors, which has no such row).
QUARK_CASES = [(source, layout) for source, layout in CASES if SOURCES.get(source, ("",))[0] == "quark"]


@pytest.fixture(scope="session")
def loaded_with_amd_quark(
    cases: dict[tuple[str, str], Case], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Loaded]:
    """The Quark checkpoints among QUARK_CASES through transformers with amd-quark, in one process."""
    interpreter(AMD_QUARK)
    keys = [key for key in QUARK_CASES if quant_method(cases[key].folder) == "quark"]
    root = tmp_path_factory.mktemp("amd-quark-output")
    ran = run_loaders([AMD_QUARK], [cases[key].folder for key in keys], root)[AMD_QUARK]
    return dict(zip(keys, ran, strict=True))


@pytest.mark.parametrize("source,layout", QUARK_CASES)
def test_the_transformers_row_says_what_amd_quark_changes(
    cases: dict[tuple[str, str], Case], loaded_with_amd_quark: dict[tuple[str, str], Loaded], source: str, layout: str
) -> None:
    """transformers refuses a Quark checkpoint without amd-quark (the row, measured above); its `with_package`
    says what transformers does with amd-quark 0.13 installed, measured here. No other checkpoint has one."""
    case = cases[(source, layout)]
    row = inspect_rows(case.folder)["transformers"]
    if quant_method(case.folder) != "quark":
        assert row["with_package"] is None, f"{case.folder.name} is not a Quark checkpoint"
        return
    said = row["with_package"]["verdict"]
    assert row["verdict"] == "fails" and row["with_package"]["package"] == "amd-quark 0.13"
    loaded = loaded_with_amd_quark[(source, layout)]
    real, why = outcome(loaded, case.truth, case.folder, rounded_truth(case.folder, source))
    record(AMD_QUARK, f"{source}/{layout}", said, real, False, why)
    assert loaded.quantization in (None, "QuarkHfQuantizer")
    assert said == real, f"fp8fix says {said} with amd-quark, the real transformers + amd-quark {real}: {why[:300]}"


#: The real loaders each `--target` is for: vllm is every vLLM row since 0.20 (on CUDA), transformers itself.
TARGET_RUNS = {
    "target-vllm": tuple(r for r in VERDICT_ROWS if r.startswith("vllm") and r != "vllm-rocm"),
    "target-transformers": ("transformers",),
}


@pytest.mark.parametrize("target,loaders", [("auto", tuple(VERDICT_ROWS)), *TARGET_RUNS.items()])
@pytest.mark.parametrize("source", list(SOURCES))
def test_the_default_conversion_never_loads_in_fewer_loaders(
    cases: dict[tuple[str, str], Case], loaded: dict[str, dict], source: str, target: str, loaders: tuple[str, ...]
) -> None:
    """What `convert SOURCE OUTPUT` (and `--target vllm` / `transformers`) writes loads correctly, for real, in
    at least the loaders (the target's loader) SOURCE does."""
    runnable = [loader for loader in loaders if (loader, source) not in CANNOT_RUN]

    def correct(layout: str) -> set[str]:
        case = cases[(source, layout)]
        return {
            loader
            for loader in runnable
            if outcome(loaded[loader][(source, layout)], case.truth, case.folder)[0] == "loads"
        }

    assert correct(target) >= correct("as-exported")


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("source", [s for s in CHANNEL_SOURCES if s.endswith("-shard")])
def test_channel_loads_bit_identical_where_every_other_layout_requantizes(
    cases: dict[tuple[str, str], Case], loaded: dict[str, dict], source: str, loader: str
) -> None:
    """Shards with different scales: the real loader computes with exactly the true weights from the
    channel output (vLLM: bit for bit; transformers: at its bf16 precision, `bf16_exact`; no requantization),
    and `auto` chose it."""
    case = cases[(source, "channel")]
    result = loaded[loader][(source, "channel")]
    assert result.loaded, result.error
    for module, expected in as_loaded(case.truth, result.weights).items():
        assert bf16_exact(result.weights[module], expected), module
    if loader in TARGET_RUNS["target-vllm"]:  # vLLM keeps float32 weights here: bit-identical, not merely within bf16
        assert all(torch.equal(result.weights[m], e) for m, e in as_loaded(case.truth, result.weights).items())
    if (source, "auto") in cases:  # `convert SOURCE OUTPUT` chose the channel layout
        auto = json.loads((cases[(source, "auto")].folder / "config.json").read_text())["quantization_config"]
        assert auto["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


#: compressed-tensors' own config model, in the transformers venv (which installs compressed-tensors):
#: the config must validate, and every key of it must be a field of the model (unknown keys it drops).
VALIDATE_CONFIG = """
import json, sys
from compressed_tensors.quantization import QuantizationConfig
for path in sys.argv[1:]:
    qc = json.load(open(path))["quantization_config"]
    dumped = QuantizationConfig.model_validate(qc).model_dump(mode="json", exclude_unset=True)
    print(json.dumps({"path": path, "same": dumped == qc, "dumped": dumped}))
"""


def test_channel_configs_are_what_compressed_tensors_reads(cases: dict[tuple[str, str], Case]) -> None:
    """Every channel output's quantization_config, read by compressed-tensors' QuantizationConfig: valid,
    nothing in it unknown to the library (its model drops unknown keys: the dump would differ)."""
    import subprocess

    configs = [str(cases[(source, "channel")].folder / "config.json") for source in CHANNEL_SOURCES]
    proc = subprocess.run(
        [interpreter("transformers"), "-c", VALIDATE_CONFIG, *configs], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(configs)
    for r in results:
        assert r["same"], f"{r['path']}: compressed-tensors reads it as {r['dumped']}"

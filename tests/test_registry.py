"""Every registered fused architecture, on tiny checkpoints whose rows follow the documented layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8fix.registry.architectures import Registry, module_variables
from fp8fix.registry.expressions import ExpressionError, evaluate
from tests.builders import FusedModule, Model, build, phi3
from tests.conftest import load_tensors, raw, run_cli
from tests.test_convert_layouts import reference_requantize

H = 64


def glm(arch: str) -> Model:
    config = {"architectures": [arch], "hidden_size": H, "intermediate_size": 96, "num_attention_heads": 4}
    return Model(arch, config, "model.layers.{i}.", 2, [FusedModule("mlp.gate_up_proj", [96, 96], H)])


def chatglm(mqa: bool) -> Model:
    config = {
        "architectures": ["ChatGLMForConditionalGeneration"],
        "hidden_size": H,
        "num_attention_heads": 4,
        "kv_channels": 16,
        "multi_query_attention": mqa,
        "multi_query_group_num": 2,
        "ffn_hidden_size": 96,
    }
    qkv = [64, 32, 32] if mqa else [64, 64, 64]  # q: heads*kv_channels; k, v: groups*kv_channels
    fused = [
        FusedModule("self_attention.query_key_value", qkv, H),
        FusedModule("mlp.dense_h_to_4h", [96, 96], H),
    ]
    return Model("ChatGLMForConditionalGeneration", config, "transformer.encoder.layers.{i}.", 2, fused)


def baichuan() -> Model:
    config = {"architectures": ["BaichuanForCausalLM"], "hidden_size": H, "num_attention_heads": 4}
    return Model("BaichuanForCausalLM", config, "model.layers.{i}.", 2, [FusedModule("self_attn.W_pack", [H] * 3, H)])


def dbrx() -> Model:
    config = {"architectures": ["DbrxForCausalLM"], "d_model": H, "n_heads": 4, "attn_config": {"kv_n_heads": 1}}
    fused = [FusedModule("attn.Wqkv", [H, 16, 16], H)]  # q: d_model; k, v: kv_n_heads * (d_model / n_heads)
    return Model("DbrxForCausalLM", config, "transformer.blocks.{i}.norm_attn_norm.", 2, fused)


# The layout `convert --format keep` picks (--target auto) for single-scale AutoFP8 sources: the one that
# loads correctly in the most loaders, vLLM >= 0.20 and transformers first (issue 11 items 1 and 2): GLM is
# served by vLLM 0.32's Transformers backend, which has only the fused names
# (vllm/model_executor/models/registry.py _TRANSFORMERS_SUPPORTED_MODELS), so unfused fails there; per-shard
# fails in every vLLM >= 0.5.1; Baichuan loads in no current loader (vLLM removed it in 0.23), so its
# per-shard and fused outputs tie at one old vLLM each and the architecture's default stands.
MODELS = {
    "glm": (glm("GlmForCausalLM"), "fused"),
    "glm4": (glm("Glm4ForCausalLM"), "unfused"),
    "chatglm-mqa": (chatglm(True), "fused"),
    "chatglm-mha": (chatglm(False), "fused"),
    "baichuan": (baichuan(), "per-shard"),
    "dbrx": (dbrx(), "fused"),
    "phi3": (phi3(), "unfused"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_default_layout_and_shard_rows(tmp_path: Path, name: str) -> None:
    model, layout = MODELS[name]
    src = build(tmp_path / "src", model, scale="tensor")
    result = run_cli("convert", src, tmp_path / "out", "--format", "keep", "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == layout
    assert len(report["modules"]) == model.layers * len(model.fused)
    for m in report["modules"]:
        fused = next(f for f in model.fused if m["module"].endswith(f.suffix))
        assert list(m["shards"].values()) == fused.rows


@pytest.mark.parametrize("name", list(MODELS))
def test_requantize_follows_the_shard_rows(tmp_path: Path, name: str) -> None:
    model, _ = MODELS[name]
    src = build(tmp_path / "src", model, scale="shard")
    assert run_cli("convert", src, tmp_path / "out", "--layout", "fused", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    for layer in range(model.layers):
        for f in model.fused:
            module = model.layer_prefix.format(i=layer) + f.suffix
            scales = s[f"{module}.weight_scale"]
            start = 0
            for i, rows in enumerate(f.rows):
                expected = reference_requantize(s[f"{module}.weight"][start : start + rows], scales[i], scales.max())
                assert raw(o[f"{module}.weight"][start : start + rows]) == raw(expected), (module, i)
                start += rows


def test_unfused_is_refused_where_runtimes_have_no_shard_names(tmp_path: Path) -> None:
    src = build(tmp_path / "src", chatglm(True))
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused")
    assert result.exit_code == 3
    assert "query_key_value" in result.output and "--layout per-shard" in result.output
    assert not (tmp_path / "out").exists()


def test_every_registry_entry_is_well_formed() -> None:
    registry = Registry.builtin().entries
    assert "Phi3ForCausalLM" in registry and "LlamaForCausalLM" in registry
    for spec in registry.values():
        for module in spec.fused_modules:
            assert len(module.shards) >= 2 and all(s.size for s in module.shards)


def test_expressions() -> None:
    config = {"a": 3, "b": {"c": 4}, "flag": False}

    def lookup(name: str):
        value = config
        for part in name.split("."):
            value = value[part]
        return value

    assert evaluate("a * b.c + 1", lookup) == 13
    assert evaluate("a if flag else b.c // 2", lookup) == 2
    with pytest.raises(ExpressionError):
        evaluate("__import__('os')", lookup)
    with pytest.raises(ExpressionError):
        evaluate("a ** 2", lookup)
    config["pattern"] = [0, 1, 1]  # a config list indexed by a module's layer (MiMo's hybrid_layer_pattern)
    assert evaluate("7 if pattern[2] else 9", lookup) == 7 and evaluate("pattern[a - 3]", lookup) == 0
    for bad, message in (("pattern[3]", "outside the config list of 3"), ("a[0]", "only a config list")):
        with pytest.raises(ExpressionError, match=message):
            evaluate(bad, lookup)


@pytest.mark.parametrize(
    "path, variables",
    [
        ("model.layers.12.self_attn.qkv_proj", {"layer": 12, "mtp": 0}),
        ("model.mtp.layers.1.self_attn.qkv_proj", {"layer": 1, "mtp": 1}),
        ("transformer.h.3.attn.c_attn", {"layer": 0, "mtp": 0}),
    ],
)
def test_module_variables(path: str, variables: dict[str, int]) -> None:
    assert module_variables(path) == variables


def test_arch_file_teaches_an_unknown_architecture(tmp_path: Path) -> None:
    config = {"architectures": ["TinyFusedForCausalLM"], "hidden_size": H, "num_attention_heads": 4}
    model = Model("TinyFusedForCausalLM", config, "model.layers.{i}.", 2, [FusedModule("attn.qkv", [64, 16, 16], H)])
    src = build(tmp_path / "src", model)
    refused = run_cli("convert", src, tmp_path / "out")
    assert refused.exit_code == 3 and "--arch-file" in refused.output
    entry = {
        "architectures": ["TinyFusedForCausalLM"],
        "defaults": {"head_dim": "hidden_size // num_attention_heads"},
        "fused_modules": [
            {
                "module": "attn.qkv",
                "shards": [
                    {"shard": "q", "rows": "hidden_size", "unfused": "attn.q"},
                    {"shard": "k", "rows": "head_dim", "unfused": "attn.k"},
                    {"shard": "v", "rows": "head_dim", "unfused": "attn.v"},
                ],
            }
        ],
    }
    arch_file = tmp_path / "tiny.json"
    arch_file.write_text(json.dumps(entry))
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "--arch-file", arch_file, "-q")
    assert result.exit_code == 0, result.output
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    assert raw(o["model.layers.1.attn.k.weight"]) == raw(s["model.layers.1.attn.qkv.weight"][64:80])
    assert run_cli("inspect", src, "--arch-file", arch_file).exit_code == 0


def test_a_bad_arch_file_is_a_usage_error(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    bad = tmp_path / "bad.json"
    bad.write_text('{"architectures": ["X"], "fused_modules": [{"module": "m", "shards": [{"shard": "a"}]}]}')
    result = run_cli("convert", src, tmp_path / "out", "--arch-file", bad)
    assert result.exit_code == 2 and "bad.json" in result.output


PHI3_ENTRY = Path(__file__).parent.parent / "fp8fix/registry/architectures/phi3.json"


def phi3_entry_with(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """The built-in Phi-3 entry with one change, as a user's --arch-file."""
    entry = json.loads(PHI3_ENTRY.read_text())
    change(entry)
    path = tmp_path / "phi3-edit.json"
    path.write_text(json.dumps(entry))
    return path


def typo_in_shard(entry: dict) -> None:
    shard = entry["fused_modules"][0]["shards"][0]
    shard["unfuse"] = shard.pop("unfused")


def cyclic_defaults(entry: dict) -> None:
    entry["defaults"] = {"head_dim": "kv_dim // 2", "kv_dim": "head_dim * 2"}
    entry["fused_modules"][0]["shards"][0]["rows"] = "head_dim"


@pytest.mark.parametrize(
    "change,message",
    [
        (typo_in_shard, "unknown key 'unfuse' in fused_modules[0].shards[0]"),
        (cyclic_defaults, "defaults are cyclic"),
        (lambda e: e["fused_modules"][1]["shards"][0].update(rows="intermediate_size // 0"), "divides by zero"),
        (lambda e: e["fused_modules"][1]["shards"][0].update(rows=" + ".join(["1"] * 20_000)), "500 characters"),
        (lambda e: e["fused_modules"][1]["shards"][0].update(rows=" + ".join(["1"] * 60)), "more than 100 terms"),
        (lambda e: e["fused_modules"][0].update(module=7), "fused_modules[0].module must be a str"),
        (lambda e: e["fused_modules"][1]["shards"][0].update(rows="intermediate_size ** 2"), "unsupported syntax"),
        (lambda e: e.update(defaults={"head_dim": "hidden_size / 2"}), "defaults.head_dim"),
        (lambda e: e["fused_modules"][1].update(shards=e["fused_modules"][1]["shards"][:1]), "at least 2"),
        (lambda e: e["fused_modules"][1].pop("shards"), "fused_modules[1] has no 'shards'"),
        (lambda e: e["fused_modules"][0].update(block_grid="per-group"), "'per-group' with groups"),
        (lambda e: e["fused_modules"][0].update(block_grid="chunked"), "block_grid of self_attn.qkv_proj"),
    ],
)
def test_a_malformed_entry_is_refused_when_loaded(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    src = build(tmp_path / "src", phi3())
    arch_file = phi3_entry_with(tmp_path, change)
    for command in (["convert", src, tmp_path / "out"], ["inspect", src], ["verify", src, src]):
        result = run_cli(*command, "--arch-file", arch_file)
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output and "phi3-edit.json" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_every_builtin_entry_follows_the_schema() -> None:
    """Loading validates: each built-in file parses with no unknown key and every expression evaluates."""
    folder = PHI3_ENTRY.parent
    names = {name for path in folder.glob("*.json") for name in json.loads(path.read_text())["architectures"]}
    assert set(Registry.builtin().entries) == names


def test_arch_files_do_not_outlive_the_command(tmp_path: Path) -> None:
    """The registry is passed to each command, not kept in a module global: a later command without
    --arch-file does not see an earlier one's entry."""
    entry = json.loads(PHI3_ENTRY.read_text())
    entry["architectures"] = ["MyPhiForCausalLM"]
    arch_file = tmp_path / "my-phi.json"
    arch_file.write_text(json.dumps(entry))
    model = phi3()
    model.config["architectures"] = ["MyPhiForCausalLM"]
    src = build(tmp_path / "src", model)
    assert run_cli("convert", src, tmp_path / "with", "--arch-file", arch_file, "-q").exit_code == 0
    refused = run_cli("convert", src, tmp_path / "without", "-q")
    assert refused.exit_code == 3 and "MyPhiForCausalLM is not in fp8fix's registry" in refused.output


@pytest.mark.parametrize("heads,message", [(0, "divides by zero"), ("4", "not a whole number")])
def test_config_values_that_cannot_size_a_shard(tmp_path: Path, heads: object, message: str) -> None:
    src = build(tmp_path / "src", phi3())
    config = json.loads((src / "config.json").read_text())
    config["num_attention_heads"] = heads
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3 and "config.json: cannot size" in result.output and message in result.output


def test_every_loader_rule_cites_what_a_reader_can_open() -> None:
    """Each rule's evidence (and each default's) names a loader's source file and function, at a release,
    or a test file of this repository that exists: nothing outside what ships, nothing empty (issue 27)."""
    import re as regex

    from fp8fix.registry.loaders import DEFAULT_EVIDENCE, MX_RULES, RULES

    root = Path(__file__).resolve().parent.parent
    source = regex.compile(r"\b(vllm|transformers|compressed-tensors|sglang) [\d.x-]+ [\w/]+\.py \w+")
    for evidence in [r.evidence for r in (*RULES, *MX_RULES)] + list(DEFAULT_EVIDENCE.values()):
        tests = regex.findall(r"\btests/[\w/]+\.py", evidence)
        assert tests or source.search(evidence), evidence
        assert all((root / t).is_file() for t in tests), evidence
        assert "shared/" not in evidence and "reference" not in evidence, evidence


def test_shard_sizes_worked_out_once_per_spec_are_each_modules_own() -> None:
    """`SizeMemo` (issue 30) sizes a module spec once per value of the path variables its expressions read:
    for every module of a MiMo-V2.5-like config (sliding-window and full layers by `hybrid_layer_pattern[layer]`,
    MTP layers by `mtp`, which skips `layer`), in shuffled order, its layout equals one worked out on its own
    with a fresh memo, the memo's reuse included (a Phi-3's sizes read no variable)."""
    import random

    from fp8fix.registry.architectures import SizeMemo
    from tests.builders import mimo_v2_config

    reg = Registry.builtin()
    config = mimo_v2_config(layers=6)
    config["hybrid_layer_pattern"] = [1, 0, 0, 1, 1, 0]
    config["num_key_value_heads"], config["swa_num_key_value_heads"] = 2, 4
    paths = [f"model.layers.{i}.self_attn.qkv_proj" for i in range(6)] + ["model.mtp.layers.0.self_attn.qkv_proj"]
    paths += ["model.mtp.layers.3.self_attn.qkv_proj", "model.layers.4.mtp.self_attn.qkv_proj"]
    arch = reg.get("MiMoV2ForCausalLM")
    assert arch is not None
    phi = reg.get("Phi3ForCausalLM")
    assert phi is not None
    phi_config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
    cases = [(arch, config, p) for p in paths] + [
        (phi, phi_config, f"model.layers.{i}.self_attn.qkv_proj") for i in range(4)
    ]
    cases += [(phi, phi_config, f"model.layers.{i}.mlp.gate_up_proj") for i in range(4)]
    random.Random(0).shuffle(cases)
    memos = {id(phi): SizeMemo(), id(arch): SizeMemo()}
    distinct = set()
    for spec_of, cfg, path in cases:
        spec = spec_of.fused_spec_for(path)
        assert spec is not None, path
        alone = spec_of.row_layout(spec, cfg, path)
        assert spec_of.row_layout(spec, cfg, path, memo=memos[id(spec_of)]) == alone, path
        distinct.add((spec_of is arch, tuple(alone[0])))
    assert len(distinct) >= 3  # full and sliding-window MiMo layers differ, and Phi-3's

"""Which loaders take a checkpoint, computed from what the checkpoint is (headers + config only).

One function for every command: `inspect` applies it to the checkpoint it reads,
`convert` to the checkpoint it writes (described from the plan's output headers, which
the writer writes byte for byte), so the two can never disagree. The knowledge itself is
data in `registry.loaders`; this module only works out the facts its rules ask about.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.model import CheckpointModel
from fp8fix.registry.formats import LEGACY_RENAMES
from fp8fix.registry.loaders import LOADERS, LOADS_BECAUSE, RULES
from fp8fix.vocab import Verdict

#: Architectures vLLM 0.32 serves through its Transformers backend (fused module names only):
#: vllm/model_executor/models/registry.py _TRANSFORMERS_SUPPORTED_MODELS.
VLLM_TRANSFORMERS_BACKEND = frozenset({"GlmForCausalLM", "GPTNeoXForCausalLM"})
#: Architectures vLLM removed (ibid., _PREVIOUSLY_SUPPORTED_MODELS): BaichuanForCausalLM in 0.23.0.
VLLM_REMOVED = frozenset({"BaichuanForCausalLM", "BaiChuanForCausalLM"})
#: Architectures transformers 5.24 has no model for (models/auto: MiMo-V2.5's `mimo_v2` is absent, only
#: `mimo_v2_flash`); loading needs the repository's own code.
TRANSFORMERS_MISSING = frozenset({"MiMoV2ForCausalLM"})


#: What each fact means, for the README's table of rules (scripts/loader_tables.py).
FACT_DESCRIPTIONS = {
    "unusable_scales": "an FP8 weight without a usable scale",
    "per_shard_fused": "a fused module with one weight scale per shard",
    "one_scale_fused": "a fused module with one weight scale (or per-channel / block scales)",
    "chunked_fused": "a fused module pre-sharded in chunks, each with its own block grid (MiMo-V2.5)",
    "channel_fused": "every fused module with per-channel weight scales ([out, 1], one per row)",
    "per_shard_input_scales": "a fused module with one static input scale per shard",
    "unfused_names": "per-shard module names (q_proj, ...) where the model fuses them",
    "unfused_on_transformers_backend": "per-shard names, and an architecture vLLM serves through its "
    "Transformers backend (GLM, GPT-NeoX)",
    "vllm_removed_architecture": "an architecture vLLM removed (Baichuan)",
    "transformers_missing_architecture": "an architecture transformers has no model for (MiMo-V2.5)",
    "fp8_per_tensor": "quant_method fp8 without weight_block_size (AutoFP8)",
    "channel_scales_under_fp8": "quant_method fp8 with per-channel weight scales",
    "legacy_names": "the legacy AutoFP8 names act_scale / kv_scale",
    "refused_at_tp_1": "a block-scaled module vLLM refuses at TP 1 (`inspect --tp 1` names it, with the message)",
    "misaligned_block_shards": "block scales, and a module vLLM packs with others (q / k / v, gate / up) whose "
    "scales its loader does not line up with the rows at TP 1 (`inspect --tp 1`: wrong-scales)",
    "fbgemm": "quant_method fbgemm_fp8",
}


@dataclass(frozen=True)
class Facts:
    """What the loaders' rules ask about a checkpoint."""

    architecture: str
    unusable_scales: bool  # an FP8 weight without a scale, or one of no known shape
    per_shard_fused: bool  # a fused linear module with one weight scale per shard
    one_scale_fused: bool  # a fused linear module with a single (or per-channel / block) weight scale
    chunked_fused: bool  # a fused module stored in pre-sharded chunks with a block grid per chunk
    channel_fused: bool  # every fused FP8 module with per-channel weight scales (one per row)
    per_shard_input_scales: bool  # a fused module's static input scale with one value per shard
    unfused_names: bool  # per-shard module names where the registry knows a fused module
    unfused_on_transformers_backend: bool
    vllm_removed_architecture: bool
    transformers_missing_architecture: bool
    fp8_per_tensor: bool  # quant_method fp8 without weight_block_size (AutoFP8)
    channel_scales_under_fp8: bool
    legacy_names: bool  # act_scale / kv_scale
    fbgemm: bool
    refused_at_tp_1: bool = False  # `inspect --tp 1` reports a module vLLM refuses (parallel.py)
    misaligned_block_shards: bool = False  # `inspect --tp 1` reports a packed layer's scales shifted (wrong-scales)

    @property
    def layout(self) -> str:
        if self.unfused_names:
            return "unfused"
        if self.channel_fused:
            return "channel"
        return "fused" if self.one_scale_fused or self.per_shard_fused else ""


@dataclass(frozen=True)
class LoaderVerdict:
    verdict: Verdict
    reason: str
    evidence: str  # the loader source or real-loader test behind it ("" for the plain default)

    @property
    def loads(self) -> bool:
        return self.verdict == "loads"


def verdicts_json(verdicts: dict[str, LoaderVerdict]) -> dict[str, dict[str, object]]:
    """The verdicts as JSON: `loads` (kept from schema 1), `verdict`, `reason`, `evidence`."""
    return {
        loader: {"loads": v.loads, "verdict": v.verdict, "reason": v.reason, "evidence": v.evidence}
        for loader, v in verdicts.items()
    }


def facts_of(model: CheckpointModel) -> Facts:
    weights = [w for w in model.weights.values() if w.is_module_weight]
    fused = [w for w in weights if w.fused is not None]
    unfused_suffixes = tuple(
        s.unfused for spec in (model.spec.fused_modules if model.spec else ()) for s in spec.shards if s.unfused
    )
    unfused = not fused and bool(unfused_suffixes) and any(w.module.endswith(unfused_suffixes) for w in weights)
    fmt = model.format
    fp8 = model.is_autofp8
    architecture = model.architecture or ""
    at_tp_1 = _at_tp_1(model)
    return Facts(
        architecture=architecture,
        unusable_scales=any(w.scale_kind is None for w in weights),
        per_shard_fused=any(w.scale_kind == "shard" for w in fused),
        one_scale_fused=any(w.scale_kind in ("tensor", "channel", "block") for w in fused),
        chunked_fused=any(w.fused is not None and w.fused.spec.block_grid == "per-group" for w in fused),
        channel_fused=bool(fused) and all(w.scale_kind == "channel" for w in fused),
        per_shard_input_scales=any(
            w.input_scale is not None and w.n_shards > 1 and w.input_scale.shape == (w.n_shards,) for w in fused
        ),
        unfused_names=unfused,
        unfused_on_transformers_backend=unfused and architecture in VLLM_TRANSFORMERS_BACKEND,
        vllm_removed_architecture=architecture in VLLM_REMOVED,
        transformers_missing_architecture=architecture in TRANSFORMERS_MISSING,
        fp8_per_tensor=fp8,
        channel_scales_under_fp8=fp8 and any(w.scale_kind == "channel" for w in weights),
        legacy_names=any(name.endswith(tuple(LEGACY_RENAMES)) for name in model.checkpoint.tensors),
        fbgemm=fmt is not None and fmt.name == "fbgemm_fp8",
        refused_at_tp_1="refuses" in at_tp_1,
        misaligned_block_shards="wrong-scales" in at_tp_1,
    )


def _at_tp_1(model: CheckpointModel) -> set[str]:
    """What `inspect --tp 1` reports of block-scaled modules (behaviours): a loader verdict is one at TP 1."""
    from fp8fix.parallel import shares_at

    return {s.behaviour for s in shares_at(model, 1)}


def loader_verdicts(model: CheckpointModel) -> dict[str, LoaderVerdict]:
    """Per loader: the first rule of `registry.loaders.RULES` that holds, else it loads."""
    facts = facts_of(model)
    verdicts: dict[str, LoaderVerdict] = {}
    for loader in LOADERS:
        rule = next((r for r in RULES if r.loader == loader and getattr(facts, r.condition)), None)
        if rule is not None:
            reason = rule.reason.format(architecture=facts.architecture)
            verdicts[loader] = LoaderVerdict(rule.verdict, reason, rule.evidence)
        elif not facts.layout:
            verdicts[loader] = LoaderVerdict("loads", "no fused modules", "")
        elif facts.layout not in LOADS_BECAUSE[loader]:
            verdicts[loader] = LoaderVerdict("fails", f"no rule says it loads the {facts.layout} layout", "")
        else:
            verdicts[loader] = LoaderVerdict("loads", LOADS_BECAUSE[loader][facts.layout], "")
    return verdicts

"""The one rule behind every gate (`inspect --strict`), derived from the loader rows.

A row needs acting on when it is one of the target's loaders and does not load SOURCE correctly, or when
the conversion `convert --target TARGET` would write makes a row load that does not load SOURCE and costs
no row that does (convert would fix something, at no price). With `--tp N`, vLLM 0.32 at TP N is a row of
the target too: a module it refuses (`fails`) or whose rows get other blocks' scales (`loads-wrong`).
Nothing else decides a gate: inspect's findings for these rows are made here, from the rows and from the
plans of the commands that could fix them (each planned, its output judged by the same rules), so the
exit code, the findings and what convert writes cannot disagree.

A plan that trades rows (a loader outside the target that loaded SOURCE for one that did not) fixes
nothing: which rows matter is what `--target` says, so a gate does not fail on the trade, and converting
the default conversion's output again never finds something left to fix (tests/test_gate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fp8fix.errors import Fp8fixError
from fp8fix.model import CheckpointModel
from fp8fix.numerics.dtypes import E4M3FNUZ
from fp8fix.parallel import shares_at
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.plan.target_plan import plan_for_target
from fp8fix.plan.targets import TARGET_LOADERS, Candidate, best, candidates
from fp8fix.registry.loader_rows import VLLM
from fp8fix.verdicts import LoaderVerdict, Rounding, loader_verdicts, scanned
from fp8fix.vocab import Target, Verdict


@dataclass(frozen=True)
class Row:
    """One row a gate fails on: what it says of SOURCE, and the command that makes it load, if any."""

    loader: str  # a `registry.loaders.LOADERS` name, or `tp_row(N)`
    verdict: Verdict  # SOURCE's
    reason: str
    in_target: bool  # one of the target's loaders (or the TP N row asked for)
    fix: str | None  # `fp8fix convert SOURCE OUTPUT` options whose output this row loads; None: none of them
    #: loaders that load SOURCE correctly and would not load the fix's output correctly (the fix's price)
    trade_off: tuple[str, ...] = ()

    @property
    def code(self) -> str:
        """The finding's code: `row-fails` (-loads-wrong, -not-judged) for a target row, `row-improved` for a
        row outside the target that the default conversion makes load."""
        return f"row-{self.verdict}" if self.in_target else "row-improved"


def tp_row(tp: int) -> str:
    """The row of `inspect --tp N`: vLLM 0.32's loading at that tensor-parallel size (`fp8fix.parallel`)."""
    return f"{VLLM} at TP {tp}"


#: What vLLM does with block shares that are not whole, as a row verdict (parallel.ModuleShare.behaviour).
TP_VERDICTS: dict[str, Verdict] = {"refuses": "fails", "wrong-scales": "loads-wrong"}


def default_candidate(model: CheckpointModel, target: Target) -> Candidate | None:
    """The candidate `convert --target TARGET` chooses without other options (`plan.targets.best`), judged
    on the whole checkpoint's verdicts; None where convert refuses SOURCE."""
    try:
        model.require_format()
        _, spec = model.require_architecture()
        model.require_convertible()
        found = model.once("candidates", candidates)
    except Fp8fixError:
        return None
    return best(found, target, spec.default_layout) if found else None


def default_options(candidate: Candidate, target: Target) -> str:
    """The options that name what `convert --target TARGET` writes: its layout, and format where it changes."""
    written_as = f" --format {candidate.output_format}" if candidate.output_format != "keep" else ""
    aimed = f" --target {target}" if target != "auto" else ""
    return f"--layout {candidate.layout}{written_as}{aimed}"


def gate_rows(
    model: CheckpointModel, target: Target = "auto", tp: Sequence[int] = (), rounding: Rounding | None = None
) -> list[Row]:
    """Every row a gate for `target` fails on, in `LOADERS` order, then each TP size asked for; `rounding`: what
    a scan of SOURCE's e4m3fnuz codes found (the rows inspect prints with `--scan-data`, `verdicts.scanned`)."""
    now = scanned(loader_verdicts(model), rounding)
    chosen = default_candidate(model, target)
    after = chosen.plan.loaders if chosen is not None else None

    def planned(**options: object) -> dict[str, LoaderVerdict] | None:
        try:
            return plan_for_target(model, None, target=target, **options).loaders  # type: ignore[arg-type]
        except (Fp8fixError, OSError):  # refused, or a Hub source (headers only)
            return None

    alternatives: list[tuple[str, Callable[[], dict[str, LoaderVerdict] | None]]] = []
    if chosen is not None:
        alternatives.append((default_options(chosen, target), lambda: after))
    if any(w.tensor.dtype == E4M3FNUZ for w in model.module_weights()):
        alternatives.append(("--to e4m3fn", lambda: planned(to="e4m3fn")))
    alternatives.append(("--to bf16", lambda: planned(to="bf16")))
    tried: dict[str, dict[str, LoaderVerdict] | None] = {}

    def fix_for(loader: str) -> tuple[str | None, tuple[str, ...]]:
        for options, plan in alternatives:
            if options not in tried:
                tried[options] = plan()
            rows = tried[options]
            if rows is not None and rows[loader].loads:
                lost = tuple(name for name, v in now.items() if v.loads and not rows[name].loads)
                return options, lost
        return None, ()

    wanted = TARGET_LOADERS[target]
    # the default conversion fixes a row outside the target only where it costs none: a plan that trades
    # rows is the target's choice (what `--target` is for), not something left to fix
    costs = after is None or any(v.loads and not after[name].loads for name, v in now.items())
    found = []
    for loader, v in now.items():
        improved = not costs and after is not None and not v.loads and after[loader].loads
        if v.loads or (loader not in wanted and not improved):
            continue
        fix, lost = fix_for(loader)
        found.append(Row(loader, v.verdict, v.reason, loader in wanted, fix, lost))
    for size in tp:
        found += _tp_rows(model, size, target)
    return found


def _tp_rows(model: CheckpointModel, tp: int, target: Target) -> list[Row]:
    """vLLM 0.32 at TP `tp`: a row when some block share is refused or misread (`fp8fix.parallel`), with the
    first of `--tp N`, `--tp N --tp-bf16` whose output has no such share."""
    verdicts = [TP_VERDICTS[s.behaviour] for s in shares_at(model, tp) if s.behaviour in TP_VERDICTS]
    if not verdicts:
        return []
    verdict: Verdict = "fails" if "fails" in verdicts else "loads-wrong"
    what = "refuses" if verdict == "fails" else "misreads"
    reason = f"a block-scaled module vLLM {what} at TP {tp} (inspect --tp {tp} names it)"
    fix = None
    for options, bf16 in ((f"--tp {tp}", False), (f"--tp {tp} --tp-bf16", True)):
        try:
            plan = plan_for_target(model, None, target=target, tp=tp, tp_bf16=bf16)
        except (Fp8fixError, OSError):
            continue
        if not any(s.behaviour in TP_VERDICTS for s in shares_at(output_model(plan, model), tp)):
            fix = options
            break
    return [Row(tp_row(tp), verdict, reason, True, fix)]


def no_loader_warning(plan: ConversionPlan) -> str | None:
    """What convert says at once when no judged loader reads its OUTPUT exactly (every row not `loads`)
    while some reads SOURCE: the output is for none of them (`--to e4m3fnuz`: every vLLM, ROCm included,
    and SGLang cast the codes into e4m3fn). None where some row loads OUTPUT, or none loads SOURCE either."""
    if any(v.loads for v in plan.loaders.values()):
        return None
    source = [name for name, v in plan.source_loaders.items() if v.loads]
    if not source:
        return None
    rounded = [name for name, v in plan.loaders.items() if v.verdict == "rounded"]
    said = f"no loader fp8fix judges loads OUTPUT exactly; SOURCE loads in {', '.join(source)}"
    if rounded:
        said += f" (OUTPUT: rounded by at most half an fp8 step in {', '.join(rounded)})"
    if plan.encoding is not None and plan.encoding.target == "e4m3fnuz":
        said += (
            ": every vLLM (on ROCm too) and SGLang cast e4m3fnuz weights into e4m3fn, rounding odd subnormal codes, "
            "and vLLM on ROCm (MI300) converts an e4m3fn checkpoint to e4m3fnuz itself, in the right order: serve "
            "the e4m3fn checkpoint (convert without --to); --to e4m3fnuz is for runtimes that read e4m3fnuz "
            "checkpoints as they are, none of which fp8fix judges"
        )
    return said

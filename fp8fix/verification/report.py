"""What verify found: one record per FP8 weight, counts, and the problems (capped) that make it fail.

A weight's record is what its check measured, never a default: a difference makes it `mismatch` (with the
codes that differ and the first difference), and the summary and the problems are counted from the records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from fp8fix.vocab import SCHEMA_VERSION, WeightVerdict

MAX_PROBLEMS = 50
#: The classes of OUTPUT's files verify checks, each named in text and JSON (`classes`): the weights and what the
#: config says of them; what fp8fix wrote about them (the model card's facts); the files copied from SOURCE, and
#: OUTPUT holding no other file.
WEIGHTS, METADATA, COPIED = "weights-and-config", "metadata", "copied-files"
CLASS_NAMES = {WEIGHTS: "weights and config", METADATA: "model card facts", COPIED: "files copied from SOURCE"}
_RANK = {"exact": 0, "rounded": 1, "requantized": 2, "mismatch": 3}


@dataclass
class WeightCheck:
    tensor: str
    targets: list[str]
    kind: WeightVerdict
    max_error: float = 0.0
    max_error_steps: float = 0.0
    rounded_codes: int = 0
    mismatched_codes: int = 0  # codes (or values) found different from SOURCE's, kind `mismatch`
    mismatch: str | None = None  # what differs first (the largest difference of its row run), kind `mismatch`
    grid: str = "fp8"  # whose steps `max_error_steps` counts (requantized NVFP4: E2M1's)

    def grade(self, kind: WeightVerdict) -> None:
        """A loss found in some rows: the record takes the worst found so far (exact < rounded < requantized <
        mismatch), so rows checked after a difference never make it look better."""
        if _RANK.get(kind, 0) > _RANK.get(self.kind, 0):
            self.kind = kind

    def mismatched(self, text: str, codes: int = 0) -> None:
        """A difference found in this weight: the record says so, and keeps the first one's description."""
        self.kind = "mismatch"
        self.mismatched_codes += codes
        self.mismatch = self.mismatch or text

    def problem(self) -> str | None:
        """The report's problem for this record (None unless `mismatch`)."""
        if self.kind != "mismatch":
            return None
        count = f" ({self.mismatched_codes} values differ)" if self.mismatched_codes > 1 else ""
        return f"{self.mismatch}{count}"


@dataclass
class VerifyReport:
    source: str
    output: str
    weights: list[WeightCheck] = field(default_factory=list)
    identical_tensors: int = 0
    scales_checked: int = 0
    problems: list[str] = field(default_factory=list)
    #: [K, N] when only the K-th of N shares of the tensors was checked (`verify --part`).
    part: list[int] | None = None
    #: The problems again, by class of file (WEIGHTS, METADATA, COPIED).
    classes: dict[str, list[str]] = field(default_factory=lambda: {c: [] for c in CLASS_NAMES})
    #: `verify --accept-edits`: the card's facts and the files fp8fix did not write are edits, listed, not problems.
    accept_edits: bool = False
    edits: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: str, kind: str = WEIGHTS, edit: bool = False) -> None:
        """A difference of class `kind`; `edit`: one a person may have made on purpose (the card, a file added),
        listed in `edits` instead with `--accept-edits`."""
        if edit and self.accept_edits:
            self.edits.append(text)
        elif len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
            self.classes[kind].append(text)

    def add(self, check: WeightCheck | None) -> None:
        """A weight's record, and its problem where it is a mismatch: one fact, said once."""
        if check is None:
            return
        self.weights.append(check)
        text = check.problem()
        if text is not None:
            self.problem(text)

    def merge(self, other: VerifyReport) -> None:
        """Add the findings of another part of the same verification (a worker's run of tensors)."""
        self.weights += other.weights
        self.identical_tensors += other.identical_tensors
        self.scales_checked += other.scales_checked
        for kind, texts in other.classes.items():
            for text in texts:
                self.problem(text, kind)
        self.edits += other.edits

    def mismatched_values(self) -> int:
        return sum(w.mismatched_codes for w in self.weights)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self), "ok": self.ok}

    def summary(self) -> str:
        kinds = {k: sum(w.kind == k for w in self.weights) for k in get_args(WeightVerdict)}

        def worst_of(kind: str, grid: str | None = None) -> float | None:
            steps = (w.max_error_steps for w in self.weights if w.kind == kind and grid in (None, w.grid))
            return max(steps, default=None)

        worst, e2m1, rounded = worst_of("requantized", "fp8"), worst_of("requantized", "E2M1"), worst_of("dequantized")
        return (
            (f"part {self.part[0]}/{self.part[1]}: " if self.part else "")
            + f"{len(self.weights)} quantized weights ({kinds['exact']} exact, {kinds['rounded']} with rounded codes, "
            f"{kinds['requantized']} requantized"
            + (f", max {worst:.2f} fp8 steps" if worst is not None else "")
            + (f", max {e2m1:.2f} E2M1 steps (NVFP4)" if e2m1 is not None else "")
            + (f", {kinds['dequantized']} unquantized, max {rounded:.2f} steps" if rounded is not None else "")
            + (f", {kinds['mismatch']} MISMATCHED: {self.mismatched_values()} values" if kinds["mismatch"] else "")
            + f"), {self.scales_checked} input scales, {self.identical_tensors} tensors byte-identical"
            + (f"; {len(self.problems)} problem(s)" if self.problems else "")
        )

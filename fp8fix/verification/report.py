"""What verify found: one record per FP8 weight, counts, and the problems (capped) that make it fail."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fp8fix.vocab import SCHEMA_VERSION, WeightVerdict

MAX_PROBLEMS = 50


@dataclass
class WeightCheck:
    tensor: str
    targets: list[str]
    kind: WeightVerdict
    max_error: float = 0.0
    max_error_steps: float = 0.0
    rounded_codes: int = 0


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

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def merge(self, other: VerifyReport) -> None:
        """Add the findings of another part of the same verification (a worker's run of tensors)."""
        self.weights += other.weights
        self.identical_tensors += other.identical_tensors
        self.scales_checked += other.scales_checked
        for text in other.problems:
            self.problem(text)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self), "ok": self.ok}

    def summary(self) -> str:
        kinds = {k: sum(w.kind == k for w in self.weights) for k in ("exact", "rounded", "requantized", "dequantized")}
        worst = max((w.max_error_steps for w in self.weights if w.kind == "requantized"), default=None)
        rounded = max((w.max_error_steps for w in self.weights if w.kind == "dequantized"), default=None)
        return (
            (f"part {self.part[0]}/{self.part[1]}: " if self.part else "")
            + f"{len(self.weights)} FP8 weights ({kinds['exact']} exact, {kinds['rounded']} with rounded codes, "
            f"{kinds['requantized']} requantized"
            + (f", max {worst:.2f} fp8 steps" if worst is not None else "")
            + (f", {kinds['dequantized']} in BF16, max {rounded:.2f} BF16 steps" if rounded is not None else "")
            + f"), {self.scales_checked} input scales, {self.identical_tensors} tensors byte-identical"
        )

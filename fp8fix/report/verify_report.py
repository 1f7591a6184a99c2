"""`verify`'s report for people: the verdict and summary, then every weight that is not exact and every problem."""

from __future__ import annotations

from fp8fix.verification.report import CLASS_NAMES, VerifyReport


def verify_lines(report: VerifyReport, verbose: bool = False) -> list[str]:
    """The verdict and summary, every weight not exact (every weight with `verbose`), every problem."""
    lines = [f"{'faithful' if report.ok else 'MISMATCH'}: {report.summary()}"]
    for w in report.weights:
        if verbose and w.kind == "exact":
            lines.append(f"  exact       {w.tensor}")
        elif w.kind == "mismatch":  # what differs is in the problems below
            lines.append(f"  mismatch    {w.tensor}: {w.mismatched_codes or 'no'} values counted different")
        elif w.kind != "exact":
            rounded = f", {w.rounded_codes} codes rounded" if w.rounded_codes else ""
            grid = "BF16" if w.kind == "dequantized" else w.grid  # the steps of the values it was rounded to
            error = f"max error {w.max_error:.3g} ({w.max_error_steps:.2f} {grid} steps)"
            lines.append(f"  {w.kind:<11} {w.tensor}: {error}{rounded}")
    lines += [f"  problem: {p}" for p in report.problems]
    lines += [f"  edit (accepted): {e}" for e in report.edits]
    checked = [f"{name} {_count(len(report.classes[kind]))}" for kind, name in CLASS_NAMES.items()]
    lines.append("  checked: " + "; ".join(checked))
    return lines


def _count(problems: int) -> str:
    return "ok" if not problems else f"{problems} difference{'s' if problems > 1 else ''}"

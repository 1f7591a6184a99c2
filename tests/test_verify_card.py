"""verify checks every file of OUTPUT in three classes (issue 48): the weights and config, the model card's facts
(what it was converted from, the layout, the loader table as fp8fix's rules say for OUTPUT as it is) and the files
copied from SOURCE. A false fact fails (exit 1, in its class); a human edit that keeps the facts passes;
`--accept-edits` lists card facts and added files as edits instead of failing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import build, glm, phi3
from tests.conftest import load_tensors, run_cli


def edit_card(folder: Path, old: str, new: str) -> None:
    card = (folder / "README.md").read_text()
    assert old in card, card
    (folder / "README.md").write_text(card.replace(old, new, 1))


def other_source(folder: Path) -> None:
    edit_card(folder, "Converted from `src`", "Converted from `meta-llama/Llama-3.1-8B-Instruct-FP8`")


def altered_row(folder: Path) -> None:
    card = (folder / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| transformers | "))
    edit_card(
        folder,
        row,
        "| transformers | loads | as edited by hand |"
        if "| loads |" not in row
        else row.replace("| loads |", "| fails |"),
    )


def layout_line(folder: Path) -> None:
    edit_card(folder, "- Layout: **fused**", "- Layout: **per-shard**")


def added_file(folder: Path) -> None:
    (folder / "EVAL.md").write_text("our evaluation\n")


#: edit -> (the class it is a difference of, a word of the problem)
FALSE_FACTS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "another source": (other_source, "metadata", "meta-llama/Llama-3.1-8B-Instruct-FP8"),
    "an altered verdict row": (altered_row, "metadata", "transformers"),
    "the layout line": (layout_line, "metadata", "per-shard"),
    "a file fp8fix did not write": (added_file, "copied-files", "EVAL.md"),
}


@pytest.fixture
def converted(tmp_path: Path) -> tuple[Path, Path]:
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "-q").exit_code == 0
    return src, out


@pytest.mark.parametrize("case", list(FALSE_FACTS))
def test_a_false_fact_fails_in_its_class_and_accept_edits_lists_it(converted: tuple[Path, Path], case: str) -> None:
    src, out = converted
    edit, kind, word = FALSE_FACTS[case]
    edit(out)
    result = run_cli("verify", src, out, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and not report["ok"]
    assert [k for k, problems in report["classes"].items() if problems] == [kind], report["classes"]
    assert any(word in p for p in report["classes"][kind]) and report["problems"] == report["classes"][kind]
    text = run_cli("verify", src, out).output
    assert "checked: weights and config ok;" in text and "1 difference" in text
    accepted = run_cli("verify", src, out, "--accept-edits", "--json")
    report = json.loads(accepted.stdout)
    assert accepted.exit_code == 0 and report["ok"] and any(word in e for e in report["edits"]), report


def test_human_edits_that_keep_the_facts_pass(converted: tuple[Path, Path]) -> None:
    src, out = converted
    edit_card(out, "## FP8 conversion by fp8fix", "We serve this model at example.com.\n\n## FP8 conversion by fp8fix")
    (out / "README.md").write_text((out / "README.md").read_text() + "\n## Our notes\n\nWorks with vLLM 0.32.\n")
    result = run_cli("verify", src, out, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["edits"] == []


def test_weights_are_never_an_edit(converted: tuple[Path, Path]) -> None:
    from tests.test_verify import flip

    src, out = converted
    flip(out, "model.layers.0.mlp.down_proj.weight", 5)
    result = run_cli("verify", src, out, "--accept-edits", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["classes"]["weights-and-config"] and not report["edits"]


def test_a_block_grid_is_no_per_shard_layout_on_the_card(tmp_path: Path) -> None:
    """A block scale grid of 1 x 2 blocks (GLM's fused gate/up, 32 rows by 64 columns) holds as many values as
    the module has shards: still block scales, and the card's layout line is not judged from them (issue 48's
    mutation sample: a planted change that read such grids as per-shard scales survived)."""
    src = build(tmp_path / "src", glm(intermediate=16), fmt="block-fp8")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "-q", check_output=False).exit_code == 0
    assert "- Layout: **fused**" in (out / "README.md").read_text()
    grid = load_tensors(out)["model.layers.0.mlp.gate_up_proj.weight_scale_inv"]
    assert tuple(grid.shape) == (1, 2)
    result = run_cli("verify", src, out, "--json")
    assert result.exit_code == 0, result.output


def test_a_hostile_loader_table_gives_a_bounded_report(converted: tuple[Path, Path]) -> None:
    """A card whose loader table has a 100,000-character verdict cell and 5,000 rows for loaders fp8fix does not
    judge: each cell shown cut, the unknown rows named up to three and counted, not one problem each."""
    src, out = converted
    card = (out / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| transformers | "))
    strays = "\n".join(f"| loader-{i} | loads | made up |" for i in range(5000))
    edit_card(out, row, f"| transformers | {'x' * 100_000} | edited |\n{strays}")
    result = run_cli("verify", src, out, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1
    problems = report["classes"]["metadata"]
    assert len(problems) <= 3 and all(len(p) < 600 for p in problems), [p[:200] for p in problems]
    assert any("transformers" in p and "x" * 40 in p for p in problems), problems
    assert any("loader-0" in p and "and 4997 more" in p for p in problems), problems

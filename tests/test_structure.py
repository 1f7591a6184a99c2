"""The error table and the module boundaries the code promises (docs/development.md "Layout of the code")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fp8fix.errors import (
    HubError,
    InvalidCheckpoint,
    OutputError,
    RegistryEntryError,
    UnsupportedCheckpoint,
    UsageError,
    VerificationFailed,
    user_error,
)

PACKAGE = Path(__file__).resolve().parent.parent / "fp8fix"


# the codes of the exit-code table (docs/cli-output.md)
@pytest.mark.parametrize(
    "error,code",
    [
        (VerificationFailed("x"), 1),
        (OSError(28, "No space left on device", "/out/model.safetensors"), 5),
        (MemoryError(), 5),
        (UsageError("x"), 2),
        (OutputError("x"), 2),
        (RegistryEntryError("x"), 2),
        (InvalidCheckpoint("x"), 3),
        (UnsupportedCheckpoint("x"), 3),
        (HubError("x"), 4),
        (KeyboardInterrupt(), 130),
    ],
)
def test_each_error_type_has_one_exit_code_and_one_line(error: BaseException, code: int) -> None:
    known = user_error(error)
    assert known is not None and known[0] == code
    assert "\n" not in known[1] and known[1]
    if isinstance(error, OSError):
        assert known[1] == "Error: /out/model.safetensors: No space left on device"


def test_a_bug_is_not_dressed_as_a_user_error() -> None:
    assert user_error(ValueError("a bug")) is None
    assert user_error(KeyError("a bug")) is None


def imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from fp8fix... import name` in a source file."""
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp8fix")
        for alias in node.names
    ]


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}: {module}.{name}"
        for path in PACKAGE.rglob("*.py")
        for module, name in imports(path)
        if name.startswith("_") and name != "__version__"
    ]
    assert offenders == []


@pytest.mark.parametrize("command", ["inspection", "conversion"])
def test_commands_take_the_checkpoint_description_not_each_others_internals(command: str) -> None:
    """inspect, convert and verify share `model` (what the checkpoint is); none imports another
    command's modules, except convert's call of verify's public entry point."""
    allowed = {"fp8fix.verification": {"verify", "VerifyReport"}} if command == "conversion" else {}
    for module, name in imports(PACKAGE / f"{command}.py"):
        other = module.split(".")[1] if module.count(".") else ""
        if other in {"inspection", "conversion", "verification"} - {command}:
            assert name in allowed.get(module, set()), f"{command}.py imports {module}.{name}"
    verify_imports = [m for path in (PACKAGE / "verification").glob("*.py") for m, _ in imports(path)]
    # verify is an independent witness: no planning or config code of convert's (issue 25)
    assert not [m for m in verify_imports if m.split(".")[1] in ("inspection", "conversion", "plan", "verdicts")]


def test_the_loader_table_is_generated_from_the_rules() -> None:
    """docs/loader-rules.md's table of loader rules is scripts/loader_tables.py's rendering of registry/loaders.py."""
    import subprocess
    import sys

    script = PACKAGE.parent / "scripts" / "loader_tables.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, "docs/loader-rules.md's table is stale: run python scripts/loader_tables.py"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the fp8fix modules it imports, anywhere in it (top level, inside functions, under TYPE_CHECKING)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / "fp8fix").rglob("*.py")
    }
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp8fix"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[module] |= {n for n in names if n in modules and n not in (module, "fp8fix")}
    return graph


def test_imports_form_no_circle() -> None:
    """Issue 48: every import goes down the tree; no two modules need each other, even lazily or for types
    (three circles were broken: conversion / convert_report / model_card, compressed_tensors / config_edit,
    planner / targets / unquantized)."""
    graph = _import_graph()
    circles = []
    for start in graph:  # a module that reaches itself again
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    circles.append(" -> ".join([*path, nxt]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, circles[:3]

"""The wheel and the sdist, built by setuptools' own PEP 517 backend, hold what they should.

The wheel: the package, its data (registry entries, `py.typed`), the license, metadata with the
SPDX license expression, classifiers and URLs; no tests. The sdist: everything its own test
suite needs (tests/ with builders, conftest and the Hub test server, examples/, scripts/), so
`pip install fp8fix-*.tar.gz`, unpacked, passes `pytest`.
"""

from __future__ import annotations

import tarfile
import zipfile

import pytest

from tests.distributions import ROOT, build_distributions


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], set[str], str]:
    out, tree_copy = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("src")
    sdist_path, wheel_path = build_distributions(out, tree_copy)
    sdist_name, wheel_name = sdist_path.name, wheel_path.name
    with tarfile.open(out / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        sdist_files = {m.name.removeprefix(top + "/") for m in sdist.getmembers() if m.isfile()}
    with zipfile.ZipFile(out / wheel_name) as wheel:
        wheel_files = set(wheel.namelist())
        metadata = wheel.read(next(n for n in wheel_files if n.endswith(".dist-info/METADATA"))).decode()
    return sdist_files, wheel_files, metadata


def tree(folder: str) -> set[str]:
    """Files under ROOT/folder, as the sdist names them (no caches)."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_the_sdist_holds_what_its_tests_need(dists: tuple[set[str], set[str], str]) -> None:
    sdist, _, _ = dists
    needed = (
        tree("tests") | tree("examples") | tree("scripts") | tree("docs") | {"LICENSE", "README.md", "pyproject.toml"}
    )
    needed |= {"mkdocs.yml"}
    assert {"tests/builders.py", "tests/conftest.py", "tests/hub_server.py"} <= needed
    assert needed <= sdist, sorted(needed - sdist)[:10]
    assert tree("fp8fix") <= sdist


def test_the_wheel_holds_the_package_its_data_and_license(dists: tuple[set[str], set[str], str]) -> None:
    _, wheel, metadata = dists
    assert "fp8fix/py.typed" in wheel and "fp8fix/registry/architectures/mimo_v2.json" in wheel
    assert tree("fp8fix") <= wheel
    assert not any(name.startswith(("tests/", "scripts/", "examples/")) for name in wheel)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel)
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Typing :: Typed" in metadata and "Project-URL: Issues," in metadata
    assert "Requires-Python: >=3.10" in metadata
    # torch only as an extra: the package index's default torch is the multi-GB CUDA build (issue 26)
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    torch_requires = [r for r in requires if r.startswith("torch")]
    assert 'torch>=2.1; extra == "torch"' in torch_requires
    assert all("extra ==" in r for r in torch_requires), torch_requires


def test_the_classifiers_claim_only_what_ci_runs_on(dists: tuple[set[str], set[str], str]) -> None:
    """Operating systems and Python versions in the classifiers: the ones this suite runs on (issue 27:
    macOS was listed while a Python without os.copy_file_range failed every conversion)."""
    import platform
    import sys

    _, _, metadata = dists
    classifiers = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Classifier:")]
    systems = [c for c in classifiers if c.startswith("Operating System ::")]
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    assert systems == ["Operating System :: POSIX :: Linux"] and platform.system() == "Linux"
    assert versions == [f"{sys.version_info.major}.{sys.version_info.minor}"]


def test_every_runtime_dependency_has_a_lower_bound_ci_installs() -> None:
    """scripts/lowest_versions.py pins each dependency at its declared floor; CI's sdist pass installs them."""
    import tomllib

    from scripts.lowest_versions import lowest_pins

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = lowest_pins()
    assert len(pins) == len(declared) and all("==" in p for p in pins)
    assert "huggingface_hub==1.0" in pins  # 0.24 / 0.25 failed the suite (issue 27)
    ci = ROOT / ".ci" / "run"  # in the repository (the sdist, which this also runs from, has no .ci/)
    if ci.exists():
        assert "$(python scripts/lowest_versions.py)" in ci.read_text() and "--no-deps" in ci.read_text()

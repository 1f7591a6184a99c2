"""Seeded mutations of small real checkpoints: whatever the input, fp8fix fails cleanly or writes a loadable output.

Each case copies a small checkpoint, mutates one file (bit flips, byte insertions and
deletions, truncations, header-length edits, hostile values swapped into the
safetensors header, the index or config.json) or, in TREE_SHARE of the cases, its
file-system shape (a link out of SOURCE to a secret, /dev/zero or /proc/self/environ, a
FIFO, a linked folder, a name with control characters), and runs `convert` (and, on some
cases, `inspect` and `verify`) in process. Asserted for every case:

- no uncaught exception (a missed case would surface as exit 70 from the last-resort
  handler, which fails here too);
- a failure leaves no OUTPUT and no staging folder;
- SOURCE is unchanged;
- an exit-0 conversion only ever comes from source shards that `safe_open` accepts,
  its every output shard opens with `safe_open`, tensor by tensor, and OUTPUT holds no
  link and none of the secret's bytes.

`FP8FIX_FUZZ_CASES` scales the campaign (default 2,400 cases, about 15 s; 20,000 take about 2 minutes).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fp8fix.cli import main
from tests.builders import build, phi3
from tests.conftest import folder_digest, safetensors_opens

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"
CASES = int(os.environ.get("FP8FIX_FUZZ_CASES", "2400"))
BATCHES = 24
CLEAN_EXITS = {0, 1, 2, 3}
#: The share of cases that change the file-system shape of SOURCE rather than a file's bytes.
TREE_SHARE = 0.15

#: Values swapped into JSON documents: wrong types, edge numbers, hostile strings.
HOSTILE: list[Any] = [
    True,
    False,
    None,
    0,
    -1,
    1,
    7,
    2**64,
    10**400,
    1.5,
    float("inf"),
    float("nan"),
    "",
    "4",
    "F8_E4M3",
    "re:([",
    "x" * 300,
    [],
    [0],
    [True, 64],
    [1, 2, 3],
    {},
    {"a": 1},
    [[[[[]]]]],
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The shipped example (AutoFP8, two shards) and a single-file block-FP8 checkpoint with biases."""
    root = tmp_path_factory.mktemp("fuzz-sources")
    shutil.copytree(EXAMPLE, root / "example")
    block = build(root / "block", phi3(layers=1), fmt="block-fp8", files=1, bias=True, extra_files=False)
    return [root / "example", block]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def _flip_bits(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        # bias towards the header, where most structure lives
        limit = min(len(buf), rng.choice([16, 512, 4096, len(buf)]))
        i = rng.randrange(limit)
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _insert(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 9))) + data[i:]


def _delete(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, 9) :]


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def _header_length(data: bytes, rng: random.Random) -> bytes:
    if len(data) < 8:
        return data
    (n,) = struct.unpack("<Q", data[:8])
    new = rng.choice([0, 1, n - 1, n + 1, n - 8, n + 8, n * 2, len(data), 2**63, 2**64 - 1, 100_000_001])
    return struct.pack("<Q", max(0, min(new, 2**64 - 1))) + data[8:]


def _json_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            paths += _json_paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            paths += _json_paths(v, (*path, i))
    return paths


def _swap_value(doc: Any, rng: random.Random) -> Any:
    paths = [p for p in _json_paths(doc) if p]
    if not paths:
        return rng.choice(HOSTILE)
    path = rng.choice(paths)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.15 and isinstance(parent, dict):  # rename the key instead
        parent[rng.choice(["", "__metadata__", "x", str(path[-1]) + "_"])] = parent.pop(path[-1])
    else:
        parent[path[-1]] = rng.choice(HOSTILE)
    return doc


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def _swap_in_header(data: bytes, rng: random.Random) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = _dumps(_swap_value(header, rng))
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data[8 + n :]


def _swap_in_json(data: bytes, rng: random.Random) -> bytes:
    return _dumps(_swap_value(json.loads(data), rng))


Mutation = Callable[[bytes, random.Random], bytes]
BYTE_MUTATIONS: list[Mutation] = [_flip_bits, _insert, _delete, _truncate]


#: What a file-system mutation may point a link at: a secret beside SOURCE (never to reach OUTPUT), a
#: device that reads without end, the environment, a folder outside.
SECRET = "fuzz-secret-that-must-never-reach-OUTPUT"


def _link_targets(folder: Path) -> list[Path]:
    secret = folder.parent / "secret.txt"
    if not secret.exists():
        secret.write_text(SECRET)
    return [secret, Path("/dev/zero"), Path("/proc/self/environ"), folder.parent]


def mutate_tree(folder: Path, rng: random.Random) -> str:
    """Turn one entry of `folder` into a hostile file-system shape: a link out of SOURCE, a FIFO, a
    linked folder, or a file under a name with control characters; return what was done."""
    path = rng.choice(_files(folder))
    shape = rng.choice(["link", "link", "fifo", "folder-link", "odd-name"])
    if shape == "odd-name":
        odd = rng.choice(["a\nError: x", "\x1b[31m", "tab\tname", "é" * 120, "-" * 200])
        target = folder / (odd + path.suffix)
        path.rename(target)
        return f"{path.name}: renamed {target.name!r}"
    path.unlink()
    if shape == "fifo":
        os.mkfifo(path)
        return f"{path.name}: a FIFO"
    target = _link_targets(folder)[-1 if shape == "folder-link" else rng.randrange(3)]
    path.symlink_to(target, target_is_directory=target.is_dir())
    return f"{path.name}: a link to {target}"


def mutate(folder: Path, rng: random.Random) -> str:
    """Mutate one file of `folder` in place; return what was done (for the failure message)."""
    if rng.random() < TREE_SHARE:
        return mutate_tree(folder, rng)
    path = rng.choice(_files(folder))
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        mutation = rng.choice([*BYTE_MUTATIONS, _header_length, _swap_in_header, _swap_in_header])
    elif path.suffix == ".json":
        mutation = rng.choice([*BYTE_MUTATIONS, _swap_in_json, _swap_in_json, _swap_in_json])
    else:
        mutation = rng.choice(BYTE_MUTATIONS)
    if not data:
        return f"{path.name}: empty, left as is"
    path.write_bytes(mutation(data, rng))
    return f"{path.name}: {mutation.__name__}"


def _invoke(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        frames = traceback.extract_tb(result.exception.__traceback__)
        frame = next((f for f in reversed(frames) if "/fp8fix/" in f.filename), frames[-1])
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        raise AssertionError(f"uncaught {type(result.exception).__name__} at {where}: {result.exception}")
    return result.exit_code, result.output


def run_case(seed: int, sources: list[Path], work: Path) -> None:
    rng = random.Random(seed)
    base = sources[seed % len(sources)]
    src = work / f"src{seed}"
    shutil.copytree(base, src)
    what = mutate(src, rng)
    before = folder_digest(src)
    out = work / f"out{seed}"
    options = rng.choice([[], [], ["--to", "e4m3fnuz"], ["--layout", "unfused"], ["--verify"]])
    code, text = _invoke("convert", src, out, "-q", *options)
    context = f"seed {seed} ({base.name}, {what}, {' '.join(options)}): exit {code}\n{text}"
    assert code in CLEAN_EXITS, context
    assert "Traceback" not in text, context
    assert folder_digest(src) == before, "SOURCE changed: " + context
    leftovers = [p.name for p in work.iterdir() if p.name.startswith(f".out{seed}.")]
    assert not leftovers, f"staging left {leftovers}: " + context
    if code != 0:
        assert not out.exists(), "OUTPUT written by a failed conversion: " + context
    else:
        model_shards = _model_shards(src)
        refused = [s for s in model_shards if not safetensors_opens(src / s)]
        assert not refused, f"converted {refused}, which safetensors refuses: " + context
        unloadable = [p.name for p in out.glob("*.safetensors") if not safetensors_opens(p)]
        assert not unloadable, f"wrote {unloadable}, which safetensors refuses: " + context
        leaked = [p.name for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert not leaked and not any(p.is_symlink() for p in out.rglob("*")), f"leaked {leaked}: " + context
    if seed % 4 == 0:
        code, text = _invoke("inspect", src)
        assert code in CLEAN_EXITS and "Traceback" not in text, f"inspect, {context}\n{text}"
    if seed % 4 == 1:
        code, text = _invoke("verify", base, src, "-q")
        assert code in CLEAN_EXITS and "Traceback" not in text, f"verify, {context}\n{text}"
    shutil.rmtree(src)
    shutil.rmtree(out, ignore_errors=True)
    (work / "secret.txt").unlink(missing_ok=True)


def _model_shards(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [p.name for p in folder.glob("*.safetensors")]


@pytest.mark.parametrize("batch", range(BATCHES))
def test_fuzzed_checkpoints_fail_cleanly_or_convert_loadably(batch: int, sources: list[Path], tmp_path: Path) -> None:
    failures = []
    for seed in range(batch, CASES, BATCHES):
        try:
            run_case(seed, sources, tmp_path)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0][:400])
            for p in tmp_path.iterdir():
                shutil.rmtree(p, ignore_errors=True)
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures)

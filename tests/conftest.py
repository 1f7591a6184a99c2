"""Shared fixtures: run the real CLI, read checkpoints back with safetensors, corrupt headers by hand."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open

from fp8fix.cli import main
from tests.hub_server import FakeHub

# A bug surfaces as its exception and traceback in tests, not as the CLI's one-line exit 70.
os.environ.setdefault("FP8FIX_DEBUG", "1")
# Report lines unwrapped, so tests match whole lines (tests/test_output.py checks the 80-column wrapping).
os.environ.setdefault("COLUMNS", "1000")


def run_cli(*args: str | Path, check_output: bool = True) -> Result:
    """The real `fp8fix` command, in process; exceptions other than exit codes are test failures.

    Every successful conversion the suite makes is then checked by `fp8fix verify`.
    """
    result = _invoke(*args)
    converted = args[0] == "convert" and len(args) >= 3 and not {"--dry-run", "--help"} & set(map(str, args))
    if check_output and converted and result.exit_code == 0:
        strings = [str(a) for a in args]
        arch_files = [x for i, a in enumerate(strings) if a == "--arch-file" for x in (a, strings[i + 1])]
        checked = _invoke("verify", args[1], args[2], "-q", *arch_files)
        assert checked.exit_code == 0, f"fp8fix verify rejects this conversion:\n{checked.output}"
    return result


def run_process(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m fp8fix ARGS` in a new process: for what an in-process run cannot show (`--jobs`
    forks only where torch is not loaded, and this test process has it loaded)."""
    return subprocess.run(
        [sys.executable, "-m", "fp8fix", *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )


def _invoke(*args: str | Path) -> Result:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def shard_files(folder: Path) -> dict[str, str]:
    """tensor name -> file name, from the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    names: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.update({k: path.name for k in f.keys()})
    return names


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (tiny test models only)."""
    out: dict[str, torch.Tensor] = {}
    for name, file in shard_files(folder).items():
        with safe_open(folder / file, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def safetensors_opens(path: Path) -> bool:
    """What safetensors itself says of a file: can it be opened and every tensor read? (small files only)"""
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:
        return False
    return True


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, dtype-agnostic (FP8 included)."""
    flat = t.reshape(-1).clone()  # clone: a view shares (and would expose) its base storage
    return bytes(flat.view(torch.uint8).untyped_storage()) if flat.numel() else b""


def dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(())
    elif s.dim() == 1:
        s = s.reshape(-1, 1)
    return weight.float() * s


def folder_digest(folder: Path) -> dict[str, str]:
    """Every entry below `folder`: a regular file's sha256, a link's target, what anything else is (a FIFO
    is never opened); links to folders are not followed."""
    found = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            found[rel] = "link -> " + os.readlink(p)
        elif p.is_fifo():
            found[rel] = "fifo"
        elif p.is_file():
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def read_raw_header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header: dict[str, Any] | bytes, buffer: bytes, header_len: int | None = None) -> None:
    """Write a safetensors file byte by byte, valid or not."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + buffer)


@pytest.fixture
def rewrite_header() -> Callable[..., None]:
    def rewrite(path: Path, mutate: Callable[[dict[str, Any]], Any], buffer: Callable[[bytes], bytes] | None = None):
        header, data = read_raw_header(path)
        mutate(header)
        write_raw(path, header, buffer(data) if buffer else data)

    return rewrite


def fused_names(folder: Path, suffix: str) -> list[str]:
    return sorted({n.rsplit(".", 1)[0] for n in shard_files(folder) if n.rsplit(".", 1)[0].endswith(suffix)})


def patch_bytes(folder: Path, tensor: str, patches: dict[int, int]) -> None:
    """Overwrite bytes of one tensor in place (offsets relative to the tensor's first byte)."""
    path = folder / shard_files(folder)[tensor]
    header, data = read_raw_header(path)
    begin = header[tensor]["data_offsets"][0]
    buffer = bytearray(data)
    for offset, value in patches.items():
        buffer[begin + offset] = value
    write_raw(path, header, bytes(buffer))


def _wait_stopped(pid: int, limit: float = 10.0) -> None:
    """Until `pid` has stopped: SIGSTOP is delivered asynchronously (a process in a long system call stops
    when it returns), so a state read before the stop lands could be overtaken."""
    deadline = time.monotonic() + limit
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():  # no procfs (macOS): the stop lands before the next scheduling of the process
        return
    while time.monotonic() < deadline:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0005)


class stopped_while:  # noqa: N801 (used as a statement: `with stopped_while(...)`)
    """Stop `proc` (SIGSTOP) until `ready()` holds, then run the block with it stopped and continue it:
    what the block does happens at a known point of the run, never after it finished."""

    def __init__(self, proc: subprocess.Popen[str], ready: Callable[[], bool], limit: float = 60) -> None:
        self.proc, self.ready, self.limit = proc, ready, limit

    def __enter__(self) -> None:
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the process ended before the point it was to be stopped at"
            os.kill(self.proc.pid, signal.SIGSTOP)
            _wait_stopped(self.proc.pid)
            if self.ready():
                return
            os.kill(self.proc.pid, signal.SIGCONT)
            time.sleep(0.001)
        raise AssertionError("the process never reached the point it was to be stopped at")

    def __exit__(self, *exc: object) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


def writing(folder: Path, output: str, shards: int) -> bool:
    """True while a convert into `folder / output` is writing its shards: its staging folder exists and
    holds fewer than `shards` of them (so the final rename, whose signals are held, is still ahead)."""
    staging = [p for p in folder.iterdir() if p.name.startswith(f".{output}.fp8fix-") and "-old-" not in p.name]
    return bool(staging) and len(list(staging[0].glob("*.safetensors"))) < shards


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    """The test Hub (tests/hub_server.py) on 127.0.0.1, stopped after the test."""
    hub = FakeHub().start()
    yield hub
    hub.stop()

"""Issue 25: a checkpoint from the internet cannot leak secrets, hang fp8fix, or pass verify while wrong.

One test (or one parametrized case) per finding of the second hostile-input campaign, each
reproducing what it measured: S1 links out of SOURCE, H1-H8 hangs and unbounded work, W1-W5
silently wrong outputs, exit 70 from input, and the smaller items. Every bounded case runs
under a wall-clock limit of its own, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fp8fix.report.model_card import commit_message
from tests.builders import build, llama, phi3
from tests.conftest import folder_digest, load_tensors, run_cli, stopped_while
from tests.test_grouped import neox
from tests.test_hostile_input import EXAMPLE, INDEX, SHARD1, src

__all__ = ["src"]  # the shipped example, copied: a fixture shared with test_hostile_input
SECRET = "hf_SECRET_token_from_a_file_outside_SOURCE"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secrets" / "token"
    path.parent.mkdir()
    path.write_text(SECRET + "\n")
    return path


def fp8fix(*args: str | Path, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The real command in its own process, bounded in time: a hang is a failure, not a stuck suite."""
    env = {k: v for k, v in os.environ.items() if k != "FP8FIX_DEBUG"} | kwargs.pop("env", {})
    return subprocess.run(
        [sys.executable, "-m", "fp8fix", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def everything_in(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def clean_failure(result: subprocess.CompletedProcess[str], code: int, tmp_path: Path, *words: str) -> str:
    """One `Error:` line naming what is wrong, the exit code, no traceback, nothing written beside SOURCE."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("Error: "), result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    return result.stderr


# --- S1. links out of SOURCE -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "special_tokens_map.json", "README.md", "extra/notes.txt"])
def test_a_link_out_of_source_is_skipped_never_copied(tmp_path: Path, src: Path, secret: Path, name: str) -> None:
    """S1: such a file's target (a secret) ended up in OUTPUT (the card, through a README link), exit 0."""
    link = src / name
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    result = fp8fix("convert", src, tmp_path / "out", "-q")
    assert result.returncode == 0, result.stderr
    assert f"warning: {name}: a symbolic link to {secret}, outside the checkpoint folder" in result.stderr
    assert SECRET not in everything_in(tmp_path / "out")
    assert not (tmp_path / "out" / name).exists() or name == "README.md"
    assert run_cli("verify", src, tmp_path / "out", "-q").exit_code == 0


def test_outputs_card_linked_out_is_never_opened(tmp_path: Path, src: Path) -> None:
    """verify, `--overwrite` and push's commit title read OUTPUT's card; a link there was followed out (to a
    copy of the true card: verify then found no fault in the card's facts, only the link among the files)."""
    out = tmp_path / "out"
    assert fp8fix("convert", src, out, "-q").returncode == 0
    outside = tmp_path / "elsewhere.md"
    shutil.move(out / "README.md", outside)
    (out / "README.md").symlink_to(outside)
    result = fp8fix("verify", src, out, "--json")
    assert result.returncode == 1, result.stderr
    problems = json.loads(result.stdout)["problems"]
    assert "README.md: is a symbolic link, not a regular file; not followed" in problems, problems
    assert not any("loader table" in p for p in problems), problems  # card_facts did not read it either
    assert commit_message(out) == "fp8fix: upload converted FP8 checkpoint"  # the generic title
    again = fp8fix("convert", src, out, "-q", "--overwrite")
    assert again.returncode == 2 and "would lose README.md" in again.stderr, again.stderr
    assert (out / "README.md").is_symlink()


def test_a_readme_linked_to_the_environment_does_not_reach_the_card(tmp_path: Path, src: Path) -> None:
    """S1: README.md -> /proc/self/environ put the environment, HF_TOKEN included, in OUTPUT's card."""
    (src / "README.md").unlink(missing_ok=True)
    (src / "README.md").symlink_to("/proc/self/environ")
    result = fp8fix("convert", src, tmp_path / "out", "-q", env={"HF_TOKEN": SECRET})
    assert result.returncode == 0, result.stderr
    assert "README.md: a symbolic link to /proc/" in result.stderr
    assert SECRET not in everything_in(tmp_path / "out")


def test_a_linked_folder_is_not_followed(tmp_path: Path, src: Path, secret: Path) -> None:
    (src / "original").symlink_to(secret.parent, target_is_directory=True)
    result = fp8fix("convert", src, tmp_path / "out", "-q")
    assert result.returncode == 0, result.stderr
    assert "original: a symbolic link to a folder; not followed" in result.stderr
    assert SECRET not in everything_in(tmp_path / "out") and not (tmp_path / "out" / "original").exists()


@pytest.mark.parametrize("name", ["config.json", INDEX, SHARD1])
def test_a_model_file_linked_out_of_source_is_refused(tmp_path: Path, src: Path, name: str) -> None:
    """S1: config, index and shards are read and partly copied: one outside SOURCE is refused (exit 3)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(src / name, elsewhere / name)
    (src / name).symlink_to(elsewhere / name)
    before = folder_digest(src)
    result = fp8fix("convert", src, tmp_path / "out", "-q")
    clean_failure(result, 3, tmp_path, f"{name}: a symbolic link to", "outside the checkpoint folder", "cp -L")
    assert folder_digest(src) == before
    assert fp8fix("inspect", src).returncode == 3


def test_a_link_inside_source_is_read(tmp_path: Path, src: Path) -> None:
    """Links that stay inside SOURCE are fine (a repo may alias its own files)."""
    (src / "tokenizer_alias.json").write_text('{"a": 1}')
    (src / "tokenizer.json").unlink(missing_ok=True)
    (src / "tokenizer.json").symlink_to("tokenizer_alias.json")
    assert run_cli("convert", src, tmp_path / "out", "-q").exit_code == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"a": 1}'


def test_a_hub_snapshot_link_out_of_its_blobs_is_skipped(tmp_path: Path, secret: Path) -> None:
    """S1, Hub cache: a snapshot's files link to ../../blobs/; one linking further out is not read."""
    from tests.test_hub import SHA, make_hub_cache, offline_env

    cache = make_hub_cache(tmp_path)
    snapshot = cache / "models--org--tiny-fp8" / "snapshots" / SHA
    (snapshot / "tokenizer.json").symlink_to(os.path.relpath(secret, snapshot))
    result = fp8fix("convert", "org/tiny-fp8", tmp_path / "out", "-q", env=offline_env(tmp_path, cache))
    assert result.returncode == 0, result.stderr
    assert "tokenizer.json: a symbolic link to" in result.stderr
    assert SECRET not in everything_in(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()  # the snapshot's own links into blobs/ were read


def test_push_refuses_a_folder_with_a_link_out_before_sending_anything(tmp_path: Path, secret: Path) -> None:
    """S1, push: a link out of FOLDER is refused before any request (here, to an endpoint that is closed)."""
    folder = Path(shutil.copytree(EXAMPLE, tmp_path / "folder"))
    (folder / "tokenizer.json").symlink_to(secret)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    result = fp8fix("push", "org/name", folder, env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_x"})
    assert result.returncode == 2, result.stderr
    assert "tokenizer.json: a symbolic link to" in result.stderr and "uploads only regular files" in result.stderr


# --- H1. FIFOs and devices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_fifo_is_refused_at_once(tmp_path: Path, src: Path, name: str) -> None:
    """H1: config.json or the index as a FIFO hung inspect and convert forever."""
    (src / name).unlink()
    os.mkfifo(src / name)
    for command in (["inspect", src], ["convert", src, tmp_path / "out"]):
        result = fp8fix(*command, timeout=30)
        clean_failure(result, 3, tmp_path, name, "a FIFO, not a regular file")


def test_a_fifo_among_the_other_files_is_skipped(tmp_path: Path, src: Path) -> None:
    os.mkfifo(src / "tokenizer.model")
    result = fp8fix("convert", src, tmp_path / "out", "-q", timeout=30)
    assert result.returncode == 0, result.stderr
    assert "tokenizer.model: a FIFO, not a regular file; not read, not copied" in result.stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_link_to_a_device_is_refused(tmp_path: Path, src: Path, device: str) -> None:
    """H1: the index linked to /dev/zero grew memory until killed (exit 70 MemoryError)."""
    (src / INDEX).unlink()
    (src / INDEX).symlink_to(device)
    clean_failure(fp8fix("inspect", src, timeout=30), 3, tmp_path, INDEX, f"a symbolic link to {device}")


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_an_arch_file_that_is_no_file_is_a_usage_error(tmp_path: Path, src: Path, kind: str) -> None:
    """H1: `--arch-file` as a FIFO hung; as /dev/zero it read without end."""
    path = tmp_path / "arch.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path(kind)
    result = fp8fix("inspect", src, "--arch-file", path, timeout=30)
    assert result.returncode == 2, result.stderr
    assert "not a regular file" in result.stderr and "Traceback" not in result.stderr


# --- H2. patterns that backtrack without end ------------------------------------------------------------------


CATASTROPHIC = "(?:[a-z_.0-9]|[a-z_.0-9])*X"


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8-transformers"])
def test_a_catastrophic_pattern_is_bounded(tmp_path: Path, fmt: str) -> None:
    """H2: `re:(?:[a-z_.0-9]|[a-z_.0-9])*X` in compressed-tensors `ignore` (or as a transformers
    `modules_to_not_convert` entry) gave no answer in 40 s, exponential in the name's length."""
    src = build(tmp_path / "src", llama(), fmt="compressed-tensors" if fmt == "compressed-tensors" else "fp8")
    qc_key = "ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"
    entry = f"re:{CATASTROPHIC}" if fmt == "compressed-tensors" else CATASTROPHIC
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__(qc_key, ["lm_head", entry]))
    started = time.monotonic()
    result = fp8fix("inspect", src, "--json", timeout=60)
    assert time.monotonic() - started < 20
    assert result.returncode in (0, 3), result.stderr
    assert "Traceback" not in result.stderr


def test_a_pattern_that_times_out_is_refused_naming_it(tmp_path: Path) -> None:
    """A pattern even the bounded engine cannot finish on a module name (its literal and look-behind
    leave nothing to optimize away): refused, exit 3, the entry named."""
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    slow = "re:(?:[a-z._0-9]|[a-z._0-9]{2})+(?<=x)$"
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("ignore", ["lm_head", slow]))
    started = time.monotonic()  # unfusing renames modules: each entry is matched against the fused modules' names
    result = fp8fix("convert", src, tmp_path / "out", "--layout", "unfused", "--format", "keep", timeout=120)
    assert time.monotonic() - started < 30
    clean_failure(result, 3, tmp_path, "takes more than 0.1 s to match", "simplify the pattern")


# --- H3. model-card front matter ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "card, warning",
    [
        ("---" + "\n" * 5000, None),
        (
            "---\na: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
            "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\ntags: [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n---\nbody\n",
            "expands to more than",
        ),
        ("---\nx: " + "[" * 5000 + "]" * 5000 + "\n---\nbody\n", "nests more than"),
        ("---\nx: " + "9" * 5000 + "\n---\nbody\n", "holds a value Python cannot read"),
    ],
    ids=["newlines", "alias-bomb", "deep", "huge-integer"],
)
def test_card_front_matter_is_read_in_bounded_time(tmp_path: Path, src: Path, card: str, warning: str | None) -> None:
    """H3: `---` and 5,000 newlines took > 30 s (a cubic regex); a YAML alias bomb under `tags:` never
    finished; 5,000 levels or a 5,000-digit integer were exit 70."""
    (src / "README.md").write_text(card)
    started = time.monotonic()
    result = fp8fix("convert", src, tmp_path / "out", "-q", timeout=60)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 15
    if warning:
        assert f"warning: README.md: its front matter {warning}" in result.stderr
    assert (tmp_path / "out" / "README.md").read_text().startswith("---\n")


def test_the_front_matter_split_is_the_hubs_on_every_short_card() -> None:
    """The linear split agrees with huggingface_hub's own regex (the reference) on every string of up to
    7 characters over the characters that matter."""
    import itertools
    import re

    from fp8fix.report.model_card import front_matter

    hub = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")
    for n in range(8):
        for chars in itertools.product(["-", "\n", "\r", " ", "a"], repeat=n):
            text = "".join(chars)
            m = hub.search(text)
            assert front_matter(text) == ((m.group(2), m.end()) if m else None), repr(text)


# --- H4, H8. sizes from config and from --arch-file --------------------------------------------------------


def test_a_billion_heads_are_refused_before_any_loop(tmp_path: Path) -> None:
    """H4: num_attention_heads = hidden_size = 1e9 in a GPT-NeoX config: one segment per head was built
    before any size check (> 30 s)."""
    src = build(tmp_path / "src", neox())
    edit_json(src / "config.json", lambda c: c.update(num_attention_heads=10**9, hidden_size=10**9))
    started = time.monotonic()
    result = fp8fix("inspect", src, timeout=60)
    assert time.monotonic() - started < 15
    clean_failure(result, 3, tmp_path, "the config does not match the weights")


def test_arch_file_defaults_cannot_explode(tmp_path: Path, src: Path) -> None:
    """H8: `defaults` chains that expand exponentially never finished loading; a huge value ended in
    MemoryError. Each default is now worked out once, and no value may pass 2^62."""
    entry = json.loads(fp8fix("architectures", "--template", "Phi3ForCausalLM").stdout)
    chain = {f"d{i}": f"d{i + 1} + d{i + 1}" for i in range(60)} | {"d60": "1"}
    entry["defaults"] = {**entry.get("defaults", {}), **chain}
    entry["fused_modules"][0]["shards"][0]["rows"] = "d0 - d0 + " + entry["fused_modules"][0]["shards"][0]["rows"]
    arch = tmp_path / "chain.json"
    arch.write_text(json.dumps(entry))
    started = time.monotonic()
    result = fp8fix("inspect", src, "--arch-file", arch, "-q", timeout=60)
    assert time.monotonic() - started < 15 and result.returncode == 0, result.stderr
    big = {f"d{i}": f"d{i + 1} * d{i + 1}" for i in range(40)} | {"d40": "99"}
    entry["defaults"] = {**entry.get("defaults", {}), **big}
    arch.write_text(json.dumps(entry))
    result = fp8fix("inspect", src, "--arch-file", arch, timeout=60)
    assert result.returncode == 2 and "too large to be a size" in result.stderr, result.stderr


# --- H6. --jobs workers that die -----------------------------------------------------------------------------


def _die(progress: Any, how: str) -> int:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "raise":
        raise ValueError("a worker's own error")
    time.sleep(0.05)
    return 7


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_dead_worker_is_seen_and_the_others_stopped(how: str) -> None:
    """H6: a worker killed by SIGKILL (the OOM killer) or SIGTERM left the parent waiting forever."""
    from fp8fix.errors import WorkerDied
    from fp8fix.io.progress import NoProgress
    from fp8fix.io.workers import run_tasks

    tasks = [("sleep",)] * 6 + [(how,)] + [("sleep",)] * 6
    names = [f"shard {i}" for i in range(len(tasks))]
    started = time.monotonic()
    with pytest.raises(WorkerDied) as caught:
        run_tasks(_die, tasks, 3, NoProgress(), names)
    assert time.monotonic() - started < 20
    signal_name = "SIGKILL" if how == "kill" else "SIGTERM"
    assert f"working on shard 6 was killed by {signal_name}" in str(caught.value)
    assert not [p for p in _children() if p != os.getpid()], "workers left running"


def test_workers_return_results_in_order_and_reraise_errors() -> None:
    from fp8fix.io.progress import NoProgress
    from fp8fix.io.workers import run_tasks

    assert run_tasks(_die, [("sleep",)] * 5, 2, NoProgress()) == [7] * 5
    with pytest.raises(ValueError, match="a worker's own error"):
        run_tasks(_die, [("sleep",), ("raise",), ("sleep",)], 2, NoProgress())
    assert not _children()


def _children() -> list[int]:
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_convert_with_a_killed_worker_exits_5_and_leaves_nothing(tmp_path: Path) -> None:
    """H6 end to end: SIGKILL one `--jobs 2` worker mid-conversion: exit 5 (the machine: the out-of-memory killer)
    naming it, no OUTPUT, no staging."""
    src = build(tmp_path / "src", phi3(hidden=1024, intermediate=4096, layers=8), files=6, extra_files=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8fix", "convert", src, tmp_path / "out", "--to", "e4m3fnuz", "--jobs", "2", "-q"],
        stderr=subprocess.PIPE,
        text=True,
    )
    with stopped_while(proc, lambda: bool(_children_of(proc.pid))):
        os.kill(_children_of(proc.pid)[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 5, stderr
    assert "was killed by SIGKILL" in stderr and "nothing was written" in stderr and "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


# --- H7. a Hub that never answers ----------------------------------------------------------------------------


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """An endpoint on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("command", ["convert", "inspect", "push"])
def test_a_hub_that_never_answers_times_out(tmp_path: Path, silent_hub: str, command: str) -> None:
    """H7: `convert org/name` and `push` waited forever on an endpoint that accepts and never answers."""
    env = {"HF_ENDPOINT": silent_hub, "HF_HUB_DOWNLOAD_TIMEOUT": "1", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "x"}
    args: list[Any] = {
        "convert": ["convert", "org/name", tmp_path / "out"],
        "inspect": ["inspect", "org/name"],
        "push": ["push", "org/name", EXAMPLE],
    }[command]
    started = time.monotonic()
    result = fp8fix(*args, env=env, timeout=120)
    assert time.monotonic() - started < 60
    assert result.returncode == 4 and "org/name" in result.stderr and "Traceback" not in result.stderr, result.stderr


# --- W1, W2, W5. shard names and files beside the index -------------------------------------------------------


@pytest.mark.parametrize("spelling", ["./{}", "sub/../{}", "./sub/.././{}"])
def test_shard_names_are_normalized_once(tmp_path: Path, src: Path, spelling: str) -> None:
    """W1: an index naming `./model-0000N-...` or `sub/../x`: convert exited 0, then copied SOURCE's
    original file over the converted shard."""
    edit_json(
        src / INDEX,
        lambda i: i["weight_map"].update({k: spelling.format(v) for k, v in i["weight_map"].items() if v == SHARD1}),
    )
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "-q", "--layout", "unfused", "--format", "keep")
    assert result.exit_code == 0, result.output
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"].values()) == {SHARD1, "model-00002-of-00002.safetensors"}
    assert (out / SHARD1).read_bytes() != (src / SHARD1).read_bytes()  # the converted shard, not a copy
    assert "model.layers.0.self_attn.q_proj.weight" in load_tensors(out)


@pytest.mark.parametrize(
    "name, why",
    [
        ("README.md", "is not a .safetensors file"),
        ("config.json", "is not a .safetensors file"),
        ("../outside.safetensors", "is a path outside the checkpoint folder"),
        ("/etc/passwd.safetensors", "is a path outside the checkpoint folder"),
        ("a\nError: forged.safetensors", "holds a control character"),
        ("x" * 300 + ".safetensors", "longer than the 255 bytes"),
    ],
    ids=["card", "config", "parent", "absolute", "newline", "long"],
)
def test_a_shard_name_that_no_shard_may_have_is_refused(tmp_path: Path, src: Path, name: str, why: str) -> None:
    """W2: a shard named README.md was overwritten by the model card (exit 0); a newline in a file name
    forged a second `Error:` line; a 300-character name gave exit 1 without naming SOURCE."""
    edit_json(
        src / INDEX, lambda i: i["weight_map"].update({k: name for k, v in i["weight_map"].items() if v == SHARD1})
    )
    result = fp8fix("convert", src, tmp_path / "out")
    line = clean_failure(result, 3, tmp_path, why, "SOURCE")
    assert not any(row.startswith("Error: forged") for row in line.splitlines())


@pytest.mark.parametrize("stale", ["model.safetensors", "consolidated.safetensors", "original/model.safetensors"])
def test_an_unlisted_safetensors_file_is_not_copied(tmp_path: Path, src: Path, stale: str) -> None:
    """W5: `*.safetensors` files the index does not list were copied unconverted without a word;
    transformers loads `model.safetensors` first."""
    (src / stale).parent.mkdir(exist_ok=True)
    shutil.copyfile(src / SHARD1, src / stale)
    result = fp8fix("convert", src, tmp_path / "out", "-q")
    assert result.returncode == 0, result.stderr
    assert f"warning: {stale}: a .safetensors file that is not one of the checkpoint's shards" in result.stderr
    assert not (tmp_path / "out" / stale).exists()
    assert run_cli("verify", src, tmp_path / "out", "-q").exit_code == 0
    shutil.copyfile(src / SHARD1, tmp_path / "out" / "model.safetensors")  # verify: a stale file in OUTPUT
    assert "model.safetensors: in OUTPUT, but not a file" in run_cli("verify", src, tmp_path / "out").output


# --- W3. name lists carried by meaning -------------------------------------------------------------------------


def test_an_exact_list_entry_that_names_nothing_stays_naming_nothing(tmp_path: Path) -> None:
    """W3: AutoFP8 `ignored_layers: ["re:.*proj"]` names nothing in vLLM (exact compare); it was copied into
    compressed-tensors `ignore`, where it is a regex matching every projection (verify 0, inspect loads)."""
    src = build(tmp_path / "src", llama(), fmt="fp8", ignore=[])
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("ignored_layers", ["re:.*proj"]))
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "-q", "--format", "compressed-tensors").exit_code == 0
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head"]  # the one Linear without FP8 weights, named by fp8fix itself
    weights = load_tensors(out)
    assert str(weights["model.layers.0.self_attn.q_proj.weight"].dtype) == "torch.float8_e4m3fn"


# --- exit 70 from input ------------------------------------------------------------------------------------


def test_a_5000_digit_layer_index_is_a_clean_error(tmp_path: Path, src: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = src / SHARD1
    tensors = load_file(shard)
    old = "model.layers.0.self_attn.qkv_proj"
    new = "model.layers." + "7" * 5000 + ".self_attn.qkv_proj"
    renamed = {k.replace(old, new): v for k, v in tensors.items()}
    save_file(renamed, shard, metadata={"format": "pt"})
    edit_json(src / INDEX, lambda i: i.update(weight_map={k.replace(old, new): v for k, v in i["weight_map"].items()}))
    result = fp8fix("inspect", src)
    clean_failure(result, 3, tmp_path, "a layer index of 5000 digits")


@pytest.mark.parametrize("size, ok", [("9" * 400, False), ("0.0001", False), ("1TiB", True), ("512MiB", True)])
def test_commit_size_is_parsed_exactly(tmp_path: Path, size: str, ok: bool) -> None:
    """`--commit-size` of 400 nines or 0.0001 was exit 70; `1TiB` was accepted and then not found in its table."""
    result = fp8fix("push", "org/name", tmp_path / "no-such-folder", "--commit-size", size)
    assert "Traceback" not in result.stderr and "Internal error" not in result.stderr, result.stderr
    if ok:  # parsed; the folder is what is wrong: there is none (a usage error since issue 27)
        assert result.returncode == 2 and "FOLDER" in result.stderr and "--commit-size" not in result.stderr
    else:
        assert result.returncode == 2 and "--commit-size" in result.stderr


# --- smaller ---------------------------------------------------------------------------------------------


def test_escape_sequences_in_names_reach_no_terminal(tmp_path: Path, src: Path) -> None:
    """ESC sequences in `architectures[0]` reached the terminal raw."""
    edit_json(src / "config.json", lambda c: c.update(architectures=["\x1b[2J\x1b[31mEvil\nError: forged"]))
    result = fp8fix("inspect", src)
    assert "\x1b" not in result.stdout + result.stderr
    assert "\\x1b[2J" in result.stdout + result.stderr
    assert not any(line.startswith("Error: forged") for line in (result.stdout + result.stderr).splitlines())


def test_an_output_name_of_250_characters_works(tmp_path: Path, src: Path) -> None:
    """The lock file `.NAME.fp8fix.lock` was too long a name for an OUTPUT of 250 characters."""
    out = tmp_path / ("o" * 250)
    result = run_cli("convert", src, out, "-q")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, "src"]


def test_convert_into_the_current_empty_folder(tmp_path: Path, src: Path) -> None:
    """`convert SRC .` in an empty folder said "not empty" (its own lock file was inside it)."""
    here = tmp_path / "here"
    here.mkdir()
    result = fp8fix("convert", src, ".", "-q", cwd=here)
    assert result.returncode == 0, result.stderr
    assert (here / "config.json").is_file() and (here / SHARD1).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "src"]


def test_a_full_disk_names_output(tmp_path: Path, src: Path) -> None:
    """ENOSPC did not name OUTPUT. A file-size limit (EFBIG) stands in for a full disk here."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    result = fp8fix("convert", src, tmp_path / "out", preexec_fn=limit)
    clean_failure(result, 5, tmp_path, f"OUTPUT {tmp_path / 'out'}", "nothing was written")  # the machine


def test_verify_accepts_a_block_grid_one_block_wide(tmp_path: Path) -> None:
    """`--layout unfused --verify` on block FP8 whose weights are one block wide failed its own correct
    output: verify took the [rows / block, 1] grid for a per-row (channel) scale."""
    src = build(tmp_path / "src", phi3(hidden=32, heads=2, kv_heads=1, intermediate=64), fmt="block-fp8")
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "--format", "keep", "--verify", "-q")
    assert result.exit_code == 0, result.output
    scale = load_tensors(tmp_path / "out")["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert scale.shape[1] == 1 and scale.shape[0] == 32 // 32


# --- W4. verify and config sizes no weight reads --------------------------------------------------------------


@pytest.mark.parametrize(
    "model, key",
    [(phi3, "intermediate_size"), (llama, "moe_intermediate_size"), (llama, "shared_expert_intermediate_size")],
    ids=["phi3-fused-mlp", "llama-unused-moe", "llama-unused-shared"],
)
def test_verify_refuses_a_size_edit_no_padded_weight_explains(tmp_path: Path, model: Any, key: str) -> None:
    """W4: verify accepted any edit of OUTPUT's intermediate_size when the MLP is fused (Phi-3) or the
    value is unused: it took the edit for `--tp` padding without a padded weight to show for it."""
    src = build(tmp_path / "src", model())
    edit_json(src / "config.json", lambda c: c.setdefault(key, 128))
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "-q").exit_code == 0
    edit_json(out / "config.json", lambda c: c.update({key: c[key] * 2}))
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "config.json: differs from SOURCE's" in result.output, result.output


# --- issue 48: a Hub cache that points out of itself; a shard path no file system takes ---------------------------


@pytest.mark.parametrize("escape", ["ref", "snapshot link"])
def test_a_hub_cache_that_points_out_of_itself_is_refused(tmp_path: Path, escape: str) -> None:
    """refs/main naming `../../../outside_snapshot`, or a snapshot folder that is a link to a folder outside the
    cache: huggingface_hub follows either; fp8fix reads nothing there (exit 3, bad input), for every command."""
    from tests.test_hub import SHA, make_hub_cache

    cache = make_hub_cache(tmp_path)
    outside = build(tmp_path / "outside_snapshot", phi3())
    repo = cache / "models--org--tiny-fp8"
    if escape == "ref":
        (repo / "refs" / "main").write_text("../../../outside_snapshot")
    else:
        shutil.rmtree(repo / "snapshots" / SHA)
        (repo / "snapshots" / SHA).symlink_to(outside, target_is_directory=True)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    for command in (("inspect", "org/tiny-fp8"), ("convert", "org/tiny-fp8", tmp_path / "out")):
        result = fp8fix(*command, env={**os.environ, **env})
        clean_failure(result, 3, tmp_path, "org/tiny-fp8", "not a snapshot folder of that repo", str(outside))


@pytest.mark.parametrize(
    "name", ["d/" * 2500 + "x.safetensors", "s/" + "b" * 250 + "/" + "c/" * 2000 + "x.safetensors"]
)
def test_a_shard_path_longer_than_a_file_system_takes_is_bad_input(tmp_path: Path, src: Path, name: str) -> None:
    """Every part under 255 bytes, the whole past PATH_MAX: the lookup's ENAMETOOLONG was an OS error (exit 1, now
    the environment's 5); it is the checkpoint's fault, exit 3, naming the index."""
    edit_json(src / INDEX, lambda index: index["weight_map"].update(dict.fromkeys(index["weight_map"], name)))
    for command in (("inspect", src), ("convert", src, tmp_path / "out"), ("verify", src, src)):
        clean_failure(fp8fix(*command), 3, tmp_path, INDEX)

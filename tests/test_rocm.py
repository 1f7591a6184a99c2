"""e4m3fn <-> e4m3fnuz: exactness, the normalize-then-requantize order, NaN refusal, round trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.builders import build, phi3
from tests.conftest import dequant, folder_digest, load_tensors, patch_bytes, raw, run_cli, run_process, shard_files
from tests.test_convert_layouts import fused_modules

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
KV = ("k_scale", "v_scale")
FP8_MODULE_PARAMS = ("weight_scale", "input_scale")


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal float32 values, with -0 and +0 counted equal (0x80 -> 0x00 is documented)."""
    return raw(a + 0.0) == raw(b + 0.0)


def fused_rows(module: str) -> list[int]:
    return next((f.rows for m, f in fused_modules() if m == module), [])


def dequant_rows(w: torch.Tensor, scale: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Dequantize, expanding a per-shard scale vector over each shard's rows."""
    if rows and scale.dim() == 1 and scale.numel() == len(rows):
        scale = scale.float().repeat_interleave(torch.tensor(rows)).reshape(-1, 1)
    return dequant(w, scale)


def convert(src: Path, out: Path, *args: str) -> dict:
    result = run_cli("convert", src, out, "--json", "-q", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def with_negative_zeros(src: Path) -> Path:
    """Real exports hold -0 (0x80) where tiny negative weights round to zero; make sure these do."""
    for name in shard_files(src):
        if name.endswith("o_proj.weight") or name.endswith("qkv_proj.weight"):
            patch_bytes(src, name, {3: 0x80, 200: 0x80})
    return src


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
@pytest.mark.parametrize(
    "scale,layout", [("tensor", "unfused"), ("tensor", "per-shard"), ("channel", "unfused"), ("shard", "fused")]
)
def test_fn_to_fnuz_is_exact_in_value(tmp_path: Path, fmt: str, scale: str, layout: str) -> None:
    src = with_negative_zeros(build(tmp_path / "src", phi3(), fmt=fmt, scale=scale if layout != "fused" else "tensor"))
    ref = tmp_path / "ref"  # the same layout without an encoding change: the values to match
    convert(src, ref, "--layout", layout)
    report = convert(src, tmp_path / "out", "--layout", layout, "--to", "e4m3fnuz")
    r, o = load_tensors(ref), load_tensors(tmp_path / "out")
    assert set(r) == set(o)
    assert report["encoding"]["source"] == "e4m3fn" and report["encoding"]["target"] == "e4m3fnuz"
    for name, t in r.items():
        module, _, param = name.rpartition(".")
        if t.dtype == FN:
            assert o[name].dtype == FNUZ
            out_codes, ref_codes = codes(o[name]), codes(t)
            assert torch.equal(out_codes, torch.where(ref_codes == 0x80, 0, ref_codes))
            rows = fused_rows(module)
            assert same_value(
                dequant_rows(o[name], o[module + ".weight_scale"], rows),
                dequant_rows(t, r[module + ".weight_scale"], rows),
            )
        elif param in FP8_MODULE_PARAMS:
            # per tensor, per shard and per channel: every entry doubled, nothing else changes
            assert o[name].dtype == t.dtype and o[name].shape == t.shape
            assert raw(o[name]) == raw(t * 2), name
        else:  # kv-cache scales, norms, embeddings, lm_head
            assert raw(o[name]) == raw(t), name
    for file in set(shard_files(tmp_path / "out").values()):
        with safe_open(tmp_path / "out" / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt", "fp8fix_encoding": "e4m3fnuz"}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- rocm" in card and "- e4m3fnuz" in card and "e4m3fn -> e4m3fnuz" in card


def test_kv_cache_scales_are_untouched(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    convert(src, tmp_path / "out", "--to", "e4m3fnuz")
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    kv = [n for n in s if n.endswith(KV)]
    assert len(kv) == 4
    assert all(raw(o[n]) == raw(s[n]) for n in kv)


def reference_fused_fnuz(w: torch.Tensor, scales: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The issue's order, written from its formulas: normalize fn -> fnuz (bits kept, 0x80 -> 0x00, scales
    doubled), THEN requantize each shard to the largest doubled scale in the fnuz domain: float32 dequantize,
    divide, clamp +-224, round to nearest even."""
    normalized = torch.where(codes(w) == 0x80, 0, codes(w)).view(FNUZ)
    doubled = scales.float() * 2
    top = doubled.max()
    out, start = [], 0
    for i, n in enumerate(rows):
        part = normalized[start : start + n].float() * doubled[i]
        out.append((part / top).clamp(-224, 224).to(FNUZ))
        start += n
    return torch.cat(out)


def reversed_order_fused_fnuz(w: torch.Tensor, scales: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The old Quark order: requantize first (in fn, with the fnuz kernel's +-224 clamp), then normalize."""
    top = scales.float().max()
    out, start = [], 0
    for i, n in enumerate(rows):
        part = w[start : start + n].float() * scales[i].float()
        out.append((part / top).clamp(-224, 224).to(FN))
        start += n
    fn_codes = codes(torch.cat(out))
    return torch.where(fn_codes == 0x80, 0, fn_codes).view(FNUZ)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_fused_fnuz_normalizes_before_requantizing(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale="shard")
    report = convert(src, tmp_path / "out", "--layout", "fused", "--to", "e4m3fnuz")
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    outliers = 0
    for module, f in fused_modules():
        w, scales = s[f"{module}.weight"], s[f"{module}.weight_scale"]
        assert bool((w.float().abs() > 224).any()), "the fixture must hold codes above 224"
        got = o[f"{module}.weight"]
        expected = reference_fused_fnuz(w, scales, f.rows)
        assert got.dtype == FNUZ
        assert torch.equal(codes(got), codes(expected)), f"{module}: not the normalize-first result"
        out_scale = o[f"{module}.weight_scale"]
        assert out_scale.float().item() == (scales.float().max() * 2).item()
        # the reversed order clips the outliers; the right order keeps them
        wrong = reversed_order_fused_fnuz(w, scales, f.rows)
        true_value = torch.cat(
            [
                w[a : a + n].float() * scales[i].float()
                for i, (a, n) in enumerate(zip(_starts(f.rows), f.rows, strict=True))
            ]
        )
        top = scales.float().max()
        clipped = true_value.abs() > 224 * top * (1 + 2**-4)
        outliers += int(clipped.sum())
        assert bool((wrong.float()[clipped].abs() * 2 * top <= 224 * top).all())
        assert not torch.equal(codes(wrong), codes(got))
        got_value = got.float() * out_scale.float()
        assert bool(((got_value[clipped] - true_value[clipped]).abs() <= 16 * top).all())
        # requantization error: at most half an fnuz step of each value at the max scale
        entry = next(m for m in report["modules"] if m["module"] == module)
        assert entry["action"] == "requantize" and 0 < entry["max_error_steps"] <= 0.5
        assert entry["max_error"] == pytest.approx(float((got_value - true_value).abs().max()), rel=1e-6)
    assert outliers > 0


def _starts(rows: list[int]) -> list[int]:
    return [sum(rows[:i]) for i in range(len(rows))]


def test_nan_codes_are_refused_with_a_count(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    name = "model.layers.0.mlp.down_proj.weight"  # not fused: only the encoding change rewrites it
    patch_bytes(src, name, {0: 0x7F, 9: 0xFF, 77: 0x7F})
    assert run_cli("convert", src, tmp_path / "plain", "-q").exit_code == 0  # untouched there
    result = run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz")
    assert result.exit_code == 3
    assert f"'{name}' holds 3 NaN codes in e4m3fn" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["unfused", "per-shard", "fused"])
def test_fn_fnuz_fn_round_trip_returns_the_source(tmp_path: Path, layout: str) -> None:
    src = with_negative_zeros(build(tmp_path / "src", phi3(), fmt="compressed-tensors"))
    convert(src, tmp_path / "ref", "--layout", layout)
    convert(src, tmp_path / "fnuz", "--layout", layout, "--to", "e4m3fnuz")
    convert(tmp_path / "fnuz", tmp_path / "back", "--layout", layout, "--to", "e4m3fn")
    r, b = load_tensors(tmp_path / "ref"), load_tensors(tmp_path / "back")
    assert set(r) == set(b)
    for name, t in r.items():
        assert b[name].dtype == t.dtype
        if t.dtype == FN:
            assert torch.equal(codes(b[name]), torch.where(codes(t) == 0x80, 0, codes(t))), name
        else:
            assert raw(b[name]) == raw(t), name


def test_fnuz_to_fn_keeps_the_scale_of_tensors_holding_240(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), scale="tensor")
    convert(src, tmp_path / "fnuz", "--to", "e4m3fnuz")
    name = "model.layers.0.mlp.down_proj.weight"
    # +240, -240, and fnuz codes below 2^-6 with odd mantissas (0x03, 0x0B), which e4m3fn cannot hold at this scale
    patch_bytes(tmp_path / "fnuz", name, {0: 0x7F, 1: 0xFF, 2: 0x03, 3: 0x0B, 4: 0x0B})
    report = convert(tmp_path / "fnuz", tmp_path / "fn", "--to", "e4m3fn")
    z, o = load_tensors(tmp_path / "fnuz"), load_tensors(tmp_path / "fn")
    module = name.rsplit(".", 1)[0]
    assert report["encoding"]["same_scale_weights"] == [name]
    # codes e4m3fn cannot hold at the same scale, counted independently with torch's own cast
    lossy = int((z[name].float().to(FN).float() != z[name].float()).sum())
    assert lossy >= 3 and report["encoding"]["inexact_codes"] == lossy
    assert raw(o[module + ".weight_scale"]) == raw(z[module + ".weight_scale"])  # kept, not halved
    assert raw(o[module + ".input_scale"]) == raw(z[module + ".input_scale"] / 2)  # activations: halved as usual
    scale = z[module + ".weight_scale"].float()
    before, after = dequant(z[name], scale), dequant(o[name], o[module + ".weight_scale"])
    assert after.flatten()[0] == 240 * scale and after.flatten()[1] == -240 * scale  # float32, like dequant
    diff = (after - before).abs()
    assert int((diff > 0).sum()) == lossy
    assert float(diff.max()) <= 2**-10 * scale.item() * (1 + 1e-6)  # half an fn subnormal step, float32 rounding
    # torch's own fnuz -> fn cast (round to nearest even) agrees code for code
    assert torch.equal(codes(o[name]), codes(z[name].float().to(FN)))
    other = "model.layers.0.mlp.down_proj.weight".replace("layers.0", "layers.1")
    assert raw(o[other]) == raw(z[other].view(torch.uint8).view(FN))


def test_fnuz_nan_code_is_refused(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    convert(src, tmp_path / "fnuz", "--to", "e4m3fnuz")
    patch_bytes(tmp_path / "fnuz", "model.layers.1.self_attn.o_proj.weight", {5: 0x80})
    result = run_cli("convert", tmp_path / "fnuz", tmp_path / "fn", "--to", "e4m3fn")
    assert result.exit_code == 3
    assert "model.layers.1.self_attn.o_proj.weight' holds 1 0x80 (NaN in e4m3fnuz)" in result.output


def test_to_the_same_encoding_changes_nothing(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    report = convert(src, tmp_path / "out", "--layout", "fused", "--to", "e4m3fn")
    assert report["encoding"] is None
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    assert all(raw(o[n]) == raw(t) for n, t in s.items())


def test_fnuz_conversion_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    src = build(tmp_path / "src", phi3())
    code = (
        "import sys\nfrom fp8fix.cli import main\n"
        f"sys.argv = ['fp8fix', 'convert', {str(src)!r}, {str(tmp_path / 'out')!r}, '--to', 'e4m3fnuz', '-q']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules\nprint('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_fn_to_fnuz_with_many_negative_zeros(tmp_path: Path) -> None:
    """A weight dense with -0: every 0x80 becomes 0x00, whatever the density (one bytes.replace per window)."""
    src = build(tmp_path / "src", phi3())
    name = "model.layers.0.mlp.gate_up_proj.weight"
    patch_bytes(src, name, {i: 0x80 for i in range(0, 6000, 7)})
    convert(src, tmp_path / "out", "--layout", "fused", "--to", "e4m3fnuz")
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    assert int((codes(s[name]) == 0x80).sum()) > 800
    assert torch.equal(codes(o[name]), torch.where(codes(s[name]) == 0x80, 0, codes(s[name])))


@pytest.mark.parametrize("options", [["--to", "e4m3fnuz"], ["--layout", "fused"]])
def test_jobs_do_not_change_a_byte(tmp_path: Path, options: list[str]) -> None:
    """Shards written by parallel workers are the bytes one process writes (fnuz recoding; requantizing).
    In new processes: this one has torch loaded, where fp8fix does not fork."""
    src = build(tmp_path / "src", phi3(layers=4), scale="shard", files=4)
    outputs = []
    for jobs in ("1", "2", "3"):
        out = tmp_path / f"out{jobs}"
        result = run_process("convert", src, out, "-q", "--jobs", jobs, "--verify", *options)
        assert result.returncode == 0, result.stderr
        outputs.append(folder_digest(out))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len([f for f in outputs[0] if f.endswith(".safetensors")]) == 4


def test_workers_are_forked_only_without_torch() -> None:
    """--jobs forks where torch is not loaded (the CLI), and runs in one process where it is."""
    from fp8fix.io.workers import worker_count

    assert worker_count(3, 4) == 1  # this process has torch
    probe = "from fp8fix.io.workers import worker_count as w; print(w(3, 4), w(3, 2), w(1, 4), w(3, 1))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["3", "2", "1", "1"]


def test_auto_jobs_are_the_cores_the_load_leaves_idle() -> None:
    """`--jobs auto` (the CLI's default, issue 30): this process's cores (a cgroup quota caps them) less the cores
    other processes keep busy, rounded, at least 1: a busy core gets no second worker, which ran 13-27% slower
    than one process."""
    from fp8fix.io.workers import cores_left_idle, quota_cores

    cases = {(2, 0.0): 2, (2, 0.4): 2, (2, 0.6): 1, (2, 1.0): 1, (2, 1.7): 1, (2, 40.0): 1, (8, 2.6): 5}
    cases |= {(8, 0.0): 8, (1, 0.0): 1, (16, 3.4): 13}
    for (cores, load), idle in cases.items():
        assert cores_left_idle(cores, load) == idle, (cores, load)
    quotas = {"max 100000\n": None, "200000 100000\n": 2, "150000 100000": 2, "50000 100000": 1, "": None}
    quotas |= {"garbage": None, "100 0": None, "-5 100000": None, "200000 100000 7": None}
    for text, allowed in quotas.items():
        assert quota_cores(text) == allowed, text


def test_auto_jobs_write_the_bytes_one_process_writes(tmp_path: Path) -> None:
    """`--jobs auto` and no --jobs at all take as many processes as `idle_cores` says (at least 1, at most the
    cores and the shards), report it in `processes`, and write what `--jobs 1` writes."""
    import os

    src = build(tmp_path / "src", phi3(layers=4), scale="shard", files=4)
    one = run_process("convert", src, tmp_path / "one", "--jobs", "1", "--to", "e4m3fnuz", "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["processes"] == 1, one.stderr
    for name, jobs in (("auto", ["--jobs", "auto"]), ("default", [])):
        result = run_process("convert", src, tmp_path / name, *jobs, "--to", "e4m3fnuz", "--json")
        assert result.returncode == 0, result.stderr
        assert 1 <= json.loads(result.stdout)["processes"] <= min(4, len(os.sched_getaffinity(0)))
        assert folder_digest(tmp_path / name) == folder_digest(tmp_path / "one")
    probe = "from fp8fix.io.workers import idle_cores as i, worker_count as w; n = i(); print(n, w('auto', 99) <= n)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    idle, capped = proc.stdout.split()
    assert 1 <= int(idle) <= len(os.sched_getaffinity(0)) and capped == "True"


def test_auto_jobs_are_asked_once_per_convert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`convert --verify` with `jobs="auto"` asks the load once, before writing: verify after a long parallel
    write would otherwise count the conversion's own workers as other processes' load and run in one."""
    import fp8fix
    from fp8fix.io import workers

    asked = []
    monkeypatch.setattr(workers, "idle_cores", lambda since=None: asked.append(since) or 1)
    monkeypatch.setattr(workers, "PARALLEL_BYTES", 0)  # this small checkpoint asks too
    src = build(tmp_path / "src", phi3(layers=2), scale="shard", files=2)
    result = fp8fix.convert(src, tmp_path / "out", to="e4m3fnuz", verify=True, jobs="auto")
    assert result.verification is not None and result.verification.ok and result.processes == 1
    assert len(asked) == 1 and asked[0] is not None  # watched since the conversion started, not from now


def test_auto_jobs_count_the_cores_other_processes_keep_busy_now() -> None:
    """`--jobs auto` reads the kernel's CPU time per core (/proc/stat) twice and takes away this process's own: a
    core another process spins on counts as busy at once, where the 1-minute load average lags (a conversion
    right after other work took one process on an idle machine). The text is read as the kernel writes it."""
    import os
    import time

    from fp8fix.io.workers import CpuReading, busy_seconds, others_busy

    hz = os.sysconf("SC_CLK_TCK")
    stat = (
        "cpu  900 9 90 5000 50 9 9 9 0 0\n"  # the sum line: not a core
        "cpu0 100 1 10 2000 20 1 1 1 0 0\n"  # user nice system idle iowait irq softirq steal guest guest_nice
        "cpu1 200 2 20 3000 30 2 2 2 0 0\n"
        "cpu7 600 6 60 0 0 6 6 6\n"
        "intr 123 4 5\ncpufoo 1 2 3 4\ncpu2 x y z w\n"
    )
    assert busy_seconds(stat, {0}) == (100 + 1 + 10 + 1 + 1 + 1) / hz
    assert busy_seconds(stat, {0, 1}) == (114 + 228) / hz
    assert busy_seconds(stat, {1, 7}) == (228 + 684) / hz
    assert busy_seconds(stat, {2, 3}) is None and busy_seconds("", {0}) is None
    # two cores busy for 2 s, of which this process ran 0.5 s: 1.25 cores were others'
    assert others_busy(CpuReading(10.0, 100.0, 3.0), CpuReading(12.0, 103.0, 3.5)) == 1.25
    assert others_busy(CpuReading(10.0, 100.0, 3.0), CpuReading(12.0, 100.2, 3.5)) == 0.0  # never below 0
    assert others_busy(CpuReading(10.0, None, 3.0), CpuReading(12.0, 103.0, 3.5)) is None
    assert others_busy(CpuReading(10.0, 100.0, 3.0), CpuReading(10.0, 103.0, 3.5)) is None
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this platform")
    from fp8fix.io.workers import read_cpu

    spin = "import time\nend = time.monotonic() + 5\nwhile time.monotonic() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # started
        start = read_cpu()
        time.sleep(0.5)
        busy = others_busy(start, read_cpu())
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.5, busy  # the spinner's core (it gets half a core at worst)


def test_auto_jobs_watch_the_kernel_not_the_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc/stat can be read the 1-minute load average is not asked (it lags); where it cannot, it is.
    Work under `PARALLEL_BYTES` runs in one process without watching anything."""
    import os
    import time

    from fp8fix.io import workers

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this platform")

    def lagging() -> tuple[float, float, float]:
        raise AssertionError("the load average was read")

    monkeypatch.setattr(os, "getloadavg", lagging)
    assert 1 <= workers.idle_cores() <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(workers, "_PROC_STAT", Path("/nonexistent/stat"))
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    assert workers.idle_cores() == 1  # the load average says every core is busy
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert workers.idle_cores() == min(len(os.sched_getaffinity(0)), workers.quota_cores(_cpu_max()) or 99)
    monkeypatch.setattr(workers, "idle_cores", lagging)
    assert workers.resolve_jobs("auto", workers.PARALLEL_BYTES - 1) == 1 and workers.resolve_jobs(3, 1) == 3
    # a command's window starts at the reading taken at import while it is recent (no wait), else now
    monkeypatch.setattr(workers, "_AT_IMPORT", workers.CpuReading(time.monotonic(), 1.0, 0.0))
    assert workers.window_start() is workers._AT_IMPORT
    monkeypatch.setattr(workers, "_AT_IMPORT", workers.CpuReading(time.monotonic() - workers.IMPORT_AGE, 1.0, 0.0))
    assert workers.window_start().at > workers._AT_IMPORT.at


def _cpu_max() -> str:
    try:
        return Path("/sys/fs/cgroup/cpu.max").read_text()
    except OSError:
        return ""

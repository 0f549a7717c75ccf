"""The doctor as a user runs it (a real process on 4 CPU devices), and its check runner."""
import os
import subprocess
import sys

import pytest

from llama_xla_helpers import doctor
from llama_xla_helpers.doctor import CHECKS, CheckFailed, check_compile_cache, cpu_fallbacks, one_line, run_checks

DOCTOR = [sys.executable, "-m", "llama_xla_helpers.doctor"]
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


def run(*args, timeout=300):
    return subprocess.run(DOCTOR + list(args), capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.child_process
def test_every_check_passes_on_4_cpu_devices(tmp_path):
    cache = tmp_path / "cache"
    out = run("--compile-cache", cache)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    names = [name for name, _, _ in CHECKS] + ["compile cache"]  # with a cache, what it did comes last
    assert [line.split(":")[0] for line in lines] == [f"PASS {name}" for name in names], out.stdout
    assert lines[0] == "PASS runtime: CPU, chip None, 4 devices, 1 host"
    assert "mesh (2, 2), batch 2, seq_len 64, fp32" in lines[2]
    entries = len(list(cache.iterdir()))  # a cold cache: every program compiled and written
    assert entries > 0 and lines[-1] == (f"PASS compile cache: {cache}: 0 programs loaded, {entries} compiled and "
                                         f"added, 0 found but not loadable on this device (compiled again)")


@pytest.mark.child_process
@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp16"], "error: argument --dtype: invalid choice: 'fp16'"),
    (["--cpu-devices", "0"], "error: argument --cpu-devices: '0' is not an int >= 1"),
    (["--compile-cache", __file__], f"error: compile cache {__file__!r} is a file, not a folder"),
])
def test_bad_argument_is_one_error_line(args, message):
    out = run(*args, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [l for l in out.stderr.splitlines() if l.strip() and not l.startswith(("W0000", "WARNING", "I0000"))]
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr[-2000:]
    assert out.stdout == ""


def test_a_failing_check_is_one_fail_line_and_exit_status_1(capsys):
    def noisy_pass(args):
        print("a library's own output")
        return "fine"

    def crash(args):
        raise RuntimeError("device lost\nsecond line of an XLA error")

    def wrong(args):
        raise CheckFailed("2 steps compiled 3 graphs, expected 2")

    checks = [("first", noisy_pass, "-"), ("second", crash, "restart the VM"), ("third", wrong, "read the causes")]
    assert run_checks(checks, None) == 1
    assert capsys.readouterr().out.splitlines() == [
        "PASS first: fine",  # what a check prints itself is dropped
        "FAIL second: RuntimeError: device lost; fix: restart the VM",
        "FAIL third: 2 steps compiled 3 graphs, expected 2; fix: read the causes",  # every check runs
    ]
    assert run_checks(checks[:1], None) == 0


def test_one_line_of_an_empty_message():
    assert one_line(KeyError()) == "KeyError"


def test_item_is_not_a_cpu_fallback():
    assert cpu_fallbacks(["aten::_local_scalar_dense"]) == []
    assert cpu_fallbacks(["aten::nonzero", "aten::_local_scalar_dense", "aten::nonzero", "aten::bincount"]) == [
        "aten::bincount", "aten::nonzero"]


def test_a_tpu_that_cannot_load_its_cache_fails_the_cache_check(monkeypatch):
    counters = {"compiles": 3, "PersistentCacheMiss": 0, "PersistentCacheHit": 0, "PersistentCacheLoad": 3,
                "PersistentCacheDeserializeFailure": 3}  # a warm run that found 3 programs and loaded none
    monkeypatch.setattr(doctor, "compile_cache_counters", lambda: counters)
    monkeypatch.setattr(doctor, "compile_cache_dir", lambda: "/cache")
    found = "/cache: 0 programs loaded, 0 compiled and added, 3 found but not loadable"
    monkeypatch.setattr(doctor.xr, "device_type", lambda: "TPU")
    with pytest.raises(CheckFailed, match=found):
        check_compile_cache(None)
    monkeypatch.setattr(doctor.xr, "device_type", lambda: "CPU")  # a CPU client never loads them
    assert check_compile_cache(None).startswith(found)
    counters.update(PersistentCacheHit=3, PersistentCacheDeserializeFailure=0)
    monkeypatch.setattr(doctor.xr, "device_type", lambda: "TPU")
    assert check_compile_cache(None).startswith("/cache: 3 programs loaded, 0 compiled and added, 0 found")

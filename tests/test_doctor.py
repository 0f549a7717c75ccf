"""The doctor as a user runs it (a real process on 4 CPU devices), and its check runner."""
import os
import subprocess
import sys

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from llama_xla_helpers import doctor, runtime
from llama_xla_helpers.hlo import compiled_hlo, instructions
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.doctor import (CHECKS, CheckFailed, check_checkpoint_dir, check_compile_cache, check_libtpu_flags,
                                      check_versions, cpu_fallbacks, multi_host_note, one_line, run_checks)
from llama_xla_helpers.runtime import default_dtype

DOCTOR = [sys.executable, "-m", "llama_xla_helpers.doctor"]
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


def run(*args, timeout=300):
    return subprocess.run(DOCTOR + list(args), capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.child_process
def test_every_check_passes_on_4_cpu_devices(tmp_path):
    cache = tmp_path / "cache"
    out = run("--compile-cache", cache, "--checkpoint-dir", tmp_path / "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    names = ["versions"] + [name for name, _, _ in CHECKS] + ["checkpoint dir", "compile cache"]
    assert [line.split(":")[0] for line in lines] == [f"PASS {name}" for name in names], out.stdout
    assert lines[0].startswith(f"PASS versions: python {sys.version.split()[0]}, torch 2.9.0")
    assert "torch_xla 2.9.0, libtpu none, transformers 5.23.0, jax 0.7.1, torchax 0.0.7" in lines[0]
    assert lines[1] == "PASS runtime: CPU, chip None, 4 devices, 1 host"
    assert f"mesh (2, 2), batch 2, seq_len 64, {default_dtype()}" in lines[3]  # fp32 here, unless the variable says
    assert lines[-3] == "PASS libtpu flags: LIBTPU_INIT_ARGS unset (libtpu reads it; this is not a TPU)"
    assert lines[-2].startswith(f"PASS checkpoint dir: {tmp_path / 'ckpt'}: this host can write there")
    entries = len(list(cache.iterdir()))  # a cold cache: every program compiled and written
    assert entries > 0 and lines[-1] == (f"PASS compile cache: {cache}: 0 programs loaded, {entries} compiled and "
                                         f"added, 0 found but not loadable on this device (compiled again)")


# Each a real launch (about 5 s): make test runs the first, make check-variants the others (DESIGN: extra
# bad-input launches go there).
@pytest.mark.child_process
@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp16"], "error: argument --dtype: invalid choice: 'fp16'"),
    pytest.param(["--cpu-devices", "0"], "error: argument --cpu-devices: '0' is not an int >= 1",
                 marks=pytest.mark.variants),
    pytest.param(["--compile-cache", __file__], f"error: compile cache {__file__!r} is a file, not a folder",
                 marks=pytest.mark.variants),
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


def test_torch_and_torch_xla_of_different_releases_fail():
    found = dict(python="3.11.7", torch="2.11.0", torch_xla="2.9.0", libtpu=None, transformers="5.23.0", jax=None,
                 torchax=None)
    with pytest.raises(CheckFailed, match="torch 2.11.0 with torch_xla 2.9.0, which is built for torch 2.9.0"):
        check_versions(None, found)
    assert check_versions(None, dict(found, torch="2.9.0+cu128", libtpu="0.0.21")).startswith(
        "python 3.11.7, torch 2.9.0+cu128, torch_xla 2.9.0, libtpu 0.0.21, transformers 5.23.0, jax none")


@pytest.mark.parametrize("accelerator, source", [("v6e-8", "the Trillium Llama 3 70B recipe"),
                                                 ("v5p-8", "the v5p Mixtral-8x7B recipe"),
                                                 ("v5litepod-4", "no public PyTorch recipe for tpu-v5e")])
def test_the_libtpu_line_says_what_init_runtime_set(monkeypatch, accelerator, source):
    monkeypatch.setattr(doctor.xr, "device_type", lambda: "TPU")
    monkeypatch.setenv("ACCELERATOR_TYPE", accelerator)
    monkeypatch.setattr(runtime, "USER_LIBTPU_INIT_ARGS", None)  # unset by the user: init_runtime added the flags
    monkeypatch.setenv("LIBTPU_INIT_ARGS", runtime.OVERLAP_FLAGS)
    line = check_libtpu_flags(None)
    assert line.startswith(f"LIBTPU_INIT_ARGS='{runtime.OVERLAP_FLAGS}': init_runtime added the flags that overlap "
                           f"collectives with compute (") and source in line
    monkeypatch.setattr(runtime, "USER_LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=true")  # the user's
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=true")
    line = check_libtpu_flags(None)
    assert line.startswith("LIBTPU_INIT_ARGS='--xla_enable_async_all_gather=true': yours, kept; init_runtime adds") \
        and source in line and line.endswith(f"only when it is unset: '{runtime.OVERLAP_FLAGS}'")


def test_doctor_overlap_flags_are_runtimes():
    assert doctor.OVERLAP_FLAGS is runtime.OVERLAP_FLAGS


@pytest.mark.devices
def test_the_memory_measure_is_one_graph_of_dependent_passes():
    """One run of the bandwidth measure: one compiled program, one execution, its passes a loop XLA keeps
    (each reads what the previous wrote: 1 - (1 - x) ... ), not one fused pass."""
    n = xr.global_runtime_device_count()
    x = torch.arange(n * 1000, dtype=torch.float32, device=torch_xla.device())  # a shape no other test compiles
    xs.mark_sharding(x, make_mesh((n,), ("data",)), ("data",))
    torch_xla.sync()
    xm.wait_device_ops()  # executions are counted when they end, after sync returns: count none of x's
    count = lambda: [(met.metric_data(name) or [0])[0] for name in ("CompileTime", "ExecuteReplicatedTime")]
    before = count()
    with compiled_hlo() as modules:
        out = doctor.memory_passes(x, 5)
        torch_xla.sync()
        xm.wait_device_ops()
    assert [after - b for after, b in zip(count(), before)] == [1, 1]  # compiled once, run once
    assert torch.equal(out.cpu(), 1 - torch.arange(n * 1000.0))  # 5 passes of 1 - x: an odd number
    [module] = modules
    [loop] = instructions(module, "while")
    assert '"known_trip_count":{"n":"4"}' in loop  # the first pass, then 4 in the loop


def test_checkpoint_dir_check(tmp_path, monkeypatch):
    args = lambda d: type("Args", (), {"checkpoint_dir": str(d)})
    assert check_checkpoint_dir(args(tmp_path / "new")).startswith(f"{tmp_path / 'new'}: this host can write")
    assert list((tmp_path / "new").iterdir()) == []  # the probe file is gone
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError):
        check_checkpoint_dir(args(tmp_path / "file"))
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed
    with pytest.raises(CheckFailed, match="gs://bucket/ckpt is a Google Cloud Storage URL and gcsfs is not installed"):
        check_checkpoint_dir(args("gs://bucket/ckpt"))


@pytest.mark.parametrize("accelerator, hosts", [("v4-16", 2), ("v5litepod-16", 4), ("v4-8", None), ("v6e-8", None)])
def test_one_host_of_a_multi_host_slice_is_told_to_run_on_every_host(monkeypatch, accelerator, hosts):
    monkeypatch.setattr(doctor, "tpu_chips_present", lambda: True)
    monkeypatch.setenv("ACCELERATOR_TYPE", accelerator)
    note = multi_host_note()
    assert (note is None) if hosts is None else note.startswith(f"{accelerator} has {hosts} hosts: the TPU runtime")
    monkeypatch.setattr(doctor, "tpu_chips_present", lambda: False)
    assert multi_host_note() is None


def test_on_a_pod_only_process_0_prints(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "VERSIONS_CHECK", ("versions", lambda args: "v", "-"))
    monkeypatch.setattr(doctor, "CHECKS", (("runtime", lambda args: "up", "-"), ("other", lambda args: "ok", "-")))
    monkeypatch.setattr(doctor.xr, "process_index", lambda: 1)
    assert doctor.main([]) == 0 and capsys.readouterr().out == ""
    monkeypatch.setattr(doctor.xr, "process_index", lambda: 0)
    assert doctor.main([]) == 0
    assert capsys.readouterr().out.splitlines() == ["PASS versions: v", "PASS runtime: up", "PASS other: ok"]


def test_a_tpu_with_torch_xla_2_9_skips_the_compile_cache_and_says_why(monkeypatch):
    monkeypatch.setattr(doctor, "compile_cache_dir", lambda: None)  # init_runtime skipped it
    monkeypatch.setattr(doctor.xr, "device_type", lambda: "TPU")
    monkeypatch.delenv("LLAMA_XLA_FORCE_COMPILE_CACHE", raising=False)
    assert check_compile_cache(None).startswith("compile cache skipped: torch_xla 2.9.0 on a TPU cannot load what "
                                                "it writes (pytorch/xla#9094")

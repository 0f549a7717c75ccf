"""The runtime tells the truth: device kind, count, hosts and chip, never a silent CPU on a TPU VM.

A TPU cannot be run here, so what differs on one is faked: the device type torch_xla reports,
the TPU type variables of a TPU VM (ACCELERATOR_TYPE) or GKE (TPU_ACCELERATOR_TYPE), the chips.
"""
import os
import subprocess
import sys
import tempfile

import pytest
import torch_xla.runtime as xr

from llama_xla_helpers import runtime
from llama_xla_helpers.runtime import RuntimeInfo, chip, init_runtime
from util import N


@pytest.fixture
def fake_tpu(monkeypatch):
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    for var in ("ACCELERATOR_TYPE", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.devices
def test_runtime_reports_the_cpu_stand_in(runtime):
    assert runtime == RuntimeInfo("CPU", N, 0, 1, None)
    assert init_runtime() == runtime  # a second call returns the same answer
    assert str(runtime) == f"XLA runtime: CPU, {N} devices, 1 process, chip None"


@pytest.mark.devices
def test_runtime_refuses_another_device_count():
    with pytest.raises(RuntimeError, match=f"already started with {N} CPU devices.*cpu_devices={N + 1}"):
        init_runtime(N + 1)


@pytest.mark.parametrize("device, variable, expected", [
    ("CPU", None, "fp32"), ("TPU", None, "bf16"), ("CPU", "bf16", "bf16"), ("TPU", "fp32", "fp32"), ("CPU", "", "fp32")])
def test_default_dtype_is_the_devices_unless_the_variable_says(monkeypatch, device, variable, expected):
    monkeypatch.setattr(xr, "device_type", lambda: device)
    if variable is None:
        monkeypatch.delenv("LLAMA_XLA_DEFAULT_DTYPE", raising=False)
    else:
        monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", variable)
    assert runtime.default_dtype() == expected


@pytest.mark.parametrize("accelerator, hosts", [
    ("v4-8", 1), ("v4-16", 2), ("v4-32", 4), ("v5p-8", 1), ("v5p-16", 2), ("v5litepod-1", 1), ("v5litepod-8", 1),
    ("v5litepod-16", 4), ("v6e-4", 1), ("v6e-8", 1), ("v6e-16", 4), ("v6e-256", 64), ("tpu-v5-lite-podslice", None),
    (None, None)])
def test_hosts_of_a_tpu_slice_from_its_type(accelerator, hosts):
    assert runtime.tpu_hosts(accelerator) == hosts


@pytest.mark.parametrize("kind, version, forced, skipped", [
    ("TPU", "2.9.0", False, True), ("TPU", "2.9.0+libtpu", False, True), ("TPU", "2.9.0", True, False),
    ("TPU", "2.10.0", False, False), ("CPU", "2.9.0", False, False)])
def test_the_compile_cache_is_skipped_where_it_cannot_load(kind, version, forced, skipped):
    reason = runtime.cache_skip_reason(kind, version, forced)
    assert (reason is not None) == skipped
    if skipped:
        assert "pytorch/xla#9094" in reason and "LLAMA_XLA_FORCE_COMPILE_CACHE=1" in reason


def test_a_bad_default_dtype_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "fp16")
    with pytest.raises(ValueError, match="LLAMA_XLA_DEFAULT_DTYPE='fp16' .* set it to bf16 or fp32, or unset it"):
        runtime.default_dtype()


@pytest.mark.parametrize("accelerator, expected", [
    ("v4-8", "tpu-v4"), ("v4-16", "tpu-v4"), ("v5litepod-8", "tpu-v5e"), ("v5litepod-4", "tpu-v5e"),
    ("v5p-8", "tpu-v5p"), ("v6e-4", "tpu-v6e"), ("v6e-8", "tpu-v6e"), ("v3-8", None)])
def test_chip_from_the_tpu_vm_type(fake_tpu, accelerator, expected):
    fake_tpu.setenv("ACCELERATOR_TYPE", accelerator)
    assert chip() == expected


def test_chip_from_gke_and_from_the_metadata_server(fake_tpu):
    fake_tpu.setenv("TPU_ACCELERATOR_TYPE", "tpu-v5-lite-podslice")
    assert chip() == "tpu-v5e"
    fake_tpu.delenv("TPU_ACCELERATOR_TYPE")
    fake_tpu.setattr(runtime, "_metadata_accelerator_type", lambda: "v6e-8")
    assert chip() == "tpu-v6e"
    fake_tpu.setattr(runtime, "_metadata_accelerator_type", lambda: None)  # no metadata server
    assert chip() is None


def test_chip_is_none_on_a_cpu_and_asks_nobody(monkeypatch):
    monkeypatch.setenv("ACCELERATOR_TYPE", "v4-8")  # ignored: the device is a CPU
    monkeypatch.setattr(runtime, "_metadata_accelerator_type", lambda: pytest.fail("asked the metadata server"))
    assert chip() is None


@pytest.mark.child_process
def test_no_silent_cpu_on_a_machine_with_tpu_chips(tmp_path):
    """With chips attached but the runtime on the CPU, init_runtime stops and says how to fix it."""
    code = ("from llama_xla_helpers import runtime\n"
            "runtime.tpu_chips_present = lambda: True\n"
            "runtime.init_runtime()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PJRT_DEVICE": "CPU", "HOME": str(tmp_path)})
    assert out.returncode != 0
    assert "this machine has TPU chips but the XLA runtime chose CPU: PJRT_DEVICE=CPU is set; unset it" in out.stderr


def test_package_import_leaves_the_device_choice_to_torch_xla_when_chips_are_present(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: True)
    runtime.select_device()
    assert "PJRT_DEVICE" not in os.environ
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: False)
    runtime.select_device()
    assert os.environ["PJRT_DEVICE"] == "CPU"


def test_the_dump_folder_of_a_killed_process_goes_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tempfile.gettempdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"llama-xla-hlo-{gone.pid}-k1x"  # a process that ended without its atexit
    orphan.mkdir()
    (orphan / "module_0001.txt").write_text("HloModule")
    mine, unknown = tmp_path / f"llama-xla-hlo-{os.getpid()}-a2b", tmp_path / "llama-xla-hlo-a2b"
    mine.mkdir()
    unknown.mkdir()  # no pid in the name: not ours to remove
    runtime.remove_orphan_dump_dirs()
    assert not orphan.exists() and mine.exists() and unknown.exists()

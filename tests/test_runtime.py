"""The runtime tells the truth: device kind, count, hosts and chip, never a silent CPU on a TPU VM.

A TPU cannot be run here, so what differs on one is faked: the device type torch_xla reports,
the TPU type variables of a TPU VM (ACCELERATOR_TYPE) or GKE (TPU_ACCELERATOR_TYPE), the chips.
"""
import logging
import os
import subprocess
import sys
import tempfile

import pytest
import torch_xla
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


def test_setting_the_matmul_precision_logs_nothing_after_init_runtime(runtime, caplog):
    import torch_xla.backends

    torch_xla.backends.set_mat_mul_precision(torch_xla.backends.get_mat_mul_precision())
    assert caplog.records == []
    caplog.clear()
    record = logging.LogRecord("torch_xla.backends", logging.WARNING, __file__, 0, "another warning", None, None)
    logging.getLogger("torch_xla.backends").handle(record)  # the filter drops that one message only
    assert caplog.records == [record]


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


@pytest.mark.fixed_dtype
def test_a_test_marked_fixed_dtype_fails_if_it_reads_the_default_dtype():
    """conftest's check of the mark that check-variants' bf16 parts skip: in such a test (and its child
    processes) the default dtype is an error, so a test that wrongly says it never reads it fails."""
    with pytest.raises(ValueError, match="LLAMA_XLA_DEFAULT_DTYPE='none: this test is marked fixed_dtype'"):
        runtime.default_dtype()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['LLAMA_XLA_DEFAULT_DTYPE'])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "none: this test is marked fixed_dtype"


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


@pytest.fixture
def torch_xla_import(monkeypatch):
    """LIBTPU_INIT_ARGS as torch_xla's import leaves it on a v5 TPU VM, from the user's value (None: unset)."""
    monkeypatch.setattr(torch_xla._internal.tpu, "version", lambda: 5)

    def after_import(user_value):
        if user_value is None:
            monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
        else:
            monkeypatch.setenv("LIBTPU_INIT_ARGS", user_value)
        torch_xla._setup_libtpu_flags()  # what the import runs on a machine with chips
        return os.environ["LIBTPU_INIT_ARGS"]
    return after_import


def test_on_a_tpu_the_overlap_flags_are_added_to_torch_xlas_defaults(torch_xla_import):
    defaults = torch_xla_import(None).split()
    env = runtime.tpu_env({"LIBTPU_INIT_ARGS": " ".join(defaults)}, chips=True)
    flags = env["LIBTPU_INIT_ARGS"].split()
    assert flags[:len(defaults)] == defaults  # torch_xla's own, first and unchanged
    assert set(runtime.OVERLAP_FLAGS.split()) <= set(flags) and len(flags) == len(set(flags))  # none twice
    assert "--xla_enable_async_all_gather=true" in defaults and len(flags) == len(defaults) + 4  # v5's default kept
    assert env == {"LIBTPU_INIT_ARGS": " ".join(flags)}  # no TPU_STDERR_LOG_LEVEL unless the partitioner's warnings are read
    assert runtime.tpu_env({}, chips=True) == {"LIBTPU_INIT_ARGS": runtime.OVERLAP_FLAGS}
    assert runtime.tpu_env({"LIBTPU_INIT_ARGS": runtime.OVERLAP_FLAGS}, chips=True) == {}  # a second call adds nothing


def test_a_libtpu_init_args_the_user_set_is_kept_whole(torch_xla_import):
    mine = "--xla_tpu_enable_async_collective_fusion=false"
    environ = {"LIBTPU_INIT_ARGS": torch_xla_import(mine)}  # torch_xla's import appended its defaults
    assert environ["LIBTPU_INIT_ARGS"].startswith(mine + " --")
    assert runtime.tpu_env(environ, chips=True, user_libtpu_args=mine) == {}
    environ = {"LIBTPU_INIT_ARGS": torch_xla_import("")}
    assert runtime.tpu_env(environ, chips=True, user_libtpu_args="") == {}  # set but empty: the way to opt out


@pytest.mark.parametrize("environ", [{}, {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_flash_attention=false"}])
def test_nothing_is_set_without_tpu_chips(environ):
    assert runtime.tpu_env(environ, chips=False, partitioner_warnings=True) == {}


def test_libtpus_stderr_log_is_verbose_only_for_the_partitioners_warnings():
    user = dict(user_libtpu_args="")  # LIBTPU_INIT_ARGS left aside
    assert runtime.tpu_env({}, chips=True, **user) == {}  # its INFO lines would flood every run
    assert runtime.tpu_env({}, chips=True, partitioner_warnings=True, **user) == {"TPU_STDERR_LOG_LEVEL": "0"}  # hlo.py reads it
    assert runtime.tpu_env({"TPU_STDERR_LOG_LEVEL": "2"}, chips=True, partitioner_warnings=True, **user) == {}  # the user's wins


@pytest.fixture
def fresh_tpu_vm(fake_tpu):
    """init_runtime as a new process on a one-host TPU VM (v5litepod-8) runs it: chips, no runtime yet."""
    fake_tpu.setattr(runtime, "tpu_chips_present", lambda: True)
    fake_tpu.setattr(torch_xla._XLAC, "_xla_runtime_is_initialized", lambda: False)
    fake_tpu.setenv("ACCELERATOR_TYPE", "v5litepod-8")
    for var in ("LIBTPU_INIT_ARGS", "TPU_STDERR_LOG_LEVEL"):
        fake_tpu.delenv(var, raising=False)
    fake_tpu.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the hlo_dump_dir call
    return fake_tpu


def test_init_runtime_on_a_tpu_sets_the_overlap_flags(fresh_tpu_vm, tmp_path, capsys):
    fresh_tpu_vm.setattr(runtime, "USER_LIBTPU_INIT_ARGS", None)
    info = init_runtime()
    assert os.environ["LIBTPU_INIT_ARGS"] == runtime.OVERLAP_FLAGS and "TPU_STDERR_LOG_LEVEL" not in os.environ
    assert capsys.readouterr().out == f"{info}\n" and info.chip == "tpu-v5e"  # nothing printed about the flags
    init_runtime(hlo_dump_dir=tmp_path)  # an HLO dump alone leaves libtpu's log level
    assert "TPU_STDERR_LOG_LEVEL" not in os.environ
    init_runtime(partitioner_warnings=True)
    assert os.environ["TPU_STDERR_LOG_LEVEL"] == "0"


def test_init_runtime_keeps_the_users_libtpu_init_args_and_process_0_says_so(fresh_tpu_vm, capsys):
    fresh_tpu_vm.setattr(runtime, "USER_LIBTPU_INIT_ARGS", "--mine=1")
    fresh_tpu_vm.setenv("LIBTPU_INIT_ARGS", "--mine=1")
    init_runtime()
    assert os.environ["LIBTPU_INIT_ARGS"] == "--mine=1"
    assert capsys.readouterr().out.splitlines()[1:] == [
        "LIBTPU_INIT_ARGS='--mine=1' is set, so init_runtime kept it and added none of the overlap flags "
        "(runtime.OVERLAP_FLAGS); unset it to get them"]
    fresh_tpu_vm.setattr(xr, "process_index", lambda: 1)
    init_runtime()
    assert capsys.readouterr().out == ""  # the other hosts print nothing


def test_a_started_runtime_sets_nothing(monkeypatch):
    monkeypatch.setattr(runtime, "tpu_env", lambda *args: pytest.fail("tpu_env called after the runtime started"))
    assert init_runtime().device_kind == "CPU"


@pytest.mark.parametrize("accelerator, hosts", [("v4-16", 2), ("v5litepod-16", 4), ("v6e-256", 64), ("v4-8", None),
                                                ("v6e-8", None), ("tpu-v5-lite-podslice", None)])
def test_a_multi_host_slice_from_its_type(monkeypatch, accelerator, hosts):
    monkeypatch.setattr(runtime, "_metadata_accelerator_type", lambda: pytest.fail("asked the metadata server"))
    monkeypatch.setenv("ACCELERATOR_TYPE", accelerator)
    assert runtime.multi_host_slice() == hosts
    monkeypatch.delenv("ACCELERATOR_TYPE")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)  # GKE's variable
    assert runtime.multi_host_slice() == hosts and runtime.multi_host_slice("v4-32") == 4


def test_the_metadata_server_is_asked_for_the_slice_only_with_chips(monkeypatch):
    for var in ("ACCELERATOR_TYPE", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(runtime, "_metadata_accelerator_type", lambda: "v5p-32")
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: False)
    assert runtime.multi_host_slice() is None
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: True)
    assert runtime.multi_host_slice() == 4

import os

import pytest
import torch_xla.backends
from llama_xla_helpers.runtime import DTYPE_VAR, init_runtime

# One runtime per test process: CPU_NUM_DEVICES (default 8) virtual CPU devices (or the TPU),
# compiled HLO dumped to a temporary folder (removed at exit) so tests can read the collectives.
# `make check-variants` runs the tests marked `devices` with CPU_NUM_DEVICES=1, 4 and 16.
RUNTIME = init_runtime(hlo_dump_dir=True)
# The tests compare sharded with unsharded, ours with Hugging Face's: fp32 matmuls must run in
# fp32. On a TPU the default precision multiplies fp32 inputs in bf16 (one pass); 'highest'
# takes six passes for about fp32's accuracy. (The CPU computes fp32 in any case.) Set once.
torch_xla.backends.set_mat_mul_precision("highest")


@pytest.fixture(scope="session")
def runtime():
    return RUNTIME


def pytest_collection_modifyitems(items):
    # A child process cannot open a TPU that this process holds: those tests run on the CPU only.
    on_tpu = pytest.mark.skip(reason="starts a child process that opens the device, which this process holds")
    for item in items:
        if RUNTIME.device_kind == "TPU" and "child_process" in item.keywords:
            item.add_marker(on_tpu)


def mapped_regions():
    """(memory regions this process maps, the kernel's limit: vm.max_map_count) on Linux, else None."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return None


GROWTH = [0]  # the most regions one test has added in this process


# A test marked `fixed_dtype` says the default dtype never reaches it (it pins fp32, or builds nothing that asks),
# so check-variants' bf16 parts, which change only that default, skip it as a repetition. The mark is checked on
# every run: while such a test runs (its fixtures and child processes too), LLAMA_XLA_DEFAULT_DTYPE holds a value
# that runtime.default_dtype() refuses, so a test that does read the default fails, naming the variable.
NOT_A_DTYPE = "none: this test is marked fixed_dtype"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    saved = os.environ.get(DTYPE_VAR)
    if item.get_closest_marker("fixed_dtype"):
        os.environ[DTYPE_VAR] = NOT_A_DTYPE
    # XLA:CPU keeps every program it compiled mapped; past the limit the process crashes (a segfault) in
    # whichever test crosses it. Stop before a test that could cross it, saying why and what to do.
    before = mapped_regions()
    if before and before[0] + GROWTH[0] > before[1]:
        pytest.exit(f"error: before {item.nodeid} this process maps {before[0]:,} memory regions and one test "
                    f"here added {GROWTH[0]:,}; past vm.max_map_count ({before[1]:,}) it crashes. XLA:CPU keeps "
                    "every compiled program mapped: run fewer test files in one process (Makefile: TESTS_OWN)",
                    returncode=3)
    yield
    os.environ.pop(DTYPE_VAR, None)
    if saved is not None:
        os.environ[DTYPE_VAR] = saved
    after = mapped_regions()
    if before and after:
        GROWTH[0] = max(GROWTH[0], after[0] - before[0])

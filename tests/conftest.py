import pytest
import torch_xla.backends
from llama_xla_helpers.runtime import init_runtime

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

"""Device setup: the TPU when there is one, else N virtual CPU devices standing in for a slice.

The XLA runtime reads PJRT_DEVICE and CPU_NUM_DEVICES once, when it starts (at the first
device query or tensor), so `init_runtime()` must run before any of that.
"""
import glob
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeInfo:
    device_kind: str    # "TPU" or "CPU"
    num_devices: int    # devices in the whole job (all hosts)
    process_index: int  # this host's index; 0 writes shared files
    process_count: int  # hosts in the job


def default_pjrt_device():
    """TPU if libtpu is installed and a chip is attached (v4: /dev/accel*, v5e on: /dev/vfio), else CPU."""
    chips = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return "TPU" if importlib.util.find_spec("libtpu") is not None and chips else "CPU"


def init_runtime(cpu_devices=8, hlo_dump_dir=None):
    """Start the XLA runtime in SPMD mode and return what it got.

    On a TPU VM (libtpu installed, chips attached) this uses the TPU and ignores
    `cpu_devices`; elsewhere it makes `cpu_devices` virtual CPU devices. Safe to call twice.
    `hlo_dump_dir` makes XLA write every compiled module there as text (see `hlo.py`).
    """
    if hlo_dump_dir:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={hlo_dump_dir} --xla_dump_hlo_as_text").strip()
    os.environ.setdefault("PJRT_DEVICE", default_pjrt_device())
    import torch_xla
    import torch_xla.runtime as xr

    on_cpu = xr.device_type() == "CPU"
    if on_cpu and not torch_xla._XLAC._xla_runtime_is_initialized():
        os.environ["CPU_NUM_DEVICES"] = str(cpu_devices)
    if not xr.is_spmd():
        xr.use_spmd()
    info = RuntimeInfo(xr.device_type(), xr.global_runtime_device_count(),
                       xr.process_index(), xr.process_count())
    if on_cpu and info.num_devices != cpu_devices:
        raise RuntimeError(
            f"the XLA runtime already started with {info.num_devices} CPU devices, so it cannot "
            f"give cpu_devices={cpu_devices}; restart the process (or kernel) and call "
            f"init_runtime({cpu_devices}) before any XLA tensor or device query")
    return info

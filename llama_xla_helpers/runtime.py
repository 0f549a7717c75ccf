"""Device setup: the TPU when there is one, else N virtual CPU devices standing in for a slice.

The XLA runtime reads PJRT_DEVICE and CPU_NUM_DEVICES once, when it starts (at the first
device query or tensor), so `init_runtime()` must run before any of that.

    info = init_runtime()   # XLA runtime: TPU, 4 devices, 1 process, chip tpu-v5e
    chip()                  # "tpu-v5e": a key of metrics.PEAK_FLOPS, or None on a CPU
    init_runtime(cache_dir="xla-cache")  # compiled programs kept on disk across restarts

On a TPU, `init_runtime` also sets what libtpu reads when the runtime starts (`tpu_env`): the public
recipes' flags that overlap collectives with compute (OVERLAP_FLAGS), unless LIBTPU_INIT_ARGS is set
already (even empty: then yours is kept), and libtpu's verbose stderr only for an HLO dump.

The persistent compilation cache (`cache_dir`, or the LLAMA_XLA_COMPILE_CACHE variable) must
be set up before the first compilation, which `init_runtime` does when it is the first thing a
process calls. What it keeps and where:

- One file per compiled program, named by the hash torch_xla keys its in-memory cache on (the
  graph with its shapes and shardings, the torch_xla / libtpu versions, the compile options).
  A new torch_xla or libtpu misses and writes new entries; nothing is ever evicted: delete the
  folder to clear it.
- On a job of several processes (a pod: one per host) each process uses DIR/process-<index>,
  so no two processes write the same file, whether DIR is a local disk or a mount shared by
  every host. `cache_readonly=True` reads that same layout and writes nothing: for a cache on a
  shared mount that one earlier run (of the same shape) filled, read by many later jobs.
- The CPU client writes entries but cannot load them: a second process logs "Failed to
  deserialize executable: UNIMPLEMENTED: Deserializing serialized executable not supported",
  counts PersistentCacheDeserializeFailure and compiles again (measured here). A TPU is meant
  to load them (counter PersistentCacheHit); pytorch/xla issue 9094 reports the same failure on
  TPUs with torch_xla 2.9.0, so read the counters on yours (`compile_cache_counters()`).
"""
import atexit
import functools
import glob
import logging
import os
import re
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CPU_DEVICES = 8
COMPILE_CACHE_VAR = "LLAMA_XLA_COMPILE_CACHE"  # the default of init_runtime's cache_dir
DTYPE_VAR = "LLAMA_XLA_DEFAULT_DTYPE"  # "fp32" | "bf16": what default_dtype() returns on any device
# The TPU type as a TPU VM names it (ACCELERATOR_TYPE=v5litepod-8) or GKE does
# (TPU_ACCELERATOR_TYPE=tpu-v5-lite-podslice): prefix -> metrics.PEAK_FLOPS key, first match wins.
CHIP_PREFIXES = (("v5litepod", "tpu-v5e"), ("v5-lite", "tpu-v5e"), ("v5e", "tpu-v5e"),
                 ("v5p", "tpu-v5p"), ("v6e", "tpu-v6e"), ("v4", "tpu-v4"))
# torch_xla releases whose TPU client cannot load the persistent compile cache it writes (pytorch/xla
# issue 9094; PR 9759 addresses it after 2.9.0): init_runtime skips the cache there unless this variable is 1.
CACHE_CANNOT_LOAD_ON_TPU = ("2.9.0",)
FORCE_CACHE_VAR = "LLAMA_XLA_FORCE_COMPILE_CACHE"
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"
# Flags that let XLA overlap collectives with compute on a TPU (async collective fusion, all-gathers
# started early), as the public PyTorch/XLA training recipes set them in LIBTPU_INIT_ARGS (the
# github.com/gclouduniverse/reproducibility recipes: Training/TPU-v5p/Mixtral-8x7B-PyTorch/env.sh for v5p,
# Training/TPU-Trillium/Llama3-70B-PyTorch/env.sh for v6e). No recipe there covers v4 or v5e with PyTorch;
# the same flags are libtpu's, untested on those here. init_runtime adds them on a TPU (`tpu_env`).
OVERLAP_FLAGS = ("--xla_tpu_enable_async_collective_fusion=true "
                 "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                 "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                 "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
# LIBTPU_INIT_ARGS as the user set it, read when the package is imported (its __init__ imports this module
# first): on a machine with chips, torch_xla's import then appends its own defaults to the variable, so what
# is in the environment later is no longer only the user's. Import llama_xla_helpers before torch_xla.
USER_LIBTPU_INIT_ARGS = os.environ.get("LIBTPU_INIT_ARGS")


@dataclass(frozen=True)
class RuntimeInfo:
    device_kind: str    # "TPU" or "CPU"
    num_devices: int    # devices in the whole job (all hosts)
    process_index: int  # this host's index; 0 writes shared files
    process_count: int  # hosts in the job
    chip: str = None    # a metrics.PEAK_FLOPS key ("tpu-v4", ...) or None (CPU, unknown TPU)

    def __str__(self):
        hosts = f"{self.process_count} process{'es' * (self.process_count > 1)}"
        return f"XLA runtime: {self.device_kind}, {self.num_devices} devices, {hosts}, chip {self.chip}"


def tpu_chips_present():
    """True if this machine has TPU chips attached (v2-v4: /dev/accel*, v5e and later: /dev/vfio/N)."""
    return bool(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def select_device():
    """Set PJRT_DEVICE=CPU on a machine without TPU chips, unless it is set already.

    With chips, nothing is set: torch_xla's own detection picks the TPU (and `init_runtime`
    refuses a CPU there). Without chips this only saves torch_xla's "Defaulting to CPU" warning.
    """
    if not tpu_chips_present():
        os.environ.setdefault("PJRT_DEVICE", "CPU")


DUMP_PREFIX = "llama-xla-hlo-"  # + the pid of the process that writes the folder


def remove_orphan_dump_dirs():
    """Remove the temporary HLO dump folders of processes that are gone. A process removes its own
    at exit, but not when it is killed (a Jupyter kernel that does not stop in time is), and each
    holds 100s of MB."""
    for path in Path(tempfile.gettempdir()).glob(f"{DUMP_PREFIX}*-*"):
        pid = path.name.removeprefix(DUMP_PREFIX).split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def init_runtime(cpu_devices=None, hlo_dump_dir=None, cache_dir=None, cache_readonly=False,
                 partitioner_warnings=False):
    """Start the XLA runtime in SPMD mode, print what it got (process 0, first call) and return it.

    On a TPU VM this uses the TPU and ignores `cpu_devices`. On a CPU it makes `cpu_devices`
    virtual devices: the argument, else the CPU_NUM_DEVICES variable, else 8. Safe to call
    twice; a different explicit `cpu_devices` once the runtime runs is an error.
    `hlo_dump_dir` makes XLA write every compiled module there as text (see `hlo.py`); True
    means a temporary folder, removed when the process exits (a step's dump can be 100s of MB), or,
    if it is killed, by the next `init_runtime(hlo_dump_dir=True)` on this machine.
    `cache_dir` (default: the LLAMA_XLA_COMPILE_CACHE variable) keeps compiled programs on disk
    (`xr.initialize_cache`; see the module's notes); `cache_readonly` reads it without writing.
    It must come before anything compiles and stays for the process: calling again with the same
    cache, or with cache_dir=None, is fine; another cache raises (restart the process to change it).
    On a TPU it sets, before the runtime starts, the recipes' overlap flags in LIBTPU_INIT_ARGS unless
    the variable is set already (then process 0 prints that it kept it), and TPU_STDERR_LOG_LEVEL=0
    only with `partitioner_warnings` (`tpu_env`): a run that reads the partitioner's warnings
    (`hlo.partitioner_warnings`) from libtpu's stderr, which then carries its INFO lines too.
    """
    if cache_dir is None and compile_cache_dir() is None:  # the variable, unless a cache is set up
        cache_dir = os.environ.get(COMPILE_CACHE_VAR) or None
    if cache_dir:
        check_cache_dir(cache_dir, cache_readonly)
    if hlo_dump_dir is True:
        remove_orphan_dump_dirs()
        hlo_dump_dir = tempfile.mkdtemp(prefix=f"{DUMP_PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, hlo_dump_dir, ignore_errors=True)
    if hlo_dump_dir:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={hlo_dump_dir} --xla_dump_hlo_as_text").strip()
    select_device()
    import torch_xla
    import torch_xla.runtime as xr

    logging.getLogger("torch_xla.backends").addFilter(not_the_precision_warning)

    started = torch_xla._XLAC._xla_runtime_is_initialized()
    if not started:  # libtpu reads its variables once, when the runtime starts
        os.environ.update(tpu_env(os.environ, tpu_chips_present(), partitioner_warnings, USER_LIBTPU_INIT_ARGS))
    user_choice = os.environ.get("PJRT_DEVICE")
    kind = xr.device_type()  # torch_xla's detection, unless PJRT_DEVICE is set
    if kind != "TPU" and tpu_chips_present():
        why = (f"PJRT_DEVICE={user_choice} is set; unset it" if user_choice else
               "libtpu is missing; pip install 'torch_xla[tpu]==2.9.0'")
        raise RuntimeError(f"this machine has TPU chips but the XLA runtime chose {kind}: {why}, then restart "
                           f"the process. (A chip held by another process also fails: check `tpu-info`.)")
    want = cpu_device_count(cpu_devices)
    if kind == "CPU" and not started:
        os.environ["CPU_NUM_DEVICES"] = str(want)
    if not xr.is_spmd():
        xr.use_spmd()
    info = RuntimeInfo(kind, xr.global_runtime_device_count(), xr.process_index(), xr.process_count(), chip())
    skip = cache_dir and compile_cache_dir() is None and cache_skip_reason(kind, torch_xla.__version__)
    if skip:
        if not started and info.process_index == 0:
            print(skip)
        cache_dir = None
    if cache_dir:
        init_compile_cache(cache_path(cache_dir, info.process_index, info.process_count), cache_readonly)
    if kind == "CPU" and cpu_devices is not None and info.num_devices != cpu_devices:
        raise RuntimeError(
            f"the XLA runtime already started with {info.num_devices} CPU devices, so it cannot "
            f"give cpu_devices={cpu_devices}; restart the process (or kernel) and call "
            f"init_runtime({cpu_devices}) before any XLA tensor or device query")
    if not started and info.process_index == 0:
        print(info)
        if kind == "TPU" and USER_LIBTPU_INIT_ARGS is not None:
            print(f"LIBTPU_INIT_ARGS={USER_LIBTPU_INIT_ARGS!r} is set, so init_runtime kept it and added none of the "
                  f"overlap flags (runtime.OVERLAP_FLAGS); unset it to get them")
    return info


def not_the_precision_warning(record):
    """A logging filter: torch_xla 2.9's `set_mat_mul_precision` warns "Setting mat mul precision multiple
    times is not recommended" at every call, the first one too; the notebooks set it once."""
    return "mat mul precision multiple times" not in record.getMessage()


def tpu_env(environ, chips, partitioner_warnings=False, user_libtpu_args=None):
    """The variables `init_runtime` sets before the runtime starts, when libtpu reads them: {name: value}.

    Nothing without TPU chips. With chips:
    - LIBTPU_INIT_ARGS gains each of OVERLAP_FLAGS it does not name yet (after the defaults torch_xla's
      import put there): XLA then overlaps the collectives of a sharded step with its compute, as the
      public recipes run. Unless the user set the variable (`user_libtpu_args`, their value before
      torch_xla's import): theirs is kept whole.
    - TPU_STDERR_LOG_LEVEL=0 only for a run that reads the partitioner's warnings
      (`partitioner_warnings`), unless set already: libtpu sends only errors to stderr by default, and
      `hlo.partitioner_warnings` reads them there; everywhere else libtpu's INFO lines would flood
      training, serving and notebooks (an HLO dump alone does not need it).
    """
    if not chips:
        return {}
    env = {}
    if user_libtpu_args is None:
        flags = environ.get("LIBTPU_INIT_ARGS", "").split()
        named = {flag.split("=")[0].lstrip("-") for flag in flags}
        missing = [flag for flag in OVERLAP_FLAGS.split() if flag.split("=")[0].lstrip("-") not in named]
        if missing:
            env["LIBTPU_INIT_ARGS"] = " ".join(flags + missing)
    if partitioner_warnings and "TPU_STDERR_LOG_LEVEL" not in environ:
        env["TPU_STDERR_LOG_LEVEL"] = "0"
    return env


def cpu_device_count(cpu_devices=None):
    """The number of CPU devices `init_runtime(cpu_devices)` starts: the argument, else the
    CPU_NUM_DEVICES variable, else 8. A child process that must compile the same programs as this
    one (a compile cache's key includes the device count) gets CPU_NUM_DEVICES=<this> explicitly."""
    return int(cpu_devices or os.environ.get("CPU_NUM_DEVICES") or DEFAULT_CPU_DEVICES)


def default_dtype():
    """"bf16" or "fp32": the dtype train, serve, the doctor and notebooks 03-06b use unless told.

    LLAMA_XLA_DEFAULT_DTYPE=bf16 (or fp32) sets it on any device, so a CPU runs what a TPU runs by
    default; unset, it is bf16 on a TPU and fp32 elsewhere. An explicit --dtype / dtype= wins.
    """
    import torch_xla.runtime as xr

    value = os.environ.get(DTYPE_VAR)
    if value is None or value == "":
        return "bf16" if xr.device_type() == "TPU" else "fp32"
    if value not in ("bf16", "fp32"):
        raise ValueError(f"{DTYPE_VAR}={value!r} is not a dtype this package trains or serves in; set it to "
                         f"bf16 or fp32, or unset it (bf16 on a TPU, fp32 elsewhere)")
    return value


def cache_skip_reason(kind, torch_xla_version, forced=None):
    """Why init_runtime skips the persistent compile cache here, or None: on a TPU, torch_xla 2.9.0
    writes entries it cannot load (pytorch/xla#9094), so a cache would cost writes and help nothing.
    LLAMA_XLA_FORCE_COMPILE_CACHE=1 (or forced=True) uses it anyway, to check a fixed libtpu."""
    forced = os.environ.get(FORCE_CACHE_VAR) == "1" if forced is None else forced
    if kind == "TPU" and torch_xla_version.split("+")[0] in CACHE_CANNOT_LOAD_ON_TPU and not forced:
        return (f"compile cache skipped: torch_xla {torch_xla_version} on a TPU cannot load what it writes "
                f"(pytorch/xla#9094; PR #9759 addresses it after 2.9.0); set {FORCE_CACHE_VAR}=1 to use it anyway")
    return None


def tpu_hosts(accelerator):
    """Hosts (TPU VMs) of a slice, from its type: "v4-8" -> 1, "v4-16" -> 2, "v5litepod-16" -> 4,
    "v6e-8" -> 1; None for a type it does not know (GKE's names carry no size).

    v2-v4 and v5p count TensorCores, 8 per host; v5e (v5litepod) and v6e count chips, up to 8 on one
    host, 4 per host in larger slices (Cloud TPU's system architecture pages)."""
    m = re.fullmatch(r"(?:tpu-)?(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)", (accelerator or "").lower())
    if not m:
        return None
    kind, n = m.group(1), int(m.group(2))
    if kind in ("v2", "v3", "v4", "v5p"):
        return max(1, n // 8)
    return 1 if n <= 8 else n // 4


def multi_host_slice(accelerator=None):
    """The number of hosts of this TPU slice if it has more than one, else None, from its type
    (`accelerator`, default `accelerator_type()`; the metadata server is asked only on a machine with
    chips). None for a type without a size (GKE's names: check `xr.process_count()` once started).

    Read before the runtime starts: on one host of a multi-host slice the start waits for every host's
    process, forever if the others never run one. The doctor warns with it; serve and `make test`'s
    TPU plan, which run on one host, refuse such a slice."""
    hosts = tpu_hosts(accelerator or accelerator_type(metadata=tpu_chips_present()))
    return hosts if hosts and hosts > 1 else None


def check_cache_dir(cache_dir, readonly=False):
    """ValueError, before any work, if `cache_dir` cannot be a compilation cache: a file, a folder
    that cannot be created or written (writable cache), a folder that does not exist (read-only)."""
    name, path = os.fspath(cache_dir), os.path.abspath(cache_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile cache {name!r} is a file, not a folder; pass a folder (it is created "
                         f"if missing)")
    if readonly:
        if not os.path.isdir(path):
            raise ValueError(f"read-only compile cache {name!r} does not exist; pass a folder an earlier "
                             f"run with a writable cache filled")
        return
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"compile cache {name!r} is not a writable folder ({e.strerror}); pass one this "
                         f"process can write, or make it read-only (cache_readonly=True)") from None


def cache_path(cache_dir, process_index, process_count):
    """The folder this process's cache entries live in: `cache_dir` itself on one process,
    cache_dir/process-<index> on a job of several (a pod), so processes never share a file."""
    path = os.path.abspath(os.fspath(cache_dir))
    return path if process_count == 1 else os.path.join(path, f"process-{process_index}")


def init_compile_cache(path, readonly):
    """`xr.initialize_cache(path, readonly)`, once per process, before the first compilation."""
    import torch_xla
    import torch_xla.runtime as xr

    active = compile_cache_dir()
    active_readonly = os.environ.get("XLA_PERSISTENT_CACHE_READ_ONLY") == "1"
    if active is not None and (active, active_readonly) == (path, readonly):
        return
    if active is not None or torch_xla._XLAC._xla_computation_cache_is_initialized():
        now = (f"compile cache {active!r} (readonly={active_readonly})" if active is not None else
               "no compile cache (it compiled before one was set up)")
        raise RuntimeError(f"this process already uses {now}, so it cannot switch to compile cache {path!r} "
                           f"(readonly={readonly}); restart the process (or kernel) and call "
                           f"init_runtime(cache_dir=...) before anything compiles")
    xr.initialize_cache(path, readonly=readonly)


def compile_cache_dir():
    """The folder of this process's persistent compilation cache, or None if it has none."""
    return os.environ.get("XLA_PERSISTENT_CACHE_PATH")  # what xr.initialize_cache sets and XLA reads


def compile_cache_summary(counters):
    """What the persistent cache did, in one line, from `compile_cache_counters()`."""
    loaded, added, failed = (counters[k] for k in ("PersistentCacheHit", "PersistentCacheMiss",
                                                    "PersistentCacheDeserializeFailure"))
    return (f"{loaded} programs loaded, {added} compiled and added, {failed} found but not loadable on this "
            f"device (compiled again)")


def compile_cache_counters():
    """torch_xla's persistent-cache counters so far in this process, with the compile count:
    {"compiles": N, "PersistentCacheMiss": N, "PersistentCacheHit": N, "PersistentCacheLoad": N,
    "PersistentCacheDeserializeFailure": N} (0 when a counter never moved)."""
    import torch_xla.debug.metrics as met

    counters = {name: met.counter_value(name) or 0 for name in
                ("PersistentCacheMiss", "PersistentCacheHit", "PersistentCacheDeserializeFailure")}
    load, compiles = met.metric_data("PersistentCacheLoad"), met.metric_data("CompileTime")
    return {"compiles": compiles[0] if compiles else 0, **counters, "PersistentCacheLoad": load[0] if load else 0}


def chip():
    """The `metrics.PEAK_FLOPS` key of this TPU ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"), or None.

    None on a CPU, and on a TPU type without a key. It reads the TPU type (`accelerator_type`),
    never the device kind: `xm.xla_device_kind()` fails once SPMD is on (pytorch/xla issue 9535).
    """
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return None
    name = (accelerator_type() or "").lower().removeprefix("tpu-")
    return next((key for prefix, key in CHIP_PREFIXES if name.startswith(prefix)), None)


def accelerator_type(metadata=True):
    """The TPU type, e.g. "v5litepod-8": ACCELERATOR_TYPE (TPU VM), TPU_ACCELERATOR_TYPE (GKE),
    else the TPU VM metadata server (1 s timeout; not asked with metadata=False); None if none answers."""
    for var in ("ACCELERATOR_TYPE", "TPU_ACCELERATOR_TYPE"):
        if os.environ.get(var):
            return os.environ[var]
    return _metadata_accelerator_type() if metadata else None


@functools.cache
def _metadata_accelerator_type():
    request = urllib.request.Request(METADATA_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=1) as response:
            return response.read().decode().strip()
    except OSError:  # not on a Cloud TPU VM, or no metadata server
        return None

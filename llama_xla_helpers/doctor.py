"""Check a new machine before anything else: runtime, sharding, compilation, speed, CPU fallbacks.

    python -m llama_xla_helpers.doctor                   # a TPU VM (on a pod: every host at once)
    python -m llama_xla_helpers.doctor --cpu-devices 4   # a CPU: 4 virtual devices stand in
    python -m llama_xla_helpers.doctor --compile-cache DIR   # twice: the second run should load, not compile
    python -m llama_xla_helpers.doctor --checkpoint-dir gs://bucket/ckpt   # can this host write there?

One line per check, PASS or FAIL with a fix; exit status 1 if any check fails (2: a bad argument).
On a pod only process 0 prints. On this 2-core CPU the whole run takes under a minute.
"""
import argparse
import contextlib
import importlib.metadata
import io
import logging
import os
import sys
import time
import uuid

import torch
import torch_xla
import torch_xla.backends
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.scan import scan
from transformers import LlamaForCausalLM

from . import attention, runtime
from .cli import ArgumentParser, add_compile_cache_args
from .configs import get_config
from .engine import Engine
from .generate import Generator, greedy_check
from .mesh import make_mesh, mesh_shape
from .metrics import HBM_BANDWIDTH, PEAK_FLOPS
from .model import Llama
from .parallel import replicate_kv_heads, shard_for_inference
from .runtime import (COMPILE_CACHE_VAR, OVERLAP_FLAGS, accelerator_type, cache_skip_reason, check_cache_dir, chip,
                      compile_cache_counters, compile_cache_dir, compile_cache_summary, default_dtype, init_runtime,
                      multi_host_slice, tpu_chips_present)
from .sharding import to_sharded
from .train import DTYPES, TrainConfig, train

MIN_FRACTION_OF_PEAK = 0.1  # a TPU measured below this fraction of its published peak fails
# Another program rounds differently: a greedy token whose top two logits are closer than this may
# differ from the model's own choice, and is skipped when tokens are checked (generate.greedy_check).
NEAR_TIE = {torch.float32: 0.01, torch.bfloat16: 0.25}
NOT_FALLBACKS = {"aten::_local_scalar_dense"}  # `.item()` / `.tolist()`: a read of a device value


class CheckFailed(Exception):
    """A check ran and found something wrong (the message says what)."""


def run_checks(checks, args, lines=None):
    """Run each (name, check, fix): `PASS name: <what check(args) returns>` or `FAIL name: <error>;
    fix: <fix>`, printed, or appended to `lines` when given. Returns the exit status: 1 if any failed."""
    status = 0
    for name, check, fix in checks:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # one line per check: what the package prints is dropped
                line = f"PASS {name}: {check(args)}"
        except Exception as e:
            line, status = f"FAIL {name}: {one_line(e)}; fix: {fix}", 1
        if lines is None:
            print(line, flush=True)
        else:
            lines.append(line)
    return status


def one_line(error):
    """The first line of an exception's message, after its type unless a check raised it."""
    lines = str(error).strip().splitlines()
    if isinstance(error, CheckFailed):
        return lines[0]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@contextlib.contextmanager
def highest_precision():
    """fp32 matmuls in about fp32 inside the block, to compare with the CPU: on a TPU the default
    precision multiplies fp32 inputs in bf16 (one pass), 'highest' in six. (The CPU computes fp32
    either way.) The precision is not part of a graph's cache key, so graphs compiled here must have
    shapes no other check compiles."""
    previous, log = torch_xla.backends.get_mat_mul_precision(), logging.getLogger("torch_xla.backends")
    level = log.level
    log.setLevel(logging.ERROR)  # it warns at every change; the checks verify the results
    torch_xla.backends.set_mat_mul_precision("highest")
    try:
        yield
    finally:
        torch_xla.backends.set_mat_mul_precision(previous)
        log.setLevel(level)


def plural(n, noun):
    return f"{n} {noun}{'s' * (n != 1)}"


def dtype_name(args):
    """--dtype, else `runtime.default_dtype()` (train's default too)."""
    return args.dtype or default_dtype()


def tiny_llama(max_batch_size, max_seq_len, dtype=None):
    """The inference `Llama` of the tiny config with seeded random weights, on the CPU. Large
    weights (initializer_range 0.2) make the greedy tokens vary, so comparing them means something."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(get_config("tiny", initializer_range=0.2))
    return Llama.from_hf(hf, max_batch_size, max_seq_len, dtype)


def prompts(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


# --- The checks: each returns what passed, or raises ------------------------------------------

VERSIONS = ("torch", "torch_xla", "libtpu", "transformers", "jax", "torchax")


def versions():
    """{package: version or None}: Python's, then each of VERSIONS as pip installed it."""
    found = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def check_versions(args, found=None):
    """The versions that matter, and torch and torch_xla of one release (torch_xla is built for one)."""
    found = found or versions()
    line = ", ".join(f"{name} {version or 'none'}" for name, version in found.items())
    torch_release, xla_release = (str(found[k]).split("+")[0] for k in ("torch", "torch_xla"))
    if torch_release != xla_release:
        raise CheckFailed(f"{line}: torch {torch_release} with torch_xla {xla_release}, which is built for "
                          f"torch {xla_release}")
    return line


RECIPES = {"tpu-v5p": "the v5p Mixtral-8x7B recipe's", "tpu-v6e": "the Trillium Llama 3 70B recipe's"}


def check_libtpu_flags(args):
    """LIBTPU_INIT_ARGS in effect, and whether init_runtime added the recipes' overlap flags
    (runtime.OVERLAP_FLAGS) or kept the user's value."""
    now = f"LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS')!r}" if "LIBTPU_INIT_ARGS" in os.environ else \
        "LIBTPU_INIT_ARGS unset"
    if xr.device_type() != "TPU":
        return f"{now} (libtpu reads it; this is not a TPU)"
    tpu = chip()
    source = RECIPES.get(tpu, f"no public PyTorch recipe for {tpu or 'this TPU'}; the v5p and v6e recipes'")
    if runtime.USER_LIBTPU_INIT_ARGS is None:
        return f"{now}: init_runtime added the flags that overlap collectives with compute ({source})"
    return (f"{now}: yours, kept; init_runtime adds the flags that overlap collectives with compute ({source}) "
            f"only when it is unset: '{OVERLAP_FLAGS}'")


def check_checkpoint_dir(args):
    """The checkpoint folder: this host can create and delete a file there; gs:// needs gcsfs."""
    import fsspec

    url = args.checkpoint_dir
    if url.startswith("gs://"):
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            raise CheckFailed(f"{url} is a Google Cloud Storage URL and gcsfs is not installed") from None
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(path, exist_ok=True)
    probe = f"{path.rstrip('/')}/.doctor-{uuid.uuid4().hex}"
    fs.pipe_file(probe, b"ok")
    fs.rm_file(probe)
    return f"{url}: this host can write there (on a pod, every host must see the same folder)"

def check_runtime(args):
    info = init_runtime(args.cpu_devices, cache_dir=args.compile_cache, cache_readonly=args.compile_cache_readonly)
    return (f"{info.device_kind}, chip {info.chip}, {plural(info.num_devices, 'device')}, "
            f"{plural(info.process_count, 'host')}")


def check_matmul(args):
    """A 2D-sharded matmul (a reduction over 'model') equals torch's on the CPU."""
    n = xr.global_runtime_device_count()
    mesh = make_mesh(mesh_shape(n))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8 * n, 64 * n, generator=g), torch.randn(64 * n, 128, generator=g)
    want = a @ b  # (8n, 128)
    with highest_precision():
        out = to_sharded(a, mesh, ("data", "model")) @ to_sharded(b, mesh, ("model", None))  # (8n, 128)
        xs.mark_sharding(out, mesh, (None, None))  # replicated: every host can read it
        out = out.cpu()
    err = ((out - want).abs().max() / want.abs().max()).item()
    if not err < 1e-4:
        raise CheckFailed(f"max error {err:.1e} of the largest value (limit 1e-4) on mesh {tuple(mesh.mesh_shape)}")
    return f"({8 * n}, {64 * n}) @ ({64 * n}, 128) on mesh {tuple(mesh.mesh_shape)} equals the CPU's (error {err:.1e})"


def check_training(args):
    """2 training steps compile 2 graphs: the first step (it creates the optimizer state), then the rest."""
    shape = mesh_shape(config=get_config("tiny"))
    batch = shape[0]  # one sequence per 'data' shard
    result = train(TrainConfig(model="tiny", mesh=shape, dtype=args.dtype, steps=2, batch_size=batch,
                               seq_len=64, eval_batches=1))
    what = f"mesh {shape}, batch {batch}, seq_len 64, {dtype_name(args)}"
    if result.train_compiles != 2:
        raise CheckFailed(f"2 steps compiled {result.train_compiles} graphs, expected 2 ({what})")
    return f"2 steps compiled 2 graphs ({what})"


def check_generation(args):
    """The second generate() on the same prompt shape compiles nothing."""
    gen = Generator(tiny_llama(1, 64, DTYPES[dtype_name(args)]), buckets=(16,))
    _, first = gen.generate(prompts([5]), max_new_tokens=4)
    _, second = gen.generate(prompts([5]), max_new_tokens=4)
    if second.compiles:
        raise CheckFailed(f"the second generate() compiled {second.compiles} graphs, expected 0")
    return f"the first generate() compiled {first.compiles} graphs, the second 0"


def check_tensor_parallel(args):
    """Greedy tokens of the tiny model: unsharded (replicated) == Megatron-sharded over 'model'."""
    n = xr.global_runtime_device_count()
    tp = max(k for k in range(1, 9) if n % k == 0 and 8 % k == 0)  # tiny's heads and vocab split up to 8
    mesh = make_mesh((n,), ("model",)) if tp == n else make_mesh((n // tp, tp))
    batch = 2 * (n // tp)  # a multiple of 'data'; rows of different lengths
    rows, sizes = prompts([4 + b % 12 for b in range(batch)]), dict(max_batch_size=batch, max_seq_len=32)
    sharded = tiny_llama(**sizes)
    if tp > sharded.args.n_kv_heads:
        sharded = replicate_kv_heads(sharded, tp // sharded.args.n_kv_heads)
    with highest_precision():
        want, _ = Generator(tiny_llama(**sizes), buckets=(16,)).generate(rows, max_new_tokens=8)
        got, _ = Generator(shard_for_inference(sharded, mesh), buckets=(16,)).generate(rows, max_new_tokens=8)
    where = f"{mesh.axis_names} mesh {tuple(mesh.mesh_shape)}"
    for b, (w, g) in enumerate(zip(want, got)):
        if w != g:
            raise CheckFailed(f"row {b}: unsharded {w} != tensor-parallel {g} on the {where}")
    return f"{batch} rows x 8 greedy tokens equal, unsharded vs the {where}"


def check_kernels(args):
    """Which attention each path runs at --seq-len; on a TPU, that JAX is installed, one flash forward
    and backward equals the blockwise loop, and a compiled engine run on the ragged kernel gives the
    model's greedy tokens (teacher-forced, near-ties skipped)."""
    seq = args.seq_len
    if not attention.on_tpu():
        return (f"training at seq_len {seq} attends blockwise, serving with the flat path: the Pallas kernels "
                f"run on a TPU only")
    try:
        import jax  # noqa: F401
    except ImportError:
        raise CheckFailed("JAX is not installed, and torch_xla's flash and ragged paged attention kernels import "
                          "it") from None
    flash = check_flash(seq)
    dtype = DTYPES[dtype_name(args)]
    eng = Engine(tiny_llama(4, 64, dtype), slots=4, buckets=(16,), compile=True)
    eng.warmup()
    if not eng.runner.kernel:
        raise CheckFailed("the engine took the flat path for the tiny model (attention.uses_kernel)")
    [prompt] = prompts([5])
    [got] = eng.generate([prompt], 12)
    differ, _ = greedy_check(tiny_llama(1, 64, dtype), prompt, got, NEAR_TIE[dtype])
    if differ:
        raise CheckFailed(f"the compiled engine step on the ragged kernel chose other tokens than the model's greedy "
                          f"ones at positions {differ} of {got}")
    return (f"training at seq_len {seq}: {flash}; serving: the ragged paged attention kernel "
            f"(compiled step, head_dim 16 padded to 128) gives the model's greedy tokens")


def check_flash(seq_len):
    """One flash forward and backward at seq_len on Table 2's partition spec, against the blockwise
    loop (highest matmul precision): returns the path it ran ("flash" or the padding)."""
    n = xr.global_runtime_device_count()
    mesh, dev = make_mesh(mesh_shape(n)), torch_xla.device()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(mesh.shape()["data"], h, seq_len, 128, generator=g) for h in (8, 4, 4))
    grads = []
    with highest_precision():
        for name in ("flash", "blockwise"):
            leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
            out, _ = attention.hf_attention(None, *leaves, None, 128 ** -0.5, implementation=name, mesh=mesh)
            out.sum().backward()
            grads.append([t.cpu() for t in (out, *(leaf.grad for leaf in leaves))])
    for what, a, b in zip(("output", "dq", "dk", "dv"), *grads):
        err = ((a - b).abs().max() / b.abs().max()).item()
        if not err < 1e-2:
            raise CheckFailed(f"flash attention's {what} differs from the blockwise loop's by {err:.1e} of its largest "
                              f"value at seq_len {seq_len}")
    return attention.flash_path(seq_len)


def seconds_per_run(fn, runs):
    """Mean time of fn() as one graph, timed after a warm-up run (its compile)."""
    out = fn()  # kept alive until the sync, or there would be nothing to run
    torch_xla.sync()
    xm.wait_device_ops()
    start = time.perf_counter()
    for _ in range(runs):
        out = fn()
        torch_xla.sync()
    xm.wait_device_ops()
    return (time.perf_counter() - start) / runs


def one_pass(x, _):
    """One pass over x (read it, write 1 - x): a step of `memory_passes`' loop."""
    return 1 - x, None


def memory_passes(x, passes):
    """x after `passes` dependent passes (each reads and writes all of it), as one graph: the first
    pass, then a compiled loop (scan: XLA's while) of the others. A loop, not ops in a row: XLA fuses
    a chain of elementwise ops into one pass over memory (an optimization barrier between them does not
    stop XLA:CPU), and it cannot fuse one iteration of a loop with the next."""
    with torch.no_grad():
        return scan(one_pass, 1 - x, torch.zeros(passes - 1, device=x.device), is_fn_pure=True)[0]


def check_speed(args):
    """Matmul FLOP/s and memory GB/s per device, against the chip's published peaks on a TPU.

    Each run is one graph, one dispatch, timed after a warm-up run: the memory measure covers
    `passes` passes over its buffer in that graph: on v5p / v6e one pass alone takes about as long as
    a dispatch (a pass over 256 MiB moves 512 MiB: 0.2 ms at v5p's 2.8 TB/s)."""
    n, on_tpu = xr.global_runtime_device_count(), xr.device_type() == "TPU"
    name, m, elems, passes = ("bf16", 8192, 2**27, 32) if on_tpu else ("fp32", 512, 2**22, 8)
    dtype, device, mesh = DTYPES[name], torch_xla.device(), make_mesh((n,), ("data",))
    a = torch.randn(n * m, m, dtype=dtype, device=device)  # (n*m, m): m rows per device
    b = torch.randn(m, m, dtype=dtype, device=device)
    x = torch.randn(n * elems, dtype=dtype, device=device)  # elems per device
    xs.mark_sharding(a, mesh, ("data", None))
    xs.mark_sharding(b, mesh, (None, None))  # replicated: each device multiplies its rows, no collective
    xs.mark_sharding(x, mesh, ("data",))
    torch_xla.sync()
    flops = 2 * m**3 / seconds_per_run(lambda: a @ b, runs=10)
    seconds = seconds_per_run(lambda: memory_passes(x, passes), runs=5 if on_tpu else 2)
    bandwidth = 2 * passes * elems * x.element_size() / seconds  # each pass reads x and writes it
    measured = f"matmul {flops / 1e12:.3g} TFLOP/s, memory {bandwidth / 1e9:.3g} GB/s"
    if not on_tpu:
        return f"{measured} per device ({name}; a CPU has no published peak to compare with)"
    tpu = chip()
    if tpu is None:
        raise CheckFailed(f"{measured} per chip, but TPU type {accelerator_type()!r} has no published peak "
                          f"in metrics.PEAK_FLOPS")
    flops_ratio, bandwidth_ratio = flops / PEAK_FLOPS[tpu], bandwidth / HBM_BANDWIDTH[tpu]
    measured = (f"matmul {flops / 1e12:.3g} TFLOP/s ({flops_ratio:.0%} of {tpu}'s {PEAK_FLOPS[tpu] / 1e12:.0f}), "
                f"HBM {bandwidth / 1e9:.3g} GB/s ({bandwidth_ratio:.0%} of {HBM_BANDWIDTH[tpu] / 1e9:.0f}) per chip")
    if min(flops_ratio, bandwidth_ratio) < MIN_FRACTION_OF_PEAK:
        raise CheckFailed(f"{measured}: under {MIN_FRACTION_OF_PEAK:.0%} of the published peak")
    return f"{measured} ({name})"


def cpu_fallbacks(ops):
    """The aten ops that ran on the CPU, without the device-value reads that are not fallbacks."""
    return sorted(set(ops) - NOT_FALLBACKS)


def check_fallbacks(args):
    ops = cpu_fallbacks(met.executed_fallback_ops())
    if ops:
        raise CheckFailed(f"{len(ops)} aten ops ran on the CPU in the checks above: {', '.join(ops)}")
    return "no aten op ran on the CPU in the checks above"


def check_compile_cache(args):
    """What the persistent cache did in the checks above. Run twice with the same folder: the second
    run should load every program. A CPU finds them but cannot load them; a TPU that cannot fails.
    On a TPU with torch_xla 2.9.0 init_runtime skipped the cache (runtime.cache_skip_reason)."""
    if compile_cache_dir() is None:
        return cache_skip_reason(xr.device_type(), torch_xla.__version__)
    counters = compile_cache_counters()
    summary = f"{compile_cache_dir()}: {compile_cache_summary(counters)}"
    if counters["PersistentCacheDeserializeFailure"] and xr.device_type() == "TPU":
        raise CheckFailed(summary)
    return summary


VERSIONS_CHECK = (
    "versions", check_versions,
    "pip install torch==2.9.0 'torch_xla[tpu]==2.9.0' (torch_xla works only with the torch it was built for)")
CHECKS = (  # (name, check(args) -> what passed, the fix to print when it fails)
    ("runtime", check_runtime,
     "on a TPU VM: pip install -e '.[tpu]' (libtpu), unset PJRT_DEVICE, stop any process that holds the "
     "chips (`tpu-info` lists them); on a CPU: --cpu-devices N or CPU_NUM_DEVICES=N"),
    ("sharded matmul", check_matmul,
     "the sharded result is wrong: reinstall torch_xla[tpu]==2.9.0 (torch_xla and libtpu must match)"),
    ("training compiles", check_training,
     "a step recompiles: run PT_XLA_DEBUG_LEVEL=2 python -m llama_xla_helpers.train --steps 5 and read "
     "its compilation causes"),
    ("generation compiles", check_generation,
     "a value baked into the decode graph changes between calls: PT_XLA_DEBUG_LEVEL=2 names the cause"),
    ("tensor parallel", check_tensor_parallel,
     "sharding changes the model's output: run pytest tests/test_parallel.py to find the layer"),
    ("attention kernels", check_kernels,
     "pip install -e '.[tpu]' (JAX 0.7.1 for the Pallas kernels); a wrong result: run pytest "
     "tests/test_tpu_kernels.py, and train with --attention blockwise meanwhile"),
    ("speed", check_speed,
     "another process may be using the chips (`tpu-info` shows their memory and duty cycle): stop it and "
     "rerun; if it stays slow, recreate the TPU VM"),
    ("no CPU fallback", check_fallbacks,
     "each op copies tensors to the host and back and splits the graph: replace it, or move it out of "
     "the step (torch_xla.debug.metrics.metrics_report() counts them)"),
    ("libtpu flags", check_libtpu_flags, "-"),
)
CHECKPOINT_CHECK = (  # with --checkpoint-dir
    "checkpoint dir", check_checkpoint_dir,
    "pass a folder every host can write (NFS, Filestore, a gs:// bucket with pip install -e '.[gcs]')")
COMPILE_CACHE_CHECK = (  # after CHECKS, when init_runtime set up a cache (--compile-cache, $LLAMA_XLA_COMPILE_CACHE)
    "compile cache", check_compile_cache,
    "this torch_xla and libtpu cannot load what they wrote (pytorch/xla issue 9094): run without a cache, or "
    "delete the folder and try again after upgrading")


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


def parse_args(argv=None):
    parser = ArgumentParser(prog="python -m llama_xla_helpers.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-devices", type=positive_int,
                        help="virtual XLA devices on a CPU (default: CPU_NUM_DEVICES, else 8)")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="parameters of the training and generation checks (default: "
                             "LLAMA_XLA_DEFAULT_DTYPE, else bf16 on a TPU, fp32 on a CPU)")
    add_compile_cache_args(parser)
    parser.add_argument("--seq-len", type=positive_int, default=2048,
                        help="the training length whose attention the kernel check runs (default 2048)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="check that this host can write checkpoints there "
                                                                "(default: no such check)")
    args = parser.parse_args(argv)
    if args.compile_cache:
        try:
            check_cache_dir(args.compile_cache, args.compile_cache_readonly)
        except ValueError as e:
            parser.error(str(e))
    if args.cpu_devices and tpu_chips_present():
        parser.error(f"--cpu-devices {args.cpu_devices} is for a machine without a TPU, and this one has TPU "
                     f"chips; drop it")
    return args


def multi_host_note():
    """On one host of a multi-host slice, the line to print before the runtime starts (it waits for
    every host there, forever if they do not all run it); None elsewhere. Known from the TPU type."""
    hosts = multi_host_slice() if tpu_chips_present() else None
    if hosts is None:
        return None
    return (f"{accelerator_type()} has {hosts} hosts: the TPU runtime starts only once the doctor runs on every one of "
            f"them, so run it on all at once (gcloud compute tpus tpu-vm ssh NAME --worker=all --command "
            f"'... python -m llama_xla_helpers.doctor'); on this host alone it waits forever")


def main(argv=None):
    args = parse_args(argv)
    note = multi_host_note()
    if note:
        print(note, flush=True)
    lines = []  # printed once the runtime says which process this is: on a pod, process 0 prints
    status = run_checks((VERSIONS_CHECK,) + CHECKS[:1], args, lines)
    lead = not torch_xla._XLAC._xla_runtime_is_initialized() or xr.process_index() == 0
    if lead:
        print(*lines, sep="\n", flush=True)
    if status and lines[-1].startswith("FAIL"):  # the other checks need the runtime: they would repeat its error
        return 1
    caching = args.compile_cache or os.environ.get(COMPILE_CACHE_VAR)
    more = (CHECKS[1:] + ((CHECKPOINT_CHECK,) if args.checkpoint_dir else ()) +
            ((COMPILE_CACHE_CHECK,) if caching else ()))
    lines = []
    status |= run_checks(more, args, lines)
    if lead:
        print(*lines, sep="\n", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

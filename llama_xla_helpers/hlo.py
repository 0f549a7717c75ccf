"""Read what the compiler made: the optimized (partitioned) HLO and the collectives in it.

GSPMD inserts the collectives when it partitions the graph, so they appear only in the HLO
after optimization. `init_runtime(hlo_dump_dir=...)` makes XLA write each compiled module.
"""
import contextlib
import glob
import os
import re
from collections import Counter

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# e.g. "  %all-reduce.3 = f32[4,64]{1,0} all-reduce(f32[4,64]{1,0} %dot), channel_id=1, ..."
_INSTRUCTION = re.compile(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _array_bytes(dtype, dims):
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * DTYPE_BYTES.get(dtype, 4)


def collectives(hlo_text):
    """Count the collectives in HLO text: ({op: count}, {op: bytes of their results per device})."""
    counts, nbytes = Counter(), Counter()
    for shape, op, start in _INSTRUCTION.findall(hlo_text):
        arrays = _ARRAY.findall(shape)
        if start:  # async form: result is (operand, output, ...); count the output
            arrays = arrays[1:2]
        counts[op] += 1
        nbytes[op] += sum(_array_bytes(t, dims) for t, dims in arrays)
    return dict(counts), dict(nbytes)


def dump_dir():
    m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if not m:
        raise RuntimeError("XLA is not dumping HLO: call init_runtime(hlo_dump_dir=...) first, "
                           "in a fresh process (XLA reads its flags once)")
    return m.group(1)


@contextlib.contextmanager
def compiled_hlo():
    """Collect the optimized HLO text of every module compiled inside the block.

        with compiled_hlo() as modules:
            loss = step(batch); torch_xla.sync()
        counts, nbytes = collectives("".join(modules))

    XLA compiles a graph once: one compiled before the block comes from the cache and is not
    seen, so the block raises if it compiled nothing (run new shapes, or a fresh process).
    """
    pattern = os.path.join(dump_dir(), "*after_optimizations.txt")
    before = set(glob.glob(pattern))
    modules = []
    yield modules
    for path in sorted(set(glob.glob(pattern)) - before):
        with open(path) as f:
            modules.append(f.read())
    if not modules:
        raise RuntimeError("nothing was compiled inside compiled_hlo(): the graph came from the "
                           "compile cache; use shapes not run before, or a fresh process")

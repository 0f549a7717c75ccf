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
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
# One instruction per line: "  %all-reduce.3 = f32[4,64]{1,0} all-reduce(f32[4,64]{1,0} %dot), ..."
# (name, result shape, op, "-start" if async). A tuple shape holds spaces: "(f32[2,8]{1,0}, ...)".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")(-start)?\(",
                          re.MULTILINE)
_ARRAY = re.compile(r"(\w+)\[([\d, ]*)\]")


def _array_bytes(dtype, dims):
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * DTYPE_BYTES.get(dtype, 4)


def _elements(shape):
    """The top-level elements of a tuple shape: "((f32[8]{0}), f32[2]{0}, u32[])" ->
    ["(f32[8]{0})", "f32[2]{0}", "u32[]"]; an array shape is its own single element."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, c in enumerate(shape[1:-1], 1):
        depth += (c in "([{") - (c in ")]}")  # commas also sit in dims [2,8], layouts {1,0:T(8,128)}
        if c == "," and depth == 0:
            parts.append(shape[start:i])
            start = i + 1
    return [p.strip() for p in parts + [shape[start:-1]]]


def _output(op, start, shape):
    """The part of a collective's result shape that is its output.

    Sync ops and all-reduce-start return their output(s): f32[8], or (f32[8], bf16[4]) when
    several operands are reduced at once. The other async starts return (operand(s), output(s),
    context...): all-gather-start (f32[2,8], f32[8,8]), collective-permute-start (f32[8], f32[8],
    u32[], u32[]), and an op wrapped in async-start, which XLA prints as reduce-scatter-start
    ((f32[8]), f32[2]) (an all-reduce wrapped so also has its operands first, in a tuple). Without
    that sugar it prints async-start(...), calls=%computation, whose body holds the plain op:
    that one is counted, the async-start is not.
    """
    parts = _elements(shape)
    wrapped = parts[0].startswith("(")  # ((operands), output(s), ...)
    if start and len(parts) > 1 and (wrapped or op != "all-reduce"):
        return parts[1]
    return shape


def collectives(hlo_text):
    """Count the collectives in HLO text: ({op: count}, {op: bytes of their outputs per device}).

    Sync and async forms count alike, each collective once: "all-gather" counts all-gather and
    all-gather-start; the -done (and -update) halves are not counted.
    """
    counts, nbytes = Counter(), Counter()
    for shape, op, start in _INSTRUCTION.findall(hlo_text):
        counts[op] += 1
        nbytes[op] += sum(_array_bytes(t, dims) for t, dims in _ARRAY.findall(_output(op, start, shape)))
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

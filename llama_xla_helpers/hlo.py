"""Read what the compiler made: the optimized (partitioned) HLO and the collectives in it.

GSPMD inserts the collectives when it partitions the graph, so they appear only in the HLO
after optimization. `init_runtime(hlo_dump_dir=...)` makes XLA write each compiled module.
"""
import contextlib
import glob
import os
import re
import sys
import tempfile
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


def exact_on_cpu():
    """True where the devices are XLA:CPU's, whose compiled collectives the notebooks and tests quote
    exactly; False on a TPU (or any other backend).

    XLA:CPU keeps every collective the SPMD partitioner inserted, as it inserted it. A TPU's compiler
    (libtpu's XLA) rewrites them after partitioning: it combines collectives of one kind into one
    instruction (fewer of them, the same bytes), turns an all-reduce whose result is then sliced
    (all-reduce + dynamic-slice, how the partitioner reduces a sharded gradient) into a reduce-scatter
    whose output is 1/k of the all-reduce's (fewer all-reduces and bytes), and may split or pipeline a
    `while` loop. So a count or byte total is bounded there (`check_count`), and what depends on
    which lines there are (a ratio, lines picked by shape) is asserted only where this is True.
    Notebooks 02, 03, 04 and 07 and tests/test_parallel.py check their counts this way.
    """
    import torch_xla.runtime as xr

    return xr.device_type() == "CPU"


def check_count(measured, expected, what, at_least=False):
    """Assert a count (or byte total) read from compiled HLO against XLA:CPU's: equal on XLA:CPU;
    elsewhere at most `expected` (collectives combined or turned into reduce-scatters, see
    `exact_on_cpu`), or at least `expected` with `at_least=True` (loops split or pipelined).

        check_count(counts["all-reduce"], 1 + 2 * n_layers, "all-reduces of a decode step")
    """
    if exact_on_cpu():
        ok, rule = measured == expected, "exactly, as XLA:CPU compiles it"
    elif at_least:
        ok, rule = measured >= expected, "or more: a TPU's compiler may split or pipeline loops"
    else:
        ok, rule = measured <= expected, "or fewer: a TPU's compiler combines collectives, makes reduce-scatters"
    if not ok:
        raise AssertionError(f"{what}: {measured}; expected {expected} {rule}")


def instructions(hlo_text, op):
    """The lines of the `op` instructions ("dot", "all-to-all", ...) in HLO text, async starts included."""
    pattern = r"^\s*(?:ROOT )?%?[\w.\-]+ = (?:\(.*?\)|\S+) " + re.escape(op) + r"(?:-start)?\(.*$"
    return [line.strip() for line in re.findall(pattern, hlo_text, re.MULTILINE)]


def dot_dtypes(tensors):
    """{result dtype: count} of the matmuls (`dot`) in the graph that computes `tensors`, as traced,
    before XLA compiles it: {"bf16": 111} shows a step really multiplies in bf16, which the result
    dtypes alone do not (autocast that XLA:CPU ignores computes fp32 and casts)."""
    import torch_xla

    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
    return dict(Counter(re.match(r"\S+ = (\w+)", line).group(1) for line in instructions(hlo, "dot")))


def op_count(hlo_text, op):
    """How many `op` instructions the HLO text holds."""
    return len(instructions(hlo_text, op))


def dump_dir():
    m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if not m:
        raise RuntimeError("XLA is not dumping HLO: call init_runtime(hlo_dump_dir=...) first, "
                           "in a fresh process (XLA reads its flags once)")
    return m.group(1)


BUFFER_ASSIGNMENT = "after_optimizations-buffer-assignment.txt"  # where XLA put each buffer


@contextlib.contextmanager
def compiled_hlo(kind="after_optimizations.txt"):
    """Collect the optimized HLO text of every module compiled inside the block.

        with compiled_hlo() as modules:
            loss = step(batch); torch_xla.sync()
        counts, nbytes = collectives("".join(modules))

    `compiled_hlo(BUFFER_ASSIGNMENT)` collects the modules' buffer assignments instead (`temp_bytes`).
    XLA compiles a graph once: one compiled before the block comes from the cache and is not
    seen, so the block raises if it compiled nothing (run new shapes, or a fresh process).
    """
    pattern = os.path.join(dump_dir(), "*" + kind)
    before = set(glob.glob(pattern))
    modules = []
    yield modules
    for path in sorted(set(glob.glob(pattern)) - before):
        with open(path) as f:
            modules.append(f.read())
    if not modules:
        raise RuntimeError("nothing was compiled inside compiled_hlo(): the graph came from the "
                           "compile cache; use shapes not run before, or a fresh process")


def aliased_parameters(module):
    """The shapes of a compiled module's parameters that share a buffer with an output (its
    `input_output_alias`: the program writes them in place), and of all its parameters, in order:
    ("f32[4,128,2,16]", ...), from the module's first line."""
    head = module.split("\n", 1)[0]
    layout = head.split("entry_computation_layout={", 1)[1]
    params = _elements(layout[:layout.index(")->") + 1])
    params = [re.sub(r"^/\*index=\d+\*/|\{[^}]*\}$", "", p) for p in params]  # /*index=5*/f32[4,8]{1,0} -> f32[4,8]
    aliased = [int(i) for i in re.findall(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)", head)]
    return [params[i] for i in aliased], params

def temp_bytes(buffer_assignment):
    """Bytes of scratch memory a compiled module needs per device while it runs: its activations
    and other intermediates, not its inputs and outputs ("preallocated-temp" in the buffer assignment)."""
    return sum(int(n) for n in re.findall(r"^allocation \d+: size (\d+), preallocated-temp", buffer_assignment,
                                          re.MULTILINE))


def output_bytes(buffer_assignment):
    """Bytes a compiled module allocates for its outputs: the "maybe-live-out" allocations that are
    not a parameter's buffer. An output written into a donated parameter (aliased) costs nothing
    here, so a step that updates its inputs in place allocates only its new results."""
    return sum(int(n) for n in re.findall(r"^allocation \d+: size (\d+), (?!parameter)[^\n]*maybe-live-out",
                                          buffer_assignment, re.MULTILINE))


# "[SPMD] Involuntary full rematerialization. The compiler cannot go from sharding {A} to {B}
# efficiently for HLO operation %name = f32[8,1,39,16]{3,2,1,0} broadcast(...), ..."
_REMAT = re.compile(r"Involuntary full rematerialization\. The compiler cannot go from sharding (\{.*?\}) to "
                    r"(\{.*?\}) efficiently for HLO operation %[\w.\-]+ = (\S+) ([\w\-]+)\(")


@contextlib.contextmanager
def partitioner_warnings():
    """Collect the SPMD partitioner's "Involuntary full rematerialization" warnings for what
    compiles inside the block, as (from sharding, to sharding, shape, op) tuples.

    The partitioner logs one when it cannot turn one sharding of a tensor into another with a
    direct collective, and replicates the tensor in full to split it again. XLA's C++ writes its
    log to file descriptor 2, which Python does not see: the block points fd 2 at a temporary
    file, then reads it back and passes on everything else to stderr. On a TPU the partitioner
    runs inside libtpu, which logs to /tmp/tpu_logs and sends only errors to stderr unless
    TPU_STDERR_LOG_LEVEL=0 was set before the runtime started (`init_runtime(partitioner_warnings=True)` sets it). On
    a TPU without it, this raises instead of returning an empty list that would prove nothing.
    """
    import torch_xla.runtime as xr

    if xr.device_type() == "TPU" and os.environ.get("TPU_STDERR_LOG_LEVEL") != "0":
        raise RuntimeError("libtpu sends the partitioner's warnings to stderr only with TPU_STDERR_LOG_LEVEL=0, "
                           "set before the runtime starts; restart the process (or kernel) and call "
                           "init_runtime(partitioner_warnings=True) first, which sets it")
    sys.stderr.flush()
    saved = os.dup(2)
    warnings = []
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield warnings
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text = log.read().decode(errors="replace")
            warnings.extend(_REMAT.findall(text))
            rest = "".join(line for line in text.splitlines(True) if "Involuntary full rematerialization" not in line)
            sys.stderr.write(rest)

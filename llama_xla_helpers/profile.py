"""Capture a profiler trace of steady-state steps, and read it back in Python (no TensorBoard).

    run = profile_training(TrainConfig(model="tiny"), "profiles")  # 2 warm-up steps, then 3 traced
    top_ops(run, 10)            # [(op name, total ms, count), ...]: where the time went, largest first
    step_timeline(run)          # [(name, start ms, duration ms), ...]: each step and its parts
    plots.plot_timeline(step_timeline(run))

A loop that syncs inside its step (a lazy serving step) marks steps with `marker("step")`
instead, and `host_ms(run, "step")` gives each step's wall time less the time compiled programs ran in it
(`program_spans`).

Any step function works: `capture(step, logdir, steps=3, warmup=2)` runs `step()` first `warmup`
times (they compile), then `steps` times under the profiler, each inside `xp.StepTrace`, and
checks that nothing compiled while it traced. Inside a step, `xp.Trace("name")` marks its parts
(`traced_train_step`). A Trace scope must not contain `torch_xla.sync()`, which raises: the
StepTrace syncs when the step ends, outside every Trace.

What the profiler writes (torch_xla's `start_trace` / `stop_trace`), per capture and host:
LOGDIR/plugins/profile/<date_time>/<host>.xplane.pb, XProf's format, which TensorBoard opens,
and <host>.trace.json.gz, the same events in the Chrome trace-event format (Perfetto opens it).
This module reads the second with `json` and `gzip`. A capture through the profiler server
(`xp.trace`, TensorBoard's "capture profile" button) writes only the .xplane.pb.

On a TPU the XLA ops run on the chip, in the trace's /device:TPU:N processes ("XLA Ops" line).
XLA:CPU runs them on host threads, so on this CPU `top_ops` sums host time, over every virtual
device's threads (8 devices: an op that runs once per step counts 8 times). The TPU's device
planes are read by their documented names, which could not be checked on this CPU.

To browse the same folder in XProf on a TPU VM: `pip install -e '.[profile]'`, then
`xprof --logdir=profiles --port=8791` and, from your machine, `ssh -L 8791:localhost:8791 VM`
and open http://localhost:8791 (`tensorboard --logdir=profiles` works too, with the plugin).
"""
import gzip
import json
import re
import socket
from pathlib import Path
from typing import NamedTuple

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.profiler as xp

from .metrics import count_compiles
from .train import DTYPES, build_model, first_batch, forward_loss, make_optimizer, prepare_layers, setup

STEP = "step"                                       # the StepTrace name `capture` gives each step
EXECUTE = "PjRtComputationClient::ExecuteReplicated"  # torch_xla running a compiled graph (host side)
THUNKS = "ThunkExecutor::Execute"                   # XLA:CPU running a program


class Event(NamedTuple):
    name: str
    start_ms: float     # from the trace's origin
    duration_ms: float
    process: str        # "/host:CPU", "/device:TPU:0", ...
    thread: str         # "python", "XLA Ops", "tf_XLAEigen/...", ...
    args: dict          # e.g. {"hlo_op": "dot.3", "hlo_module": "SyncTensorsGraph.15"}


def _check_count(name, value, low, what):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}: {what}")


def capture(step, logdir, steps=3, warmup=2, name=STEP):
    """Run step() `warmup` times, then `steps` times under the profiler; return the capture's
    folder (LOGDIR/plugins/profile/<date_time>). Each call runs inside xp.StepTrace(name), which
    syncs at its end, so `step` must not call torch_xla.sync() itself. RuntimeError if anything
    compiled while tracing: then the trace is not of steady-state steps."""
    _check_count("steps", steps, 1, "the steps to trace, e.g. 3")
    _check_count("warmup", warmup, 0, "the steps run (and compiled) before tracing; a training step needs 2")
    for i in range(warmup):
        with xp.StepTrace(name, step_num=i):
            step()
    xm.wait_device_ops()
    compiles = count_compiles()
    xp.start_trace(str(logdir))
    try:
        for i in range(warmup, warmup + steps):
            with xp.StepTrace(name, step_num=i):
                step()
        xm.wait_device_ops()
    finally:
        xp.stop_trace()
    compiles = count_compiles() - compiles
    if compiles:
        raise RuntimeError(f"{compiles} graph(s) compiled during the {steps} traced steps, so the trace is not of "
                           f"steady-state steps; raise warmup={warmup} (a training step compiles twice: the first "
                           f"step, then every other) or find the recompile (metrics.count_compiles)")
    return trace_file(logdir).parent


def traced_train_step(model, optimizer, ids):
    """`train.train_step` with an xp.Trace around each part: forward, backward, optimizer."""
    with xp.Trace("forward"):
        loss = forward_loss(model, ids)
    with xp.Trace("backward"):
        loss.backward()
    with xp.Trace("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def profile_training(cfg, logdir, steps=3, warmup=2):
    """Capture `steps` training steps of `cfg` (a train.TrainConfig) after `warmup` ones, on
    one batch, as `traced_train_step`; returns the capture's folder."""
    cfg, mesh, config = setup(cfg)
    model = build_model(config, mesh, cfg.strategy, cfg.seed, cfg.init_from, DTYPES[cfg.dtype])
    prepare_layers(model, cfg)
    model.train()
    optimizer = make_optimizer(cfg, model.parameters())
    ids = first_batch(cfg, mesh)
    return capture(lambda: traced_train_step(model, optimizer, ids), logdir, steps, warmup)


def trace_file(path):
    """The .trace.json.gz to read: `path` itself, or in `path` (a capture's folder or a log
    directory: its newest capture), this host's file, else the first."""
    path = Path(path)
    if path.is_file():
        return path
    files = sorted(path.glob("*.trace.json.gz")) or sorted(path.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz in {str(path)!r} or its plugins/profile/*/ folders; capture "
                                f"one with profile.capture or xp.start_trace / xp.stop_trace (a capture through "
                                f"the profiler server writes only *.xplane.pb: open that one in XProf)")
    newest = [f for f in files if f.parent == files[-1].parent]  # capture folders are named by date and time
    mine = [f for f in newest if f.name == f"{socket.gethostname()}.trace.json.gz"]
    return (mine or newest)[0]


def read_events(path):
    """Every complete event of a trace (see `trace_file` for `path`), as Events sorted by start."""
    with gzip.open(trace_file(path), "rt") as f:
        raw = json.load(f)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in raw
             if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")}
    events = [Event(e["name"], e["ts"] / 1e3, e.get("dur", 0) / 1e3, names.get((e["pid"], None), str(e["pid"])),
                    names.get((e["pid"], e.get("tid")), str(e.get("tid"))), e.get("args", {}))
              for e in raw if e.get("ph") == "X"]  # ts and dur are in microseconds
    return sorted(events, key=lambda e: e.start_ms)


def op_events(events, where=None):
    """The XLA op events: where="device" (a TPU's "XLA Ops" lines), "host" (XLA:CPU's ops, on host
    threads), or None: the device's if the trace has any, else the host's."""
    if where not in (None, "device", "host"):
        raise ValueError(f"where={where!r} must be 'device', 'host' or None (device if the trace has device ops)")
    device = [e for e in events if e.process.startswith("/device:") and e.thread == "XLA Ops"]
    if where == "device" and not device:
        raise ValueError("this trace has no device ops (/device:*, 'XLA Ops'): it was captured on a CPU, where XLA "
                         "runs ops on host threads; pass where='host'")
    if device and where != "host":
        return device
    return [e for e in events if "hlo_op" in e.args and not e.process.startswith("/device:")]


def top_ops(path, n=10, where=None, by_kind=False):
    """The `n` XLA ops that took the most time in the trace: [(name, total_ms, count), ...],
    largest first. An op is one HLO instruction ("all-reduce.97", "fusion.3"), or with by_kind=True
    all instructions of a kind ("all-reduce", "fusion"). `where`: see `op_events` (on this CPU the
    ops are the host's; a collective's time there includes waiting for the other devices)."""
    _check_count("n", n, 1, "how many ops to list, e.g. 10")
    totals = {}
    for e in op_events(read_events(path), where):
        key = re.sub(r"\.\d+$", "", e.name) if by_kind else e.name
        total, count = totals.get(key, (0.0, 0))
        totals[key] = (total + e.duration_ms, count + 1)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    return [(name, total, count) for name, (total, count) in ranked[:n]]


def step_timeline(path, name=STEP):
    """Each traced step (the StepTrace `name`), the scopes directly inside it on its thread (the
    xp.Trace parts, torch_xla's StepMarker sync), and each run of a compiled graph (EXECUTE) from
    the first step's start on: [(name, start_ms, duration_ms), ...] from the first step's start.
    A step's graph runs after its sync, on another thread, so the last one can start after the
    last step's scope has ended (`capture` waits for it before it stops the trace)."""
    events = read_events(path)
    steps = [e for e in events if e.name == name]
    if not steps:
        raise ValueError(f"no step named {name!r} in the trace; pass name= the name given to xp.StepTrace "
                         f"({STEP!r} for profile.capture)")
    t0 = steps[0].start_ms
    timeline = []
    for step in steps:
        inside = [e for e in events if (e.process, e.thread) == (step.process, step.thread) and e is not step
                  and step.start_ms <= e.start_ms and e.start_ms + e.duration_ms <= step.start_ms + step.duration_ms]
        timeline += [step] + [e for e in inside if not any(_contains(o, e) for o in inside if o is not e)]
    timeline += [e for e in events if e.name == EXECUTE and e.start_ms >= t0]
    return sorted(((e.name, e.start_ms - t0, e.duration_ms) for e in timeline), key=lambda e: e[1])


def marker(name):
    """A named trace event around a block (`with marker("step"): ...`). Unlike xp.Trace it pushes
    no IR scope, so the block may sync (xp.Trace raises there)."""
    return torch_xla._XLAC.profiler.TraceMe(name)


def program_spans(events):
    """When compiled programs ran: [(start ms, end ms)]. On a TPU, the device's "XLA Modules"
    line (one event per program run); on the CPU, XLA:CPU's ThunkExecutor events (the op events
    there are sampled, not every op)."""
    spans = [e for e in events if e.process.startswith("/device:") and e.thread == "XLA Modules"] or \
        [e for e in events if e.name.startswith(THUNKS)]
    return sorted((e.start_ms, e.start_ms + e.duration_ms) for e in spans)


def host_ms(path, name):
    """Per traced `marker(name)` block but the last: [(wall ms, device ms)], wall from its start to
    the next block's start, device the time within it during which a compiled program ran
    (`program_spans`, overlaps counted once). Wall less device is the time the device waited for
    the host: tracing, dispatch, reading results."""
    events = read_events(path)
    starts = [e.start_ms for e in events if e.name == name]
    if len(starts) < 2:
        raise ValueError(f"{len(starts)} event(s) named {name!r} in the trace; mark each step with marker({name!r}) "
                         "and trace at least 2")
    spans, rows = program_spans(events), []
    for a, b in zip(starts, starts[1:]):
        busy, end = 0.0, a
        for s, e in spans:  # the union of the spans (sorted by start), clipped to [a, b]
            s, e = max(s, end), min(e, b)
            if e > s:
                busy, end = busy + e - s, e
        rows.append((b - a, busy))
    return rows


def _contains(outer, inner):
    return outer.start_ms <= inner.start_ms and inner.start_ms + inner.duration_ms <= outer.start_ms + outer.duration_ms

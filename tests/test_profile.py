"""profile.py: a trace of steady-state training steps, captured in a child process (the profiler
and the runtime belong to one process), then read back here with no TensorBoard: the files the
profiler wrote, the top XLA ops, and the step timeline with the StepTrace and xp.Trace names."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from llama_xla_helpers import plots, profile

CHILD = """
import json, sys
import torch, torch_xla
import torch_xla.core.xla_model as xm, torch_xla.debug.profiler as xp
from llama_xla_helpers.profile import capture, marker, profile_training
from llama_xla_helpers.train import TrainConfig
run = profile_training(TrainConfig(batch_size=8, seq_len=16), sys.argv[1] + "/train", steps=2, warmup=2)
x = torch.arange(4.0, device=torch_xla.device())
try:  # no warm-up: the step compiles while traced
    capture(lambda: x * 5, sys.argv[1] + "/cold", steps=1, warmup=0)
except RuntimeError as e:
    error = str(e)
y = x * 5
torch_xla.sync()  # compiled before the trace
xp.start_trace(sys.argv[1] + "/marked")
for _ in range(3):
    with marker("serve step"):  # a sync inside: xp.Trace would raise
        y = x * 5
        torch_xla.sync()
        xm.wait_device_ops()  # the program runs inside its step
xp.stop_trace()
print(json.dumps(dict(run=str(run), error=error)))
"""


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """(the capture's folder, the error of a capture that compiled), from one child process."""
    folder = tmp_path_factory.mktemp("profiles")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # XLA_FLAGS: this process's HLO dump
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=600,
                         env={**env, "CPU_NUM_DEVICES": "8"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    return result["run"], result["error"]


@pytest.mark.child_process
def test_the_profiler_writes_xplane_and_trace_events(captured):
    run, _ = captured
    names = os.listdir(run)
    logdir = Path(run).parents[2]  # LOGDIR/plugins/profile/<date_time>
    assert Path(run).parent == logdir / "plugins" / "profile" and logdir.name == "train"
    assert any(n.endswith(".xplane.pb") for n in names) and any(n.endswith(".trace.json.gz") for n in names)
    assert profile.trace_file(logdir) == profile.trace_file(run)  # the log directory's newest capture


@pytest.mark.child_process
def test_top_ops_are_xla_ops_with_positive_times(captured):
    run, _ = captured
    ops = profile.top_ops(run, 5)
    print(*ops, sep="\n")
    assert len(ops) == 5 and all(total > 0 and count >= 1 for _, total, count in ops)
    assert [total for _, total, _ in ops] == sorted((total for _, total, _ in ops), reverse=True)
    kinds = dict((name, count) for name, _, count in profile.top_ops(run, 50, by_kind=True))
    # the 2D-sharded step's matmuls and collectives, each run by all 8 devices in each of the 2 steps
    assert {"dot", "all-reduce"} <= set(kinds) or {"fusion", "all-reduce"} <= set(kinds), kinds
    assert kinds["all-reduce"] % 16 == 0
    with pytest.raises(ValueError, match="no device ops .* captured on a CPU.* pass where='host'"):
        profile.top_ops(run, where="device")


@pytest.mark.child_process
def test_step_timeline_has_the_steps_and_their_parts(captured):
    run, _ = captured
    timeline = profile.step_timeline(run)
    print(*timeline, sep="\n")
    names = [name for name, _, _ in timeline]
    assert names.count("step") == 2
    for part in ("forward", "backward", "optimizer", "StepMarker", profile.EXECUTE):
        assert names.count(part) == 2, part
    starts = {name: start for name, start, _ in reversed(timeline)}  # each name's first start
    assert starts["step"] == 0 < starts["forward"] < starts["backward"] < starts["optimizer"] < starts["StepMarker"]
    assert all(duration > 0 for _, _, duration in timeline)
    fig = plots.plot_timeline(timeline)
    assert isinstance(fig, Figure)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == list(dict.fromkeys(
        n.split("::")[-1] for n in names))


@pytest.mark.child_process
def test_a_capture_that_compiles_is_refused(captured):
    _, error = captured
    assert error.startswith("1 graph(s) compiled during the 1 traced steps, so the trace is not of steady-state")


def test_bad_profile_input(tmp_path):
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1: the steps to trace"):
        profile.capture(lambda: None, tmp_path, steps=0)
    with pytest.raises(ValueError, match="warmup=-1 must be an int >= 0: the steps run"):
        profile.capture(lambda: None, tmp_path, warmup=-1)
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz in .* capture one with profile.capture"):
        profile.top_ops(tmp_path)
    with pytest.raises(ValueError, match="where='gpu' must be 'device', 'host' or None"):
        profile.op_events([], where="gpu")
    with pytest.raises(ValueError, match="n=0 must be an int >= 1: how many ops"):
        profile.top_ops(tmp_path, n=0)


@pytest.mark.child_process
def test_step_timeline_names_a_missing_step(captured):
    run, _ = captured
    with pytest.raises(ValueError, match="no step named 'train_step' in the trace; pass name= the name given"):
        profile.step_timeline(run, name="train_step")


def test_the_timeline_keeps_a_graph_run_that_starts_after_its_step(tmp_path):
    """The last step's graph runs after the step's sync returned (on a loaded machine, well after)."""
    def event(name, ms, dur, tid=1):
        return dict(ph="X", name=name, ts=ms * 1000, dur=dur * 1000, pid=1, tid=tid)  # ts, dur: microseconds
    trace = [dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU")),
             event(profile.EXECUTE, 0, 5, tid=2),                                 # before the first step: left out
             event("step", 10, 10), event("forward", 11, 4), event(profile.EXECUTE, 18, 5, tid=2),
             event("step", 20, 10), event("forward", 21, 4), event(profile.EXECUTE, 33, 5, tid=2)]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=trace), f)
    assert profile.step_timeline(tmp_path) == [("step", 0, 10), ("forward", 1, 4), (profile.EXECUTE, 8, 5),
                                               ("step", 10, 10), ("forward", 11, 4), (profile.EXECUTE, 23, 5)]


@pytest.mark.child_process
def test_host_ms_reads_steps_that_sync_inside_their_marker(captured):
    run, _ = captured
    rows = profile.host_ms(Path(run).parents[2].parent / "marked", "serve step")
    assert len(rows) == 2 and all(0 < device < wall for wall, device in rows)  # each step ran its program
    with pytest.raises(ValueError, match="0 event\\(s\\) named 'step' in the trace; mark each step with marker"):
        profile.host_ms(Path(run).parents[2].parent / "marked", "step")


def test_host_ms_counts_overlapping_programs_once_and_prefers_the_device_line(tmp_path):
    def event(name, ms, dur, pid=1, tid=1):
        return dict(ph="X", name=name, ts=ms * 1000, dur=dur * 1000, pid=pid, tid=tid)
    cpu = [event("s", 0, 1), event("s", 10, 1), event("s", 30, 1),
           event(profile.THUNKS, 2, 4, tid=2), event(profile.THUNKS + " (wait for completion)", 3, 5, tid=3),
           event(profile.THUNKS, 8, 4, tid=2),  # crosses the second step's start: 2 ms in each
           event("fusion.1", 20, 9, tid=2)]     # an op event: not a program span (XLA:CPU samples them)
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=cpu), f)
    assert profile.host_ms(tmp_path, "s") == [(10, 8), (20, 2)]  # [2, 8) and [8, 10); [10, 12)
    names = [dict(ph="M", name="process_name", pid=2, args=dict(name="/device:TPU:0")),
             dict(ph="M", name="thread_name", pid=2, tid=7, args=dict(name="XLA Modules"))]
    tpu = cpu + names + [event("jit_decode", 12, 15, pid=2, tid=7)]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=tpu), f)
    assert profile.host_ms(tmp_path, "s") == [(10, 0), (20, 15)]  # the device's modules only

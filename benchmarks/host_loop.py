"""Host time per training step and host memory over 1,000 tiny steps: this tree against a baseline revision.

    python benchmarks/host_loop.py                 # baseline: the commit before the host-stall fixes
    python benchmarks/host_loop.py --before REV    # any git revision of this repository

Each side runs `train()` on the tiny model (8 CPU devices, batch 8 x 32 tokens) in a fresh
process; the baseline runs from a `git worktree` of REV with the same installed packages. A
wrapper around `torch_xla.sync` stamps every step `train.py` ends: the time between stamps is
the loop's wall time per step (host tracing and device execution overlap, so a host stall shows
up as a longer step), and /proc/self/statm gives the resident memory at each stamp. The first
10 steps (compilation) are left out of the times and the first 100 (the loader's prefetch queue
and the allocator's pools filling) out of the memory growth. Writes results/host_loop.json and
results/host_loop.png.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "8a26cde"  # before issue 10: a loss read and sharding objects rebuilt every step
STEPS, SKIP, WARM = 1000, 10, 100


def measure(steps):
    """In a child process: per-step wall times (s) and RSS (bytes) at each step end, as JSON."""
    import time

    from llama_xla_helpers.runtime import init_runtime
    init_runtime(cpu_devices=8)
    import torch_xla

    from llama_xla_helpers.train import TrainConfig, train
    page, stamps, sync = os.sysconf("SC_PAGE_SIZE"), [], torch_xla.sync

    def stamped_sync(*args, **kwargs):
        sync(*args, **kwargs)
        if sys._getframe(1).f_code.co_filename.endswith("train.py"):  # the loop's own sync, not the loader's
            with open("/proc/self/statm") as f:
                stamps.append((time.perf_counter(), int(f.read().split()[1]) * page))
    torch_xla.sync = stamped_sync
    train(TrainConfig(model="tiny", mesh=(4, 2), steps=steps, batch_size=8, seq_len=32, eval_batches=1))
    times = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    print(json.dumps(dict(step_s=times[SKIP:], rss=[r for _, r in stamps][WARM:])))


def run(label, tree, steps):
    env = {**os.environ, "PYTHONPATH": tree, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", str(steps)], cwd=tree,
                         env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    times = sorted(data["step_s"])
    row = dict(label=label, steps=steps, median_step_ms=1e3 * times[len(times) // 2],
               p90_step_ms=1e3 * times[int(len(times) * 0.9)], rss_step_100_mb=data["rss"][0] / 2**20,
               rss_end_mb=data["rss"][-1] / 2**20)
    row["rss_growth_kb_per_step"] = (data["rss"][-1] - data["rss"][0]) / 1024 / (steps - WARM)
    print(f"{label:32s} median {row['median_step_ms']:6.2f} ms/step, p90 {row['p90_step_ms']:6.2f}; RSS "
          f"{row['rss_step_100_mb']:.0f} MB at step {WARM} -> {row['rss_end_mb']:.0f} MB "
          f"({row['rss_growth_kb_per_step']:.1f} KB per step)", flush=True)
    return row, data


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure)
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, args.before], check=True,
                       capture_output=True)
        try:
            before = run(f"before ({args.before})", tree, args.steps)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=True)
    after = run("after (this tree)", ROOT, args.steps)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "host_loop.json"), "w") as f:
        json.dump([before[0], after[0]], f, indent=2)
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    from llama_xla_helpers import plots
    plots.plot_lines({row["label"]: {SKIP + i: 1e3 * t for i, t in enumerate(data["step_s"])}
                      for row, data in (before, after)}, "step", "ms per step (wall)",
                     f"{args.steps} tiny training steps, 8 CPU devices", name="host_loop")


if __name__ == "__main__":
    main()

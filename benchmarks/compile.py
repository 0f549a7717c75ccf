"""Compile time, measured on this machine's stand-in mesh: scan over layers, and the persistent cache.

    python benchmarks/compile.py     # ~25 minutes; writes results/compile.json and results/compile_*.png
    python benchmarks/compile.py --part forward_backward   # one part again (cache, forward_backward,
                                                           # training_step); the others' rows are kept

1. Scan. The tiny model (batch 8 x 32 tokens, mesh_shape's pick for 8 CPU devices) with 2 to 64
   decoder layers, unrolled and scanned (`TrainConfig(scan_layers=True)`), two ways:
   - forward and backward alone, the part scan changes: seconds XLA spends compiling them (the
     "CompileTime" metric);
   - the whole training step (forward, backward and Adafactor): seconds compiling the first two
     steps (step 1, which creates the optimizer state, and every later step), their wall time
     (tracing, scan's AOTAutograd trace, compiling, running), and the median of 5 steady steps.
   Eager attention (`attention="eager"`, as measured: at 32 tokens the blockwise
   loop is one block, and benchmarks/attention.py compares the two). A line fitted to each compile
   time: seconds per added layer. The whole step goes to 32 layers:
   unrolled, its compile took 305 s there and grows faster than linearly.
2. The persistent cache. The same tiny training step and the same one-token `Generator` run, each
   in a fresh process, cold (empty cache folder) and then warm (the folder the cold run filled):
   wall time from the process's start to the first finished step or token, with the compile and
   cache counters. This CPU cannot load what the cache holds (its client does not deserialize
   executables), so here the warm run compiles again; on a TPU it loads them.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()  # a child's clock starts before its imports

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LAYERS, STEADY, BATCH, SEQ = (2, 4, 8, 16, 32, 64), 5, 8, 32
STEP_LAYERS = LAYERS[:-1]  # the whole step unrolled took 305 s to compile at 32 layers, faster than linear


def first_steps(cfg, steps, layers=None):
    """Train `steps` steps of cfg (with `layers` decoder layers if given) on one batch:
    (seconds XLA spent compiling, the time each step ended)."""
    import torch_xla

    from llama_xla_helpers.configs import get_config
    from llama_xla_helpers.metrics import compile_seconds
    from llama_xla_helpers.train import build_model, first_batch, make_optimizer, prepare_layers, setup, train_step

    cfg, mesh, config = setup(cfg)
    config = get_config(cfg.model, num_hidden_layers=layers) if layers else config
    model = build_model(config, mesh, cfg.strategy, cfg.seed)
    prepare_layers(model, cfg)
    optimizer = make_optimizer(cfg, model.parameters())
    ids = first_batch(cfg, mesh)
    compiled = compile_seconds()
    times = [time.perf_counter()]
    for _ in range(steps):
        loss = train_step(model, optimizer, ids)
        torch_xla.sync()
        loss.item()  # the step has finished
        times.append(time.perf_counter())
    return compile_seconds() - compiled, times


def child(what, cache):
    """One fresh process: the tiny training step or a one-token generation, with the cache; prints JSON."""
    from llama_xla_helpers.runtime import compile_cache_counters, init_runtime
    from llama_xla_helpers.train import TrainConfig

    if what == "train":
        first_steps(TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager", compile_cache=cache), 1)
    else:
        init_runtime(cache_dir=cache)
        from llama_xla_helpers.doctor import tiny_llama
        from llama_xla_helpers.generate import Generator
        Generator(tiny_llama(1, 64), buckets=(16,)).generate([[1, 2, 3]], max_new_tokens=1)
    print(json.dumps(dict(first_s=time.perf_counter() - START, **compile_cache_counters())))


def run_child(args):
    """Run this script with `args` in a fresh process; the JSON it prints last."""
    env = {**os.environ, "CPU_NUM_DEVICES": "8", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{args} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def slope(points):
    """Least-squares seconds per layer of {layers: seconds}."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def forward_backward(layers, scan):
    """Seconds XLA spends compiling one forward and backward pass (no optimizer) of the tiny model
    with `layers` decoder layers: the part of the step that scan changes."""
    import torch_xla

    from llama_xla_helpers.configs import get_config
    from llama_xla_helpers.metrics import compile_seconds
    from llama_xla_helpers.train import TrainConfig, build_model, first_batch, forward_loss, prepare_layers, setup

    cfg, mesh, _ = setup(TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager", scan_layers=scan))
    model = build_model(get_config("tiny", num_hidden_layers=layers), mesh)
    prepare_layers(model, cfg)
    ids = first_batch(cfg, mesh)
    before = compile_seconds()
    forward_loss(model, ids).backward()
    torch_xla.sync()
    return compile_seconds() - before


def measure_cache():
    """Cold and warm fresh processes (they open the devices themselves: run before this process does)."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for what in ("train", "generate"):
            for run in ("cold", "warm"):
                rows.append(dict(program=what, run=run, **run_child(["--child", what, os.path.join(cache, what)])))
                print(rows[-1], flush=True)
    return rows


def measure_forward_backward():
    return [measure_in_child("forward_backward", layers, scan) for layers in LAYERS for scan in (False, True)]


def measure_training_step():
    return [measure_in_child("training_step", layers, scan) for layers in STEP_LAYERS for scan in (False, True)]


def measure(part, layers, scan):
    """One row of a scan part, in this (fresh) process."""
    from llama_xla_helpers.runtime import init_runtime
    from llama_xla_helpers.train import TrainConfig

    init_runtime(cpu_devices=8)
    if part == "forward_backward":
        return dict(layers=layers, scan=scan, compile_s=forward_backward(layers, scan))
    compiled_s, times = first_steps(TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager", scan_layers=scan),
                                    2 + STEADY, layers)
    steady = [b - a for a, b in zip(times[2:], times[3:])]
    return dict(layers=layers, scan=scan, compile_s=compiled_s, first_two_steps_s=times[2] - times[0],
                step_ms=1e3 * statistics.median(steady))


def measure_in_child(part, layers, scan):
    """Each measurement in its own process: one process compiling them all ran out of memory
    (std::bad_alloc at the 32-layer scanned step, after the unrolled ones), and a fresh process
    is what a user starting a job has."""
    row = run_child(["--measure", part, str(layers), str(int(scan))])
    print(row, flush=True)
    return row


PARTS = {"cache": measure_cache, "forward_backward": measure_forward_backward, "training_step": measure_training_step}


def report(results):
    """Slopes, speed-ups and figures from the measured rows."""
    from llama_xla_helpers import plots

    series, summary = {}, {}
    for part, what in (("forward_backward", "forward + backward"), ("training_step", "training step")):
        by = {(r["layers"], r["scan"]): r["compile_s"] for r in results[part]}
        depths = sorted({r["layers"] for r in results[part]})
        for scan in (False, True):
            series[f"{'scanned' if scan else 'unrolled'}, {what}"] = {n: by[n, scan] for n in depths}
        summary[part] = dict(
            seconds_per_layer={name: slope({n: by[n, scan] for n in depths})
                               for name, scan in (("unrolled", False), ("scanned", True))},
            speedup={n: by[n, False] / by[n, True] for n in depths})
        print(f"{what}: seconds per layer unrolled {summary[part]['seconds_per_layer']['unrolled']:.2f}, scanned "
              f"{summary[part]['seconds_per_layer']['scanned']:.2f}; scan compiles "
              + ", ".join(f"{summary[part]['speedup'][n]:.1f}x faster at {n} layers" for n in depths[-2:])
              + " (target: 2x at 32 on this CPU)")
    steps = {(r["layers"], r["scan"]): r["step_ms"] for r in results["training_step"]}
    summary["scanned_step_time_ratio"] = {n: steps[n, True] / steps[n, False] for n, scan in steps if scan}
    results["summary"] = summary
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    plots.plot_lines(series, "decoder layers", "seconds compiling", "compile time, tiny model, 8 CPU devices",
                     name="compile_vs_layers")
    plots.plot_lines({name: {r["layers"]: r["step_ms"] for r in results["training_step"] if r["scan"] == scan}
                      for name, scan in (("unrolled", False), ("scanned", True))},
                     "decoder layers", "ms per steady step", "training step time, 8 CPU devices",
                     name="compile_step_time")


def main(parts):
    """Run `parts` (all by default), keep the other parts' rows from the last run, report, save."""
    path = os.path.join(RESULTS, "compile.json")
    results = json.load(open(path)) if set(parts) != set(PARTS) else {}
    results.update(batch_size=BATCH, seq_len=SEQ, devices=8, steady_steps=STEADY)
    for part in PARTS:  # every measurement runs in a child process, which opens the devices itself
        if part in parts:
            results[part] = PARTS[part]()
    report(results)
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:4])
    elif sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))))
    else:  # --part training_step: run that part again, keep the others' rows
        main(sys.argv[sys.argv.index("--part") + 1:] if "--part" in sys.argv else list(PARTS))

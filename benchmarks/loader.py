"""The training loop's input from a slow store: batches read ahead on the loader's thread, or on the step's path.

    python benchmarks/loader.py            # writes results/loader.json and loader.png

A token file of random ids is read as a `TokenRows` three ways: from the local disk (np.memmap),
and through its file:// URL (byte ranges, as from gs://) behind a wrapper that sleeps LATENCY_S
per request (a remote store's latency, injected in the file system, not by a network), once with
`prefetch=PREFETCH` (the default) and once with 0. Each is `train()` on the tiny model (8 CPU
devices, batch 8 x 128 tokens, the file standing in for its data), STEPS steps, REPS times,
alternating, in one process after one run that compiles. A wrapper stamps the end of every step
(`torch_xla.sync` called from train.py); a step's time is the wall time between stamps, the
first SKIP left out. Medians over the repetitions of each run's median.

Targets (issue PI; met or missed as measured, never asserted): with the latency, prefetched steps
<= 1.1x the local file's; without prefetch, what they take.
"""
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
STEPS, SKIP, REPS, PREFETCH, LATENCY_S, SEQ_LEN = 40, 5, 3, 2, 0.05, 128


def slow(url, latency):
    """Make every request of a file:// URL's file system (one instance, which fsspec caches) wait
    `latency` seconds first; returns the list each request appends to."""
    import fsspec
    fs, _ = fsspec.core.url_to_fs(url)
    cat_ranges, requests = fs.cat_ranges, []

    def delayed(*args, **kwargs):
        requests.append(time.perf_counter())
        time.sleep(latency)
        return cat_ranges(*args, **kwargs)
    fs.cat_ranges = delayed
    return requests


def step_ms(train, cfg, torch_xla):
    """One run's median step (ms)."""
    stamps, sync = [], torch_xla.sync

    def stamped_sync(*args, **kwargs):
        sync(*args, **kwargs)
        if sys._getframe(1).f_code.co_filename.endswith("train.py"):  # the loop's own sync
            stamps.append(time.perf_counter())
    torch_xla.sync = stamped_sync
    try:
        train(cfg)
    finally:
        torch_xla.sync = sync
    return 1e3 * statistics.median(b - a for a, b in list(zip(stamps, stamps[1:]))[SKIP:STEPS - 1])


def main():
    from llama_xla_helpers.runtime import init_runtime
    init_runtime(cpu_devices=8)
    import torch_xla

    from llama_xla_helpers import plots, train as train_module
    from llama_xla_helpers.data import TokenRows
    from llama_xla_helpers.train import TrainConfig, train

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.u32")
        np.random.default_rng(0).integers(0, 256, (STEPS * 8 + 64) * SEQ_LEN, dtype=np.uint32).tofile(path)
        requests = slow(f"file://{path}", LATENCY_S)
        sources = dict(zip(("local file", f"URL, {LATENCY_S * 1e3:.0f} ms a request, prefetch {PREFETCH}",
                            f"URL, {LATENCY_S * 1e3:.0f} ms a request, no prefetch"),
                           (path, f"file://{path}", f"file://{path}")))
        prefetch = dict(zip(sources, (PREFETCH, PREFETCH, 0)))

        def cfg(name):
            rows = TokenRows(sources[name], SEQ_LEN)
            train_module.datasets = lambda cfg, tokenizer: ((rows.rows(0, STEPS * 8),), (rows.rows(STEPS * 8, None),))
            return TrainConfig(model="tiny", mesh=(4, 2), steps=STEPS, batch_size=8, seq_len=SEQ_LEN, eval_batches=1,
                               prefetch=prefetch[name])
        train(cfg("local file"))  # compiles
        runs, per_run = {name: [] for name in sources}, {name: [] for name in sources}
        for rep in range(REPS):
            for name in sources:
                before = len(requests)
                runs[name].append(step_ms(train, cfg(name), torch_xla))
                per_run[name].append(len(requests) - before)
                print(f"rep {rep} {name}: {runs[name][-1]:.1f} ms a step, {per_run[name][-1]} delayed requests",
                      flush=True)
    med = {name: statistics.median(ms) for name, ms in runs.items()}
    local, ahead, inline = med.values()
    targets = [(f"with {LATENCY_S * 1e3:.0f} ms a request, prefetched steps <= 1.1x the local file's",
                f"{ahead / local:.2f}x ({ahead:.1f} vs {local:.1f} ms; without prefetch {inline:.1f} ms, "
                f"{inline / local:.2f}x)", ahead <= 1.1 * local)]
    for target, measured, met in targets:
        print(f"{'met   ' if met else 'missed'}  {target}: {measured}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "loader.json"), "w") as f:
        json.dump(dict(steps=STEPS, reps=REPS, prefetch=PREFETCH, latency_s=LATENCY_S, runs=runs,
                       delayed_requests=per_run, medians=med,
                       targets=[dict(target=t, measured=m, met=bool(ok)) for t, m, ok in targets]), f, indent=2)
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    plots.plot_bars({name: {"step": ms} for name, ms in med.items()}, "ms a step (median)",
                    "tiny model, 8 CPU devices, batch 8 x 128", name="loader")


if __name__ == "__main__":
    main()

"""benchmarks/serve.py --quick as a smoke test: it runs every system end to end and writes its
report (its timings are not asserted: they belong to the full run, benchmarks/results/serve.json).
Marked 'variants': make check-variants runs it (make test passed 40 minutes with it; DESIGN's order)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.variants
@pytest.mark.child_process
def test_serve_benchmark_quick_runs_every_system_and_reports_every_target():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--quick"], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = Path(run.stdout.strip().splitlines()[-1].split("results in ")[-1])
    result = json.loads((out / "serve.json").read_text())
    patterns = ("all-at-once", "poisson-50%", "poisson-100%")
    assert {(r["system"], r["pattern"]) for r in result["runs"]} == {
        *[(system, p) for system in ("engine-lazy", "engine-compiled", "hf-cb") for p in patterns],
        ("static", "all-at-once"), ("http", "all-at-once")}
    engines = ("engine-lazy", "engine-compiled")
    assert [t["target"].split(" <=")[0].split(" >=")[0] for t in result["targets"]] == [  # the targets' names
        "compiled engine requests in flight (all-at-once), same cache bytes as 8 x 64 positions (33 pages of 16): "
        "peak", "compiled engine", "compiled engine", "compiled engine TPOT p50",
        "compiled engine warm-up: at most 26 programs, as many as the engine it replaced (which compiled them in "
        "106 s on this CPU)",
        *[f"{system} step, batch {batch}, contexts" for system in engines for batch in (1, 8)],
        *[f"{system} TTFT with a cached 64-token prefix" for system in engines],
        "0 compilations after warm-up", "compiled engine step at batch 1", "compiled engine step at batch 1",
        "compiled engine host time per decode step at batch 8",
        "compiled engine host work per decode step at batch 8 (inputs, call, read)",
        "compiled engine faster than the lazy one, or the lazy one is the default here (default: engine-compiled)",
        "compiled engine tokens/s with every request constrained by a grammar", "HTTP overhead"]
    assert all(set(t) == {"target", "measured", "met"} and isinstance(t["met"], bool) for t in result["targets"])
    compiles = result["compiles_after_warmup"]
    assert [compiles[k] for k in ("engine-lazy", "engine-compiled", "engine_steps", "prefix")] == [0, 0, 0, 0]
    assert result["compile_misses"] == [] and [r["compiles"] for r in result["constrained"]] == [0, 0]
    engine_runs = [r for r in result["runs"] if r["system"].startswith("engine")]
    assert len(engine_runs) == 6
    assert all(1 <= r["in_flight_mean"] <= r["in_flight_peak"] <= 8 for r in engine_runs)  # 8 requests
    last = next(r for r in engine_runs if (r["system"], r["pattern"]) == ("engine-compiled", "all-at-once"))
    timeline = result["timeline"]  # the last repetition's, of that run
    assert (len(timeline), max(map(len, timeline))) == (last["steps"], last["in_flight_peak"])
    host = {r["system"]: r["host_ms"] for r in result["engine_decode"] if r["batch"] == 8}
    assert set(host) == set(engines) and all(0 < ms < 1000 for ms in host.values())
    parts = [r[k] for r in result["engine_decode"] if r["batch"] == 8
             for k in ("inputs_ms", "call_ms", "read_ms", "inputs_alone_ms")]
    assert len(parts) == 8 and all(0 < ms < 1000 for ms in parts)
    assert {(r["pool_pages"], r["small_pool_pages"]) for r in result["engine_decode"]} == {(33, 25)}
    prefix = {r["system"]: r for r in result["prefix_caching"]}
    assert set(prefix) == set(engines)
    assert all((r["cached_tokens"], r["uncached_tokens"]) == (64, 0) for r in prefix.values())
    assert sorted(p.name for p in out.glob("serve_*.png")) == [
        "serve_decode_step.png", "serve_engine_step.png", "serve_in_flight.png", "serve_pages.png",
        "serve_prefix_ttft.png", "serve_throughput.png", "serve_tpot.png", "serve_ttft.png"]

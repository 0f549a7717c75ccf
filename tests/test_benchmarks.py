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
    assert len(result["targets"]) == 14
    assert result["compiles_after_warmup"]["engine-lazy"] == result["compiles_after_warmup"]["engine-compiled"] == 0
    host = {r["system"]: r["host_ms"] for r in result["engine_decode"] if r["batch"] == 8}
    assert set(host) == {"engine-lazy", "engine-compiled"} and all(0 < ms < 1000 for ms in host.values())
    assert [r["prefill_rows"] for r in result["prefill_together"]] == [1, 4]
    assert sorted(p.name for p in out.glob("serve_*.png")) == [
        "serve_decode_step.png", "serve_engine_step.png", "serve_throughput.png", "serve_tpot.png", "serve_ttft.png"]

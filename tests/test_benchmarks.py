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
    assert {(r["system"], r["pattern"]) for r in result["runs"]} == {
        ("engine", "all-at-once"), ("engine", "poisson-50%"), ("engine", "poisson-100%"), ("static", "all-at-once"),
        ("hf-cb", "all-at-once"), ("hf-cb", "poisson-50%"), ("hf-cb", "poisson-100%"), ("http", "all-at-once")}
    assert len(result["targets"]) == 9 and result["compiles_after_warmup"]["engine"] == 0
    assert [r["prefill_rows"] for r in result["prefill_together"]] == [1, 4]
    assert sorted(p.name for p in out.glob("serve_*.png")) == [
        "serve_decode_step.png", "serve_engine_step.png", "serve_throughput.png", "serve_tpot.png", "serve_ttft.png"]

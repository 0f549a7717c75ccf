"""The Makefile: make test runs the notebooks as make tour (and a reader in plain Jupyter) runs them,
the TPU plan, and the choice of interpreter for .venv.

`make -n` prints the commands a target would run without running them; each command that executes
notebooks (nbconvert or nbval) is read for the variables it sets in front of the interpreter.
"""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_n(*args, cwd=ROOT, env=None):
    """What `make -n args` would run (line continuations joined), as a CompletedProcess. Without the
    variables of a make that runs this test (its jobserver would make `make -n` warn)."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    argv = [shutil.which("make"), "-n", "--no-print-directory", "-f", str(ROOT / "Makefile"), *args]
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, env=env)
    out.stdout = out.stdout.replace("\\\n", " ")
    return out


def notebook_runs(*args):
    """[(command kind, {variables set})] for each notebook run `make -n args` prints."""
    out = make_n(*args)
    assert out.returncode == 0, out.stderr
    runs = []
    for line in out.stdout.splitlines():
        for command in re.split(r";|&&|\|\||\bdo\b", line):
            kind = "nbval" if "--nbval" in command else "nbconvert" if "nbconvert" in command else None
            if kind:
                head = command.split(".venv/bin/python")[0]
                runs.append((kind, frozenset(re.findall(r"\b([A-Z][A-Z0-9_]*)=", head))))
    return runs


def test_make_test_runs_the_notebooks_with_the_tours_variables():
    tour = notebook_runs("tour", "TPU=")
    assert tour and {kind for kind, _ in tour} == {"nbconvert"}
    [tour_vars] = {names for _, names in tour}
    test = notebook_runs("test", "TPU=")
    assert test and {kind for kind, _ in test} == {"nbval"}, test
    for _, names in test:  # compares the committed outputs: exactly the tour's variables
        assert names == tour_vars, f"nbval sets {sorted(names)}, the tour {sorted(tour_vars)}"
    executed = [names for kind, names in notebook_runs("check-variants", "TPU=") if kind == "nbconvert"]
    assert executed
    for names in executed:  # a run at another device count or dtype (asserts only) adds those and nothing else
        assert names > tour_vars and names - tour_vars <= {"CPU_NUM_DEVICES", "LLAMA_XLA_DEFAULT_DTYPE"}, \
            f"{sorted(names)} vs the tour's {sorted(tour_vars)}"


def reads_03(nb):
    """Whether notebook `nb` reads notebook 03's checkpoint ("03_tiny_hf")."""
    return '"03_tiny_hf"' in "".join("".join(c["source"]) for c in json.loads((ROOT / nb).read_text())["cells"]
                                     if c["cell_type"] == "code") and not nb.startswith("notebooks/03_")


def notebook_groups(plan, pattern):
    """The lists of notebooks the commands in `plan` run, each found by `pattern`; each notebook in exactly one,
    a notebook that reads 03's checkpoint after 03 in the same list."""
    groups = [line.split() for line in re.findall(pattern, plan)]
    notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(nb for group in groups for nb in group) == notebooks, groups
    for group in groups:
        for i, nb in enumerate(group):
            if reads_03(nb):
                assert "notebooks/03_training_2d.ipynb" in group[:i], (nb, group)
    return groups


def test_each_notebook_runs_in_exactly_one_nbval_part_after_the_notebooks_it_reads():
    """make test splits nbval into processes with their own output folders (Makefile: NBVAL_GROUPS): a notebook
    that reads another's checkpoint (04-06b read 03's "03_tiny_hf") must run after it, in the same part."""
    assert len(notebook_groups(make_n("test", "TPU=").stdout,
                               r"--nbval-cell-timeout=\d+ ((?:notebooks/\S+\.ipynb ?)+)")) > 1


def test_the_tour_runs_two_groups_at_a_time_on_a_cpu_and_in_order_on_a_tpu():
    """On a CPU the tour runs nbval's groups two at a time (one thread each); on a TPU, whose chips one process
    holds, every notebook in order, one at a time."""
    pattern = r"for nb in ((?:notebooks/\S+\.ipynb ?)+); do"
    cpu = make_n("tour", "TPU=").stdout
    assert len(notebook_groups(cpu, pattern)) > 1 and re.search(r"OMP_NUM_THREADS=1 \S*make --no-print-directory -j2 tour-", cpu)
    tpu = make_n("tour", "TPU=1").stdout
    assert notebook_groups(tpu, pattern) == [sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))]
    assert "-j" not in tpu and "OMP_NUM_THREADS" not in tpu


def test_the_tpu_plan_runs_one_part_at_a_time_and_compares_no_cpu_outputs():
    [(_, tour_vars)] = set(notebook_runs("tour", "TPU="))
    runs = notebook_runs("test", "TPU=1")
    assert runs and {kind for kind, _ in runs} == {"nbconvert"} and {names for _, names in runs} == {tour_vars}
    plan = make_n("test", "TPU=1").stdout
    assert "-j" not in plan.split("\n")[0] and re.search(r"( test-pytest-\w+)+ test-tpu", plan)
    assert "-m pytest -q tests/test_" in plan  # the tests run too (child-process tests skip on a TPU)
    assert "install -e '.[dev,scan,log,tpu]'" in make_n("-B", ".venv/installed", "TPU=1").stdout
    assert "install -e '.[dev,scan,log]'" in make_n("-B", ".venv/installed", "TPU=").stdout


@pytest.mark.parametrize("variable, accelerator, hosts", [("ACCELERATOR_TYPE", "v4-16", 2),
                                                         ("TPU_ACCELERATOR_TYPE", "v5litepod-16", 4)])
def test_the_tpu_plan_refuses_a_multi_host_slice_in_one_line(variable, accelerator, hosts):
    """make test on every host of a pod cannot work (host-local checkpoint folders, a collective left
    waiting): the TPU plan reads the slice's host count from its type and stops, running nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATOR_TYPE", "TPU_ACCELERATOR_TYPE")}
    out = make_n("test", "TPU=1", env={**env, variable: accelerator})
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(errors) == 1 and "pytest" not in out.stdout, out
    assert errors[0].endswith(f"*** error: {accelerator} is a slice of {hosts} hosts and make test runs on one host; "
                              f"on a pod run the doctor on every host and one short training run (README: A pod).  Stop.")
    for one_host in ({**env, variable: "v4-8"}, env):  # one host, or no TPU type known: the plan runs
        assert "test-tpu" in make_n("test", "TPU=1", env=one_host).stdout
    assert make_n("test", "TPU=", env={**env, variable: accelerator}).returncode == 0  # the CPU plan: no pod


def test_each_test_file_runs_in_exactly_one_pytest_part():
    """make test splits pytest into processes (Makefile: TESTS_OWN); a file in none would never run in CI,
    a file in two would run twice."""
    plan = make_n("test", "TPU=").stdout
    runs = re.findall(r"-m pytest -q ((?:tests/test_\w+\.py ?)+)", plan)
    files = sorted(f for run in runs for f in run.split())
    assert len(runs) > 4 and files == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))


STUBS = {  # what each stub interpreter does when make runs its version check
    "ok": "#!/bin/sh\nexit 0\n",                                                      # 3.11 or newer
    "old": "#!/bin/sh\nexit 1\n",                                                     # 3.10: the check fails
    "shim": "#!/bin/sh\necho 'pyenv: python3.13: command not found' >&2\nexit 127\n",  # exists, does not run
}


@pytest.mark.parametrize("interpreters, override, chosen", [
    ({"python3": "ok", "python3.11": "ok"}, None, "python3"),
    ({"python3": "old", "python3.13": "shim", "python3.11": "ok"}, None, "python3.11"),
    ({"python3": "old", "python3.12": "ok", "python3.11": "ok"}, None, "python3.12"),
    ({"python3": "old"}, "/opt/python/bin/python3.12", "/opt/python/bin/python3.12"),
    ({"python3": "old", "python3.13": "shim"}, None, None),
])
def test_the_venv_is_made_with_the_first_python_that_runs_and_is_at_least_3_11(tmp_path, interpreters, override,
                                                                                   chosen):
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    (work / "pyproject.toml").touch()
    for name, kind in interpreters.items():
        (bin_dir / name).write_text(STUBS[kind])
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}  # make and sh are run by their full paths
    out = make_n(".venv/installed", *([f"PYTHON={override}"] if override else []), cwd=work, env=env)
    if chosen:
        assert out.returncode == 0 and out.stdout.splitlines()[0] == f"{chosen} -m venv .venv", out
    else:
        errors = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(errors) == 1, out.stderr
        assert "no Python 3.11 or newer here" in errors[0] and "sudo apt-get install -y python3.11 python3.11-venv" \
            in errors[0] and "conda env create -f environment.yml" in errors[0]

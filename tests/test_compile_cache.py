"""The persistent compilation cache: init_runtime(cache_dir=...), LLAMA_XLA_COMPILE_CACHE, read-only
mode, the CLIs' --compile-cache.

The cache is set up once per process, before the first compilation, so each case runs in a fresh
child process. On this CPU the cache fills, but a second process cannot load what it holds (the
CPU client cannot deserialize executables): it counts PersistentCacheDeserializeFailure and
compiles again. "A warm restart compiles nothing" is a TPU claim, not run here.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from llama_xla_helpers import serve
from llama_xla_helpers.runtime import cache_path, check_cache_dir, init_runtime
from llama_xla_helpers.train import main as train_main
from test_cli import cli, one_error_line

# A child that sets up the runtime as told (JSON kwargs), compiles the graphs named in argv[2]
# ("double": x * 2 + 1, "triple": x * 3), and prints the cache counters as JSON on its last line.
CHILD = """
import json, sys
import torch, torch_xla
from llama_xla_helpers.runtime import compile_cache_counters, init_runtime
init_runtime(**json.loads(sys.argv[1]))
x = torch.arange(8.0, device=torch_xla.device())
for graph in sys.argv[2].split(","):
    (x * 2 + 1 if graph == "double" else x * 3).cpu()
init_runtime(**json.loads(sys.argv[1]))  # again, the same cache: fine
if len(sys.argv) > 3:
    try:
        init_runtime(cache_dir=sys.argv[3])
    except RuntimeError as e:
        print(e)
print(json.dumps(compile_cache_counters()))
"""
CACHE_VARS = ("LLAMA_XLA_COMPILE_CACHE", "XLA_PERSISTENT_CACHE_PATH", "XLA_PERSISTENT_CACHE_READ_ONLY", "XLA_FLAGS")


def child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}  # XLA_FLAGS: this process's HLO dump
    return {**env, "CPU_NUM_DEVICES": "8", **extra}


def run_child(kwargs, graphs, *more, **env):
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs), graphs, *more], capture_output=True,
                         text=True, timeout=300, env=child_env(**env))
    assert out.returncode == 0, out.stderr[-3000:]
    *lines, counters = out.stdout.splitlines()
    return json.loads(counters), lines, out.stderr


def entries(folder):
    return {p.name: p.stat().st_size for p in folder.iterdir()}


@pytest.mark.child_process
def test_the_cache_fills_a_second_process_reads_it_and_read_only_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    first, _, _ = run_child(dict(cache_dir=str(cache)), "double")
    print("first process:", first)
    assert first["compiles"] == first["PersistentCacheMiss"] == 1 and first["PersistentCacheHit"] == 0
    written = entries(cache)
    assert len(written) == 1 and min(written.values()) > 0  # one serialized executable per compiled graph

    # The same program in a fresh process, the folder from the variable this time.
    second, lines, stderr = run_child({}, "double", str(tmp_path / "other"), LLAMA_XLA_COMPILE_CACHE=str(cache),
                                      TF_CPP_MIN_LOG_LEVEL="0")  # make's 2 would hide XLA's warning
    print("second process:", second)
    assert second["PersistentCacheLoad"] == 1 and second["PersistentCacheMiss"] == 0  # it found the entry
    # This CPU cannot load it: it compiles again (a TPU would count a hit and compile nothing).
    assert second["PersistentCacheDeserializeFailure"] == 1 and second["compiles"] == 1
    assert "Deserializing serialized executable not supported" in stderr
    assert entries(cache).keys() == written.keys()  # the same entry, written again
    # Another cache once one is set up: an error naming both and the fix.
    assert f"already uses compile cache {str(cache)!r} (readonly=False), so it cannot switch to compile cache " \
           f"{str(tmp_path / 'other')!r}" in lines[-1] and "restart the process" in lines[-1]

    # Read-only: the entry is read, a new graph ("triple") compiles, and nothing is written.
    written = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    third, _, _ = run_child(dict(cache_dir=str(cache), cache_readonly=True), "double,triple")
    print("read-only process:", third)
    assert third["PersistentCacheLoad"] == third["PersistentCacheMiss"] == 1 and third["compiles"] == 2
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == written  # nothing new, nothing rewritten


@pytest.mark.child_process
def test_the_train_cli_twice_with_scan_finds_every_program_in_the_cache(tmp_path):
    """`--scan-layers --compile-cache DIR`, run twice. The second run finds every program it needs
    under the key the first run wrote (the traced programs are the same in a new process), so it
    adds nothing; on a TPU it would load them and compile nothing. This CPU cannot load them."""
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "llama_xla_helpers.train", "--model", "micro", "--steps", "3", "--batch-size", "8", "--seq-len", "16",
            "--eval-batches", "1", "--scan-layers", "--compile-cache", str(cache)]

    def counts(fresh=False):
        for run in (1, 2):  # the Makefile's rule for a pytest part (once_more): JAX's scanned backward beside
            if fresh:       # XLA:CPU segfaulted once in CI in a native thread; a second crash fails
                shutil.rmtree(cache, ignore_errors=True)
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=child_env())
            if out.returncode >= 0:
                break
            print(f"the train CLI was killed by signal {-out.returncode}; running it once more")
        assert out.returncode == 0, out.stderr[-3000:]
        assert "step 3: train loss" in out.stdout
        line = next(l for l in out.stdout.splitlines() if l.startswith("compile cache:"))
        print(line)
        return [int(n) for n in re.findall(r"(\d+) (?:programs loaded|compiled and added|found but)", line)]

    loaded, added, unloadable = counts(fresh=True)
    assert loaded == unloadable == 0 and added >= 3  # the two training steps and the evaluation
    written = entries(cache)
    assert len(written) == added
    assert counts() == [0, 0, added]  # all found, none new; this CPU compiles them again
    assert entries(cache).keys() == written.keys()


def test_bad_cache_folders(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(ValueError, match=f"compile cache {str(file)!r} is a file, not a folder"):
        init_runtime(cache_dir=file)
    with pytest.raises(ValueError, match="compile cache '/proc/llama-xla-cache' is not a writable folder"):
        check_cache_dir("/proc/llama-xla-cache")
    with pytest.raises(ValueError, match="read-only compile cache .* does not exist; pass a folder an earlier run"):
        check_cache_dir(tmp_path / "missing", readonly=True)
    check_cache_dir(tmp_path / "new" / "cache")  # created
    assert (tmp_path / "new" / "cache").is_dir()


def test_each_process_of_a_pod_has_its_own_folder():
    assert cache_path("/c", 0, 1) == "/c"
    assert [cache_path("/c", i, 4) for i in (0, 3)] == ["/c/process-0", "/c/process-3"]


@pytest.mark.parametrize("main", [train_main, lambda argv: serve.main(["unused-model-dir", "--port", "0", *argv])],
                         ids=["train", "serve"])
def test_cli_bad_compile_cache_is_one_error_line(main, tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("")
    code, _, err = cli(main, ["--compile-cache", str(file)], capsys)
    assert one_error_line(code, err, f"compile cache {str(file)!r} is a file, not a folder"), err
    code, _, err = cli(main, ["--compile-cache", str(tmp_path / "missing"), "--compile-cache-readonly"], capsys)
    assert one_error_line(code, err, "read-only compile cache"), err

"""The StableHLO export as a notebook and a user run it: the artifact's greedy tokens equal
Generator's, the directory holds what its manifest promises, the decode graph takes the KV cache
in and gives it back, and a bad argument is one `error:` line with exit status 2.

Export and decoding from the artifact run in child processes without SPMD (under SPMD the
artifact does not load), started from a thread while Generator runs here, under the test run's
SPMD runtime, on the same checkpoint. Bad arguments are checked in this process: they fail
before any device work."""
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.export import (Artifact, child_env, export_in_subprocess, main, make_manifest,
                                      prepare_out_dir, stablehlo_excerpt)
from llama_xla_helpers.generate import Generator
from llama_xla_helpers.model import Llama, ModelArgs
from test_cli import cli, one_error_line
from util import hf_model

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

CONFIG = get_config("tiny", num_hidden_layers=2, initializer_range=0.2)
BUCKETS, MAX_SEQ_LEN, NEW_TOKENS = (8, 16), 40, 4
TWO_SECTIONS = [list(range(5, 25)), [7, 3, 9]]  # 20 tokens: sections [8, 16]; row 1 is left-padded
ONE_SECTION = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]  # 7 tokens: one section of 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model(CONFIG, seed=0).save_pretrained(path)
    return path


def export_then_run(model_dir, out):
    """The notebook's call (export, then decode TWO_SECTIONS from the artifact), then the `run`
    command on ONE_SECTION in a process of its own: (tokens, excerpt, the run's CompletedProcess)."""
    tokens, excerpt = export_in_subprocess(model_dir, out, TWO_SECTIONS, NEW_TOKENS, BUCKETS, MAX_SEQ_LEN)
    argv = [sys.executable, "-m", "llama_xla_helpers.export", "run", str(out), "--max-new-tokens", "2"]
    argv += [arg for p in ONE_SECTION for arg in ("--prompt-ids", ",".join(map(str, p)))]
    return tokens, excerpt, subprocess.run(argv, capture_output=True, text=True, timeout=300, env=child_env())


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """(artifact directory, a future of export_then_run): the children work in a thread while
    this process runs Generator (`expected`)."""
    out = tmp_path_factory.mktemp("artifact")
    with ThreadPoolExecutor(1) as pool:
        yield out, pool.submit(export_then_run, model_dir, out)


@pytest.fixture(scope="module")
def expected(model_dir):
    """Generator's greedy tokens for both batches, on the same checkpoint, here (SPMD on)."""
    generator = Generator(Llama.from_pretrained(model_dir, max_batch_size=2, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)
    return {"two sections": generator.generate(TWO_SECTIONS, NEW_TOKENS, eos_id=None)[0],
            "one section": generator.generate(ONE_SECTION, 2, eos_id=None)[0]}


@pytest.mark.child_process
def test_artifact_tokens_equal_generators(exported, expected):
    _, children = exported
    tokens, _, _ = children.result()
    assert tokens == expected["two sections"]


@pytest.mark.child_process
def test_run_command_decodes_from_the_artifact_alone(exported, expected):
    _, children = exported
    _, _, run = children.result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == expected["one section"]


@pytest.mark.child_process
def test_the_directory_holds_what_the_manifest_promises(exported, model_dir):
    out, children = exported
    children.result()
    files = [f for f in out.rglob("*") if f.is_file()]
    assert not any(str(model_dir).encode() in f.read_bytes() for f in files)  # self-contained
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == make_manifest(ModelArgs.from_hf_config(CONFIG, 2, MAX_SEQ_LEN), BUCKETS)
    assert manifest["functions"] == ["prefill_8", "prefill_16", "decode"]
    assert manifest["cache_shape"] == [2, MAX_SEQ_LEN, CONFIG.num_key_value_heads, CONFIG.head_dim]
    weights = {p.name for p in (out / "data").iterdir()}
    for name in manifest["functions"]:
        for ext in ("bytecode", "meta", "mlir"):
            assert (out / "functions" / f"{name}.{ext}").is_file(), (name, ext)
        meta = json.loads((out / "functions" / f"{name}.meta").read_text())
        params = {loc["name"] for loc in meta["input_locations"] if loc["type_"] == "parameter"}
        assert params == weights  # every graph reads all the weights, saved once
        args = sorted(loc["position"] for loc in meta["input_locations"] if loc["type_"] == "input_arg")
        assert args == list(range(3 + 2 * manifest["n_layers"]))  # tokens, input_pos, pad, k_0, v_0, ...
        outputs = [sig["shape"] for sig in meta["output_signature"]]
        assert outputs == [[2, 1]] + [manifest["cache_shape"]] * (2 * manifest["n_layers"])


@pytest.mark.child_process
def test_decode_graph_takes_the_cache_in_and_gives_it_back(exported):
    out, children = exported
    _, excerpt, _ = children.result()
    text = (out / "functions" / "decode.mlir").read_text()
    inputs, outputs = re.search(r"func\.func @main\((.*)\) -> \((.*)\) \{", text).groups()
    cache = f"tensor<2x{MAX_SEQ_LEN}x{CONFIG.num_key_value_heads}x{CONFIG.head_dim}xf32>"
    assert inputs.count(cache) == outputs.count(cache) == 2 * CONFIG.num_hidden_layers
    assert "tensor<2x1xi64>" in inputs and outputs.startswith("tensor<2x1xi64>")  # tokens in, next token out
    assert excerpt == stablehlo_excerpt(out)  # what the notebook shows: signature, a cache write, return
    signature, _, cache_write, _, result = excerpt.splitlines()
    written, cache_in = re.match(r'\s*(%\w+) = "stablehlo.scatter"\((%\w+),', cache_write).groups()
    assert f"{cache_in}: {cache}" in signature  # index_copy writes into a cache argument...
    assert re.match(rf"\s*return %\w+, .*{written}[ ,]", result)  # ...and the graph returns the result


def test_artifact_refuses_a_process_with_spmd(tmp_path):
    with pytest.raises(RuntimeError, match="SPMD is on in this process"):
        Artifact(tmp_path)


@pytest.fixture
def manifest_dir(tmp_path):
    """A directory with only the manifest of a batch-2, 40-slot export (enough for `run`'s checks)."""
    manifest = make_manifest(ModelArgs.from_hf_config(CONFIG, 2, MAX_SEQ_LEN), BUCKETS)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--buckets", "16,8"], "buckets=(16, 8) must be increasing positive ints"),
    (["--buckets", "8,x"], "'8,x' is not a list of ints like 16,32"),
    (["--buckets", "8,64", "--max-seq-len", "40"], "largest bucket 64 > max_seq_len=40"),
    (["--max-seq-len", "0"], "max_seq_len=0 must be >= 1"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens=0 must be an int >= 1"),
    (["--prompt-ids", "1,2", "--prompt-ids", "3", "--batch-size", "1"], "2 prompts, but the artifact takes "
                                                                       "batches of exactly batch_size=1"),
])
def test_export_bad_argument_is_one_error_line(args, message, model_dir, tmp_path, capsys):
    code, _, err = cli(main, ["export", str(model_dir), str(tmp_path / "out"), *args], capsys)
    assert one_error_line(code, err, message), (code, err[-2000:])


def test_export_needs_a_model_directory_and_a_free_out_dir(model_dir, tmp_path, capsys):
    code, _, err = cli(main, ["export", str(tmp_path), str(tmp_path / "out")], capsys)
    assert one_error_line(code, err, "has no config.json"), err
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cli(main, ["export", str(model_dir), str(tmp_path)], capsys)
    assert one_error_line(code, err, "holds files that are not an artifact of this command (notes.txt)"), err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_earlier_artifact_is_replaced(tmp_path):
    (tmp_path / "functions").mkdir()
    (tmp_path / "functions" / "prefill_64.meta").write_text("{}")  # a bucket the new export may not have
    (tmp_path / "manifest.json").write_text("{}")
    prepare_out_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: --prompt-ids"),
    (["--prompt-ids", "1,2,3"], "1 prompts, but the artifact takes batches of exactly batch_size=2"),
    (["--prompt-ids", "1,300", "--prompt-ids", "2"], "prompt 0 has token id 300, not an int in the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * 30), "--prompt-ids", "2"], "= 48 cache slots > max_seq_len=40"),
    (["--prompt-ids", "1", "--prompt-ids", "2", "--max-new-tokens", "-1"], "max_new_tokens=-1 must be an int >= 1"),
])
def test_run_bad_argument_is_one_error_line(args, message, manifest_dir, capsys):
    code, _, err = cli(main, ["run", str(manifest_dir), *args], capsys)
    assert one_error_line(code, err, message), (code, err[-2000:])


def test_run_needs_an_artifact(tmp_path, capsys):
    code, _, err = cli(main, ["run", str(tmp_path), "--prompt-ids", "1"], capsys)
    assert one_error_line(code, err, f"{tmp_path} has no manifest.json"), err
    code, _, err = cli(main, [], capsys)
    assert one_error_line(code, err, "the following arguments are required: command"), err

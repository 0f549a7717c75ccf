"""The OpenAI-compatible server as its clients see it.

One real server process (python -m llama_xla_helpers.serve, on 127.0.0.1, a free port) serves a
tiny random Llama that the tests write themselves (no tokenizer: the byte tokenizer). The tests
call it with the official `openai` client and with plain HTTP, in bursts, streamed and not, with
bad parameters, n choices and token-id prompts, check /metrics (parsed by prometheus_client: no
compilation after warm-up, the latency histograms), compare every greedy text with `Generator`'s
for the same prompt, and end with SIGTERM while a request is in flight. Two more processes run the
server with a step the test changes (`PATCHED`, a `python -c` script: nothing in the package knows
of it): one whose steps are slow, for clients that leave and for SIGTERM's drain timeout, and one
whose step raises, for the fault. A full queue, the API key, the chat template's errors, every EOS
id and /health after a fault are checked on the app in this process; bad command lines on `main`.
Tests run in file order: the last one of each process stops it.
"""
import functools
import http.client
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from llama_xla_helpers import api, checkpoint, protocol, serve
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import ByteTokenizer
from llama_xla_helpers.detokenize import token_key
from llama_xla_helpers.engine import Engine
from llama_xla_helpers.generate import Generator, llama3_chat
from llama_xla_helpers.mesh import make_mesh, mesh_shape
from llama_xla_helpers.model import Llama
from llama_xla_helpers.train import build_model
from test_cli import cli, one_error_line
from test_generate import word_tokenizer
from util import teacher_forced_agreement

MAX_SEQ_LEN, BUCKETS = 128, (8, 32)
SERVE = [sys.executable, "-m", "llama_xla_helpers.serve"]
TOK = ByteTokenizer()
LONG = "cat"  # a prompt whose greedy run reaches no EOS in 120 tokens, all the cache's room (asserted)
# The server's command line with its engine loop changed (only the loop's steps: warm-up is as it is):
# each step first sleeps step_s seconds, and with fault=True a step raises once 20 tokens are out.
PATCHED = """import sys, time
from llama_xla_helpers import engine, serve
def run(self, stop, run=engine.Engine.run, step=engine.Engine.step):
    def patched():
        time.sleep({step_s})
        if {fault} and self.metrics()["tokens_total"] >= 20:
            raise RuntimeError("injected fault")
        return step(self)
    self.step = patched
    return run(self, stop)
engine.Engine.run = run
serve.main(sys.argv[1:])
"""


def tiny_config():
    """One layer, large weights (initializer_range 0.2) so greedy tokens vary."""
    return get_config("tiny", num_hidden_layers=1, initializer_range=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Hugging Face folder with a seeded random tiny Llama and no tokenizer."""
    path = tmp_path_factory.mktemp("serve") / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


class ServerProcess:
    """`python -m llama_xla_helpers.serve` on a free port. It starts at once; `url` waits until
    it prints `ready on URL` (so a test can compute its expected values meanwhile)."""

    def __init__(self, args, log, patch=None):
        self.log = log
        command = [sys.executable, "-c", patch] if patch else SERVE
        self.proc = subprocess.Popen(command + [*map(str, args), "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True)
        self.lines, self.ready = [], threading.Event()
        threading.Thread(target=self.read, daemon=True).start()

    @functools.cached_property
    def url(self):
        if not self.ready.wait(300) or self.proc.poll() is not None:
            self.proc.kill()
            raise AssertionError(f"the server did not get ready: {self.output()}")
        return next(line for line in self.lines if line.startswith("ready on ")).removeprefix("ready on ")

    def read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ready on "):
                self.ready.set()
        self.ready.set()  # exited

    def output(self):
        return "\n".join(self.lines) + "\n" + open(self.log).read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # fp32 whatever LLAMA_XLA_DEFAULT_DTYPE says: the point is equality with `expected` (fp32)
    running = ServerProcess([model_dir, "--max-seq-len", MAX_SEQ_LEN, "--buckets", ",".join(map(str, BUCKETS)),
                             "--dtype", "fp32", "--no-compile"], tmp_path_factory.mktemp("log") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slow_server(model_dir, tmp_path_factory):
    """The server with steps of 30 ms more (`PATCHED`), 2 slots, a queue of 2 and --drain-timeout 1:
    a request for 120 tokens takes 4 s."""
    running = ServerProcess([model_dir, "--max-seq-len", MAX_SEQ_LEN, "--buckets", 8, "--dtype", "fp32", "--no-compile", "--slots", 2,
                             "--max-queue", 2, "--drain-timeout", 1], tmp_path_factory.mktemp("log") / "slow.log",
                            patch=PATCHED.format(step_s=0.03, fault=False))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def greedy(model_dir):
    """greedy(prompt, max_tokens) -> the tokens of `Generator`, stopping at the byte tokenizer's EOS."""
    gen = Generator(Llama.from_pretrained(model_dir, max_batch_size=1, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)

    @functools.cache
    def run(prompt, max_tokens):
        [tokens], _ = gen.generate([TOK.encode(prompt)], max_tokens, eos_id=TOK.eos_id)
        return tuple(tokens)
    return run


@pytest.fixture(scope="module")
def expected(greedy):
    """expected(prompt, max_tokens) -> (text, completion tokens, finish reason) of `greedy`, as the server answers."""
    def run(prompt, max_tokens):
        tokens = greedy(prompt, max_tokens)
        return TOK.decode(tokens), len(tokens), "stop" if tokens[-1] == TOK.eos_id else "length"
    return run


def post(url, path, body, timeout=120):
    """(status, JSON body) of a POST; body: a dict (sent as JSON) or raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def open_stream(url, path, body):
    """The open HTTP response of a streamed POST (read it with `events`; `.connection.close()` leaves)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.connection = conn
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    return response


def events(response):
    """The server-sent events' data, parsed (the last one is the string "[DONE]")."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            yield data if data == "[DONE]" else json.loads(data)


def metric_families(url):
    """/metrics, parsed by prometheus_client: {family name: family}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def metrics(url):
    """{sample name without llama_xla_: value} of /metrics' samples without labels (not a histogram's buckets)."""
    return {s.name.removeprefix("llama_xla_"): s.value
            for f in metric_families(url).values() for s in f.samples if not s.labels}


def send(url, body):
    """A socket that has sent a non-streamed POST /v1/completions; `answer(sock)` reads the response."""
    parts, data = urlsplit(url), json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def answer(sock):
    """(status, JSON body) of the response on a socket from `send`."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def wait_for(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- the server process ------------------------------------------------------------------------

@pytest.mark.child_process
def test_openai_client_completions_and_chat_equal_generator(server, expected):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = protocol.chat_prompt(TOK, messages)
    assert prompt == "system: Be brief.\nuser: hi\nassistant:"
    expected(prompt, 12)  # computed (and compiled) here while the server starts
    text, n, reason = expected("cat", 24)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    [model] = client.models.list().data
    assert model.id == "tiny-llama"
    out = client.completions.create(model=model.id, prompt="cat", max_tokens=24, temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (text, reason)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (4, n, 4 + n)

    chat = client.chat.completions.create(model=model.id, messages=messages, max_tokens=12, temperature=0)
    text, n, reason = expected(prompt, 12)
    assert (chat.choices[0].message.role, chat.choices[0].message.content) == ("assistant", text)
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == (reason, n)


@pytest.mark.child_process
@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_adds_up_to_the_greedy_text(server, expected, chat):
    """Chunks hold back unfinished UTF-8 characters (this random model writes many invalid bytes),
    so they concatenate to the non-streamed text; the stream ends with [DONE]."""
    body = dict(max_tokens=40, temperature=0, stream_options=dict(include_usage=True))
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Why"}]
    else:
        path, body["prompt"] = "/v1/completions", "Why"
    got = list(events(open_stream(server.url, path, body)))
    assert got[-1] == "[DONE]"
    *chunks, usage = got[:-1]
    pieces = [c["choices"][0]["delta" if chat else "text"] for c in chunks]
    text = "".join(p.get("content", "") for p in pieces) if chat else "".join(pieces)
    want = expected(protocol.chat_prompt(TOK, body["messages"]) if chat else "Why", 40)
    assert len(chunks) > 5 and text == want[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [want[2]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == want[1]
    assert not chat or pieces[0]["role"] == "assistant"
    status, whole = post(server.url, path, {**body, "stream": False, "stream_options": None})
    assert status == 200 and (whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]) == text


@pytest.mark.child_process
def test_a_burst_of_concurrent_requests(server, expected):
    """12 clients at once on 4 slots: the rest wait in the queue; every greedy text equals the
    prompt's alone; two sampled requests with one seed agree; a stop string cuts the text."""
    prompts = ["H", "a", "b", "The", "cat", "x", "0", "1", "2", "3", "dog", "if"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def greedy(i):
        if i % 2:
            return client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=30, temperature=0)\
                .choices[0].text
        return post(server.url, "/v1/completions", dict(prompt=prompts[i], max_tokens=30, temperature=0))[1]\
            ["choices"][0]["text"]
    sampled = dict(prompt="for", max_tokens=30, temperature=0.9, top_p=0.8, seed=7)
    with ThreadPoolExecutor(len(prompts) + 2) as pool:
        texts = list(pool.map(greedy, range(len(prompts))))
        draws = list(pool.map(lambda _: post(server.url, "/v1/completions", sampled)[1], range(2)))
    assert texts == [expected(p, 30)[0] for p in prompts]
    assert draws[0]["choices"] == draws[1]["choices"]

    text = expected("def", 30)[0]
    cut = next(i for i in range(3, len(text)) if text[i].isalnum() and text.index(text[i]) == i)
    status, out = post(server.url, "/v1/completions", dict(prompt="def", max_tokens=30, temperature=0, stop=[text[cut]]))
    assert status == 200 and (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == (text[:cut], "stop")


BAD = [
    (dict(max_tokens=0), 400, "max_tokens=0 must be an int >= 1"),
    (dict(temperature=-1), 400, "temperature=-1.0 must be >= 0"),
    (dict(top_p=0), 400, "top_p=0.0 must be in (0, 1]"),
    (dict(top_p=1.5), 400, "top_p=1.5 must be in (0, 1]"),
    (dict(prompt=[300]), 400, "prompt token id 300 is outside the vocabulary [0, 264)"),
    (dict(prompt="x" * 200), 400, "cache slots > max_seq_len=128"),
    (dict(max_tokens=128), 400, "cache slots > max_seq_len=128"),
    (dict(max_tokens="many"), 400, "max_tokens: Input should be a valid integer"),
    (dict(n=17), 400, "n: Input should be less than or equal to 16"),
    (dict(top_k=65), 400, "top_k: Input should be less than or equal to 64"),
    (dict(logprobs=21), 400, "logprobs: Input should be less than or equal to 20"),
    (dict(stop=["a", ""]), 400, "every stop string must be a non-empty string"),
    (dict(stop=list("abcde")), 400, "stop=['a', 'b', 'c', 'd', 'e'] holds more than 4 stop strings"),
    (dict(stream_options=dict(include_usage=True)), 400, "stream_options is only allowed with stream: true"),
    (dict(prompt=[]), 400, "prompt is empty"),
    (dict(prompt=[[1, 2], []]), 400, "a prompt is empty"),
    (dict(prompt=[1, "a"]), 400, "prompt."),
    (dict(logit_bias={"50": 101}), 400, "logit_bias={50: 101.0} must map token ids in [0, 264) to numbers in [-100"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias key 'x' is not a token id"),
    (dict(suffix="end"), 400, "suffix='end' is not supported by this server"),
    (dict(presence_penalty=2.5), 400, "presence_penalty: Input should be less than or equal to 2"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}), 400,
     "response_format.json_schema.schema: xgrammar cannot compile this JSON schema: Unsupported type"),
    (dict(best_of=3), 400, "best_of=3 is not supported"),
    (dict(temprature=0.5), 400, "temprature: Extra inputs are not permitted"),
    (dict(model="gpt-4"), 404, "the model 'gpt-4' does not exist; this server serves 'tiny-llama'"),
    (b"{not json", 400, "JSON decode error"),
]


@pytest.mark.child_process
@pytest.mark.parametrize("body, status, message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_a_bad_request_gets_an_openai_error_and_the_server_goes_on(server, body, status, message):
    if isinstance(body, dict):
        body = {"prompt": "Hello", "max_tokens": 4, **body}
    got, out = post(server.url, "/v1/completions", body)
    assert got == status and message in out["error"]["message"], out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    name = re.match(r"\w+", message)[0]  # the parameter, where the message names one first
    assert out["error"]["param"] == name or not isinstance(body, dict) or name not in body, out
    assert post(server.url, "/v1/completions", dict(prompt="Hello", max_tokens=2))[0] == 200


@pytest.fixture(scope="module")
def log_softmax(model_dir):
    """log_softmax(token ids) -> (len, vocab_size): Hugging Face's model's log-probabilities, fp32 on the CPU."""
    hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
    return lambda ids: torch.log_softmax(hf(torch.tensor([ids])).logits[0].detach().float(), -1)


@pytest.mark.child_process
def test_logprobs_echo_n_and_token_id_prompts(server, expected, log_softmax):
    """Log-probabilities equal a log-softmax of Hugging Face's logits: of greedy tokens and of an
    echoed prompt (max_tokens 0 scores it, as evaluation harnesses do); ids or text prompts; n choices."""
    ids = TOK.encode("cat")
    greedy = list(ids)
    for _ in range(6):  # Hugging Face's greedy tokens
        greedy.append(int(log_softmax(greedy)[-1].argmax()))
    rows = log_softmax(greedy)  # row i predicts token i + 1
    for body in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        status, out = post(server.url, "/v1/completions", dict(prompt=ids, max_tokens=6, logprobs=2, echo=True, **body))
        assert status == 200, out
        lp, n = out["choices"][0]["logprobs"], out["usage"]["completion_tokens"]
        assert out["choices"][0]["text"].startswith("cat") and len(lp["tokens"]) == len(ids) + n
        assert lp["token_logprobs"][0] is None and all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
        graded = len(greedy) - 1 if body["temperature"] == 0 else len(ids)  # sampled: the prompt's only
        assert lp["token_logprobs"][1:graded] == pytest.approx([rows[i, greedy[i + 1]].item()
                                                                for i in range(graded - 1)], abs=1e-4)
    scored = post(server.url, "/v1/completions", dict(prompt="cat", max_tokens=0, echo=True, logprobs=0))[1]
    assert (scored["choices"][0]["text"], scored["usage"]["completion_tokens"]) == ("cat", 0)
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    by_ids = post(server.url, "/v1/completions", dict(prompt=[ids, TOK.encode("dog")], max_tokens=6, temperature=0))[1]
    assert [c["text"] for c in by_ids["choices"]] == [expected("cat", 6)[0], expected("dog", 6)[0]]
    out = post(server.url, "/v1/completions", dict(prompt=["cat", "dog"], n=2, max_tokens=8, temperature=1.0, seed=1))[1]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] != out["choices"][1]["text"]  # seeds 1 and 2
    assert out["usage"]["prompt_tokens"] == 8 and out["usage"]["completion_tokens"] > 8


@pytest.mark.child_process
def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_text(server):
    prompt = "Exceptions are raised when a prompt repeats itself for the prefix cache"
    n = len(TOK.encode(prompt))
    first, again = [post(server.url, "/v1/completions", dict(prompt=prompt, max_tokens=6, temperature=0))[1]
                    for _ in range(2)]
    assert n > 16 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16  # full pages of 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.child_process
def test_a_chat_without_max_tokens_may_use_the_whole_room_and_reports_logprobs(server, model_dir):
    messages = [{"role": "user", "content": "Why"}]
    prompt = protocol.chat_prompt(TOK, messages)
    ids = TOK.encode(prompt)
    room = MAX_SEQ_LEN - len(ids)  # no padding: the whole rest of the context
    chat = post(server.url, "/v1/chat/completions", dict(messages=messages, temperature=0, logprobs=True, top_logprobs=2))[1]
    alone = Generator(Llama.from_pretrained(model_dir, max_batch_size=1, max_seq_len=MAX_SEQ_LEN),
                      buckets=(len(ids),))  # a bucket of the prompt's length: Generator's padding leaves the room whole
    [tokens], _ = alone.generate([ids], room, eos_id=TOK.eos_id)
    text, n = TOK.decode(tokens), len(tokens)
    assert (chat["choices"][0]["message"]["content"], chat["usage"]["completion_tokens"]) == (text, n)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == n and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert post(server.url, "/v1/chat/completions", dict(messages=messages, top_logprobs=2))[0] == 400


@pytest.mark.child_process
@pytest.mark.parametrize("chunked", [False, True])
def test_an_oversize_body_is_413_before_it_is_read(server, chunked):
    """By its Content-Length, at once (no body is sent); or once more than MAX_BODY_BYTES of a
    chunked body have arrived. A prompt of 100k token ids (about 600 kB) is within the limit."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    if chunked:
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        data = b" " * (api.MAX_BODY_BYTES + 1)
        conn.send(b"%x\r\n%s\r\n" % (len(data), data))
    else:
        conn.putheader("Content-Length", str(api.MAX_BODY_BYTES + 1))
        conn.endheaders()  # and no body: the answer comes from the headers alone
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 413 and "limit of 4194304" in error["message"] and error["code"] == "body_too_large"
    conn.close()
    status, out = post(server.url, "/v1/completions", dict(prompt=[1] * 100_000))
    assert status == 400 and "the longest prompt (100000 tokens" in out["error"]["message"], out


@pytest.mark.child_process
def test_bad_chat_and_routes(server):
    chat, hi = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    assert post(server.url, chat, dict(messages=[]))[0] == 400
    assert post(server.url, chat, dict(messages=[{"role": "user"}]))[0] == 400
    status, out = post(server.url, chat, dict(messages=[{**hi[0], "weight": 2}]))
    assert status == 400 and out["error"]["message"] == "messages.0.weight: Extra inputs are not permitted", out
    status, out = post(server.url, chat, dict(messages=hi, tool_choice="auto"))
    assert status == 400 and out["error"]["param"] == "tool_choice", out
    status, out = post(server.url, chat, dict(messages=hi, max_completion_tokens=0))
    assert status == 400 and out["error"]["param"] == "max_tokens", out
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url + "/v1/nothing", timeout=30)
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["message"] == "Not Found"


@pytest.mark.child_process
def test_what_benchmark_clients_send(server, expected):
    """A chat's content as OpenAI's list of text parts is the text of the parts a line apart; an image
    part is a 400 that says so, and the server logs each 4xx's reason at its default level;
    continuous_usage_stats puts the usage so far in every chunk."""
    chat = "/v1/chat/completions"
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}]
    want = expected(protocol.chat_prompt(TOK, [{"role": "user", "content": "Be\nbrief"}]), 12)
    status, out = post(server.url, chat, dict(messages=[{"role": "user", "content": parts}], max_tokens=12,
                                              temperature=0))
    assert status == 200 and out["choices"][0]["message"]["content"] == want[0], out
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, out = post(server.url, chat, dict(messages=[{"role": "user", "content": [parts[0], image]}]))
    message = "content part 1 has type 'image_url': this server takes text parts only"
    assert status == 400 and out["error"]["message"].startswith(message) and out["error"]["param"] == "messages"
    wait_for(lambda: f"400 POST /v1/chat/completions: {message}" in open(server.log).read())

    body = dict(prompt="Why", max_tokens=40, temperature=0, stream=True,
                stream_options=dict(include_usage=True, continuous_usage_stats=True))
    *chunks, last, done = events(open_stream(server.url, "/v1/completions", body))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    text, n, _ = expected("Why", 40)
    assert done == "[DONE]" and last["choices"] == [] and last["usage"]["completion_tokens"] == n
    assert counts == sorted(counts) and counts[-1] == n and all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


@pytest.mark.child_process
def test_unsupported_parameters_with_their_no_op_values_are_accepted(server, expected):
    noops = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, suffix="", best_of=1, logprobs=None,
                 echo=False, top_k=-1, user="u1", stream_options=None)
    status, out = post(server.url, "/v1/completions", dict(prompt=LONG, max_tokens=5, temperature=0, **noops))
    assert status == 200 and out["choices"][0]["text"] == expected(LONG, 5)[0], out
    noops = dict(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False,
                 max_completion_tokens=3, logit_bias={}, presence_penalty=0)
    status, out = post(server.url, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], **noops))
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out


@pytest.mark.child_process
def test_n_choices_seeds_streams_and_defaults(server, expected):
    """Sampled with a seed, choice j of n is the request with seed + j. Streamed, the choices' chunks
    come interleaved, each with its index, and add up to the whole texts; the usage sums them. A
    completion's max_tokens defaults to 16; a stop string may be longer than 4 characters."""
    url, cat, dog = server.url, TOK.encode(LONG), TOK.encode("dog")
    sampled = dict(prompt="for", max_tokens=12, temperature=1.0, seed=7)
    status, out = post(url, "/v1/completions", {**sampled, "n": 3})
    alone = [post(url, "/v1/completions", {**sampled, "seed": 7 + j})[1]["choices"][0]["text"] for j in range(3)]
    assert [c["text"] for c in out["choices"]] == alone and len(set(alone)) == 3

    body = dict(prompt=[cat, dog], n=2, max_tokens=16, temperature=0)
    status, whole = post(url, "/v1/completions", body)
    assert [c["text"] for c in whole["choices"]] == [expected(LONG, 16)[0]] * 2 + [expected("dog", 16)[0]] * 2
    got = list(events(open_stream(url, "/v1/completions", {**body, "stream_options": dict(include_usage=True)})))
    assert got[-1] == "[DONE]" and got[-2]["usage"] == whole["usage"]
    order = [c["choices"][0]["index"] for c in got[:-2]]
    assert order != sorted(order)  # the four choices' chunks come as their tokens do, interleaved
    texts = ["".join(c["choices"][0]["text"] for c in got[:-2] if c["choices"][0]["index"] == i) for i in range(4)]
    assert texts == [c["text"] for c in whole["choices"]]

    out = post(url, "/v1/completions", dict(prompt=LONG, temperature=0))[1]
    assert (out["choices"][0]["text"], out["usage"]["completion_tokens"]) == (expected(LONG, 16)[0], 16)
    text = expected(LONG, 30)[0]
    cut = next(i for i in range(3, len(text)) if text[i].isalnum() and text.index(text[i]) == i)
    stop = ["a stop string that never comes", text[cut]]
    out = post(url, "/v1/completions", dict(prompt=LONG, max_tokens=30, temperature=0, stop=stop))[1]
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == (text[:cut], "stop"), out


def json_schemas(n, seed=0):
    """n JSON schemas of objects: nested objects, arrays, enums, integers and numbers in ranges,
    booleans and strings of a pattern, required and optional fields (bounded, so that a random
    model's answer ends within 96 bytes: a string without a pattern could run to max_tokens)."""
    rng = random.Random(seed)

    def value(depth):
        kinds = ["integer", "number", "boolean", "enum", "string"] + ["array", "object"] * (depth < 1)
        kind = rng.choice(kinds)
        if kind in ("integer", "number"):
            return {"type": kind, "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 999)}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "yes", 3, None], rng.randint(1, 4))}
        if kind == "string":
            return {"type": "string", "pattern": f"^[a-z]{{1,{rng.randint(1, 5)}}}$"}
        if kind == "array":
            return {"type": "array", "items": value(depth + 1), "maxItems": rng.randint(1, 2)}
        if kind == "object":
            return obj(depth + 1)
        return {"type": kind}

    def obj(depth):
        props = {f"k{i}": value(depth) for i in range(rng.randint(1, 3 - depth))}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": rng.sample(sorted(props), rng.randint(depth == 0, len(props)))}
    return [obj(0) for _ in range(n)]


@pytest.mark.child_process
def test_response_format_answers_parse_and_validate_greedy_or_sampled_streamed_or_not(server):
    """20 generated schemas through the openai client, on both endpoints, greedy and sampled,
    streamed and not: every answer ends with "stop" and validates against its schema (jsonschema);
    json_object gives an object; max_tokens cuts one ("length"). Four at a time."""
    import jsonschema
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def ask(i, schema):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        kwargs = dict(model="tiny-llama", max_tokens=96, temperature=[0, 1.0][i % 2], seed=i, stream=i % 4 >= 2)
        if i % 8 < 4:
            out = client.chat.completions.create(messages=[{"role": "user", "content": f"Answer {i}"}],
                                                 response_format=fmt, **kwargs)
            parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in out] if kwargs["stream"] \
                else [(out.choices[0].message.content, out.choices[0].finish_reason)]
        else:
            out = client.completions.create(prompt=f"Answer {i}:", extra_body=dict(response_format=fmt), **kwargs)
            parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in out] if kwargs["stream"] \
                else [(out.choices[0].text, out.choices[0].finish_reason)]
        return "".join(text for text, _ in parts), parts[-1][1]
    schemas = json_schemas(20)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20), schemas))
    for (text, reason), schema in zip(answers, schemas):
        assert reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
    status, out = post(server.url, "/v1/completions", dict(prompt="cat", max_tokens=60, temperature=0,
                                                           response_format={"type": "json_object"}))
    assert status == 200 and isinstance(json.loads(out["choices"][0]["text"]), dict), out
    fmt = {"type": "json_schema", "json_schema": {"schema": schemas[0]}}
    status, out = post(server.url, "/v1/completions", dict(prompt="cat", max_tokens=2, response_format=fmt))
    assert status == 200 and out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["text"]) <= 2


@pytest.mark.child_process
def test_logit_bias_and_penalties_through_the_server(server, greedy, expected):
    """logit_bias forces a token (+100) and bans the greedy run's tokens (-100: none of them comes
    back, by the response's logprobs tokens); penalties change a greedy text that repeats tokens
    (their values against a by-hand reference: test_engine)."""
    tokens = greedy(LONG, 40)
    assert len(set(tokens)) < len(tokens), "no token repeats: the penalties would change nothing"
    status, out = post(server.url, "/v1/completions", dict(prompt=LONG, max_tokens=6, temperature=0,
                                                           logit_bias={str(ord("x")): 100}))
    assert status == 200 and out["choices"][0]["text"] == "x" * 6, out
    body = dict(prompt=LONG, max_tokens=40, temperature=0, logprobs=0, logit_bias={str(t): -100 for t in tokens})
    status, out = post(server.url, "/v1/completions", body)
    got = out["choices"][0]["logprobs"]["tokens"]
    banned = {token_key(TOK, t) for t in tokens} - {""}  # BOS and EOS have no text: keys "" both
    assert status == 200 and len(got) == 40 and not set(got) & banned, out
    status, out = post(server.url, "/v1/completions", dict(prompt=LONG, max_tokens=40, temperature=0,
                                                           frequency_penalty=2, presence_penalty=2))
    assert status == 200 and out["choices"][0]["text"] != expected(LONG, 40)[0], out


@pytest.mark.child_process
def test_metrics_after_everything_show_no_compilation_and_the_latencies(server):
    families, m = metric_families(server.url), metrics(server.url)
    assert m["compiles_since_warmup"] == 0
    assert m["requests_total"] > 20 and m["tokens_total"] > 500
    assert (m["slots"], m["slots_busy"], m["queue_length"]) == (4, 0, 0)
    assert [families[f"llama_xla_{key}"].type for key in ("requests", "tokens", "slots_busy")] == \
        ["counter", "counter", "gauge"]
    finished = m["e2e_request_latency_seconds_count"]
    assert finished > 20
    for name, _, _ in api.HISTOGRAMS:
        family = families[f"llama_xla_{name}"]
        buckets = [s.value for s in family.samples if s.name.endswith("_bucket")]
        assert family.type == "histogram" and buckets == sorted(buckets) and buckets[-1] == m[f"{name}_count"]
        assert 0 < m[f"{name}_sum"] < m[f"{name}_count"] * 10  # seconds: none took 10 s
    assert m["time_to_first_token_seconds_count"] == m["request_queue_time_seconds_count"] == finished
    assert 0 < m["time_per_output_token_seconds_count"] <= finished  # not one-token requests
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    assert json.loads(urllib.request.urlopen(server.url + "/health", timeout=30).read()) == {"status": "ok"}


@pytest.mark.child_process
def test_sigterm_finishes_the_request_in_flight_then_exits_0(server, expected):
    """The last test of the shared server: it stops it."""
    response = open_stream(server.url, "/v1/completions", dict(prompt="b", max_tokens=100, temperature=0))
    stream = events(response)
    first = next(stream)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in [first] + rest[:-1]) == expected("b", 100)[0]
    assert server.proc.wait(60) == 0, server.output()
    wait_for(lambda: server.lines[-1].startswith("stopped: "))


# --- the server with slow steps, and with a step that fails ------------------------------------

@pytest.mark.child_process
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot(slow_server, expected, stream):
    """A request for all the cache's room (120 tokens, 4 s) whose client leaves once it runs: its slot
    frees within a step or two. Without the cancellation it would run to its 120th token."""
    assert expected(LONG, 120)[1:] == (120, "length")
    url, body = slow_server.url, dict(prompt=LONG, max_tokens=120, temperature=0)
    if stream:
        response = open_stream(url, "/v1/completions", body)
        next(events(response))  # one chunk: the request runs
        leave = response.connection.close
    else:
        leave = send(url, body).close
        wait_for(lambda: metrics(url)["slots_busy"] == 1)
    before = metrics(url)["tokens_total"]
    leave()
    wait_for(lambda: metrics(url)["slots_busy"] == 0)
    assert metrics(url)["tokens_total"] - before <= 5


@pytest.mark.child_process
def test_cancelled_waiting_requests_do_not_fill_the_queue(slow_server):
    """2 slots busy, 2 requests waiting (max_queue=2) whose clients leave: a new request is queued, not a 429."""
    url, body = slow_server.url, dict(prompt=LONG, max_tokens=120, temperature=0)
    running = [open_stream(url, "/v1/completions", body) for _ in range(2)]
    for response in running:
        next(events(response))
    waiting = [send(url, body) for _ in range(2)]
    wait_for(lambda: metrics(url)["queue_length"] == 2)
    for sock in waiting:
        sock.close()
    time.sleep(0.5)  # the server cancels them at once; the running two have 3 s to go
    new = send(url, dict(prompt="x", max_tokens=2))
    time.sleep(0.5)
    for response in running:
        response.connection.close()
    status, out = answer(new)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


@pytest.mark.child_process
def test_sigterm_drains_for_drain_timeout_then_cancels_and_exits_0(slow_server, expected):
    """--drain-timeout 1: the 120-token request (4 s) still running 1 s after SIGTERM ends
    "cancelled", its stream with usage and [DONE], and the process exits 0. The last test of slow_server."""
    response = open_stream(slow_server.url, "/v1/completions", dict(prompt=LONG, max_tokens=120, temperature=0,
                                                                    stream_options=dict(include_usage=True)))
    stream = events(response)
    first = next(stream)
    start = time.monotonic()
    slow_server.proc.send_signal(signal.SIGTERM)
    *chunks, usage, done = [first, *stream]
    waited = time.monotonic() - start
    assert done == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "cancelled"
    assert 1 <= waited < 2.5 and usage["usage"]["completion_tokens"] < 100
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert expected(LONG, 120)[0].startswith(text.rstrip("\ufffd"))
    assert slow_server.proc.wait(60) == 0, slow_server.output()
    wait_for(lambda: slow_server.lines[-1].startswith("stopped: "))
    assert "drain timeout (1 s): cancelling 1 request(s) still running" in slow_server.lines


@pytest.mark.child_process
def test_an_engine_fault_ends_every_request_with_an_error_and_the_server_exits_1(model_dir, tmp_path):
    """A step raises (`PATCHED`, steps of 50 ms) at the 20th token of the request in the one slot:
    its stream gets an error event then [DONE], the request waiting for the slot a JSON 500, and
    the process exits with status 1."""
    server = ServerProcess([model_dir, "--max-seq-len", MAX_SEQ_LEN, "--buckets", 8, "--dtype", "fp32", "--no-compile", "--slots", 1],
                           tmp_path / "server.log", patch=PATCHED.format(step_s=0.05, fault=True))
    try:
        stream = events(open_stream(server.url, "/v1/completions", dict(prompt=LONG, max_tokens=100, temperature=0)))
        next(stream)
        waiting = send(server.url, dict(prompt="x", max_tokens=5))
        *_, error, done = stream
        status, out = answer(waiting)
    finally:
        code = server.stop()
    assert done == "[DONE]" and "RuntimeError: injected fault" in error["error"]["message"], error
    assert (status, out["error"]["type"]) == (500, "server_error") and "injected fault" in out["error"]["message"]
    assert code == 1 and "the engine failed: RuntimeError: injected fault" in server.lines[-1], server.output()


# --- in this process ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    """An engine in this process: the model of `model_dir`, one slot, a queue of one."""
    torch.manual_seed(0)
    model = Llama.from_hf(LlamaForCausalLM(tiny_config()), max_batch_size=1, max_seq_len=32)
    return Engine(model, slots=1, buckets=(8,), max_queue=1, eos_id=TOK.eos_id, decode=TOK.decode, compile=False)


def test_start_in_thread_serves_from_this_process_and_stops(engine, expected):
    """Notebook 06b's way on a TPU: uvicorn in a thread of the process that holds the device."""
    engine.warmup()
    app = serve.app(engine, TOK, "tiny")
    server = serve.start_in_thread(app, port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="tiny", prompt="H", max_tokens=20, temperature=0)
        assert out.choices[0].text == expected("H", 20)[0]
    finally:
        server.stop()
    assert not server.thread.is_alive() and not app.state.served.running()
    assert engine.metrics()["compiles_since_warmup"] == 0


def test_an_api_key_guards_v1_and_leaves_health_and_metrics_open(engine, expected):
    server = serve.start_in_thread(api.app(engine, TOK, "tiny", api_key="sesame"), port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        out = client.completions.create(model="tiny", prompt="H", max_tokens=5, temperature=0)
        assert out.choices[0].text == expected("H", 5)[0]
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="open", max_retries=0)
        for call in (wrong.models.list, lambda: client.models.list(extra_headers={"Authorization": openai.omit})):
            with pytest.raises(openai.AuthenticationError) as e:
                call()
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
        for path in ("/health", "/metrics"):
            assert urllib.request.urlopen(server.url + path, timeout=30).status == 200
    finally:
        server.stop()


def test_each_app_has_its_own_metrics_registry(engine):
    for name in ("one", "two"):  # a second app in this process: prometheus_client's default registry would refuse it
        text = TestClient(api.app(engine, TOK, name)).get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["llama_xla_requests"].type == "counter"
        assert families["llama_xla_time_to_first_token_seconds"].type == "histogram"
        assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)


def test_after_an_engine_fault_health_is_503_and_requests_get_json_errors(engine, monkeypatch):
    """The step after a request takes the slot raises: the request gets a JSON 500, /health says
    why, a new request gets a 503, and the engine holds nothing."""
    step = engine.step

    def failing():
        if engine.metrics()["slots_busy"]:
            raise RuntimeError("injected fault")
        return step()
    monkeypatch.setattr(engine, "step", failing)
    with TestClient(api.app(engine, TOK, "tiny")) as client:
        r = client.post("/v1/completions", json=dict(prompt="H", max_tokens=10))
        assert r.status_code == 500 and "RuntimeError: injected fault" in r.json()["error"]["message"], r.text
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "error",
                                                     "message": "the engine failed: RuntimeError: injected fault"}
        r = client.post("/v1/completions", json=dict(prompt="H", max_tokens=10))
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
    assert (engine.metrics()["slots_busy"], engine.metrics()["queue_length"]) == (0, 0)


def test_every_eos_id_of_the_model_ends_a_request(model_dir, greedy, tmp_path):
    """generation_config.json lists two EOS ids: 1, and the token the greedy run writes at step k.
    The request stops there (finish_reason "stop"), and the ids of config.json count too."""
    tokens = greedy(LONG, 40)
    k = next(k for k in range(5, 40) if tokens[k] not in tokens[:k])
    folder = shutil.copytree(model_dir, tmp_path / "tiny-llama")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [1, tokens[k]]}))
    assert serve.decoder(TOK, LlamaConfig(eos_token_id=[5, 6]), folder)[1] == {TOK.eos_id, 5, 6, 1, tokens[k]}
    engine, tokenizer = serve.load_engine(folder, slots=1, max_seq_len=MAX_SEQ_LEN, buckets=(8,), dtype="fp32",
                                          compile=True)  # the TPU's path, as `serve --compile` asks for it
    assert engine.eos_ids == {TOK.eos_id, 1, tokens[k]}  # config.json's is the byte tokenizer's
    with TestClient(api.app(engine, tokenizer, "tiny")) as client:
        out, ignoring, masked = (client.post("/v1/completions", json=dict(prompt=LONG, max_tokens=40, temperature=0,
                                                                           **extra)).json()
                                 for extra in (dict(), dict(ignore_eos=True), dict(min_tokens=k + 2)))
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == k + 1, out
    assert out["choices"][0]["text"] == TOK.decode(tokens[:k + 1])
    # vLLM's ignore_eos and min_tokens (masked inside the compiled step; test_engine.py checks the token by hand)
    assert (ignoring["choices"][0]["text"], ignoring["choices"][0]["finish_reason"]) == (TOK.decode(tokens), "length")
    assert masked["usage"]["completion_tokens"] >= k + 2 and masked["choices"][0]["text"].startswith(TOK.decode(tokens[:k]))
    assert engine.compiles_since_warmup == 0


def test_a_bf16_server_serves_its_engines_tokens_close_to_fp32(tmp_path, monkeypatch):
    """LLAMA_XLA_DEFAULT_DTYPE=bf16, a TPU's default: the server loads the model in bf16; its greedy text is
    the engine's own tokens, nothing compiles after warm-up, and the tokens agree with fp32's, teacher-
    forced, on at least 95% of the generated positions (weights of std 0.05, see test_generate's bf16 test)."""
    folder = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(get_config("tiny", num_hidden_layers=1, initializer_range=0.05)).save_pretrained(folder)
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "bf16")
    engine, tokenizer = serve.load_engine(folder, slots=1, max_seq_len=MAX_SEQ_LEN, buckets=BUCKETS, compile=False)
    assert engine.model.embed_tokens.weight.dtype == torch.bfloat16
    engine.warmup()
    prompts = ["The for statement", "class C:"]
    server = serve.start_in_thread(api.app(engine, tokenizer, "tiny"), port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0).choices[0].text
                 for p in prompts]
    finally:
        server.stop()
    served = engine.generate([TOK.encode(p) for p in prompts], 40)
    assert texts == [TOK.decode(t) for t in served] and engine.metrics()["compiles_since_warmup"] == 0

    fp32 = Generator(Llama.from_pretrained(folder, max_batch_size=1, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)
    # the engine's weights, with a cache of their own (the engine replaced its model's with pages)
    bf16 = Llama.from_pretrained(folder, max_batch_size=1, max_seq_len=MAX_SEQ_LEN, dtype="bf16").to(engine.runner.device)
    scores = []
    for p in prompts:
        [tokens], _ = fp32.generate([TOK.encode(p)], 40)
        scores.append(teacher_forced_agreement(fp32.model, bf16, torch.tensor([TOK.encode(p) + tokens]),
                                               len(TOK.encode(p))))
    agreement = sum(a for a, _ in scores) / len(scores)
    print(f"top-1 agreement {agreement:.1%}")
    assert agreement >= 0.95 and all(dots == {"bf16"} for _, dots in scores)


# Llama 3.1's tool format, the parts of its chat template that write it (the whole template also
# writes a system header and builtin tools): the tools as JSON in the first user message, a call as
# {"name": ..., "parameters": ...}, a tool's result under the ipython header.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(first=true) %}{% for m in messages %}"
    "{% if m.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if tools is not none and m.role == 'user' and ns.first %}Given the following functions, please respond with "
    "a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
    "format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use "
    "variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% set ns.first = false %}{% endif %}"
    "{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tool_server():
    """An app in this process whose tokenizer's template writes Llama 3.1's tool format: the BPE
    tokenizer of `tokenizer.small_tokenizer` (512 ids; the two tools' prompt is 650 tokens) over a
    tiny model of that vocabulary."""
    from llama_xla_helpers.tokenizer import small_tokenizer
    tok = small_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    torch.manual_seed(0)
    model = Llama.from_hf(LlamaForCausalLM(get_config("tiny", num_hidden_layers=1, initializer_range=0.2,
                                                      vocab_size=len(tok))), max_batch_size=2, max_seq_len=1024)
    engine = Engine(model, slots=2, buckets=(8, 256), eos_id=tok.eos_token_id, decode=serve.decoder(tok)[0],
                    compile=False)
    engine.warmup()
    server = serve.start_in_thread(api.app(engine, tok, "tiny"), port=0)
    yield server, tok, engine
    server.stop()


def test_a_tool_call_round_trip(tool_server):
    """tool_choice "required" (two tools) and a named function: the answer is a call of a tool with
    arguments valid against its parameters (jsonschema), finish_reason "tool_calls", streamed as
    one delta that adds up to the same call; the template wrote the tools (the prompt's tokens are
    those of the template with them). Then the call and the tool's result go back: the next
    prompt is the template's with both, and tool_choice "none" answers in text. A template that
    never reads tools, or a choice no tool matches, is a 400."""
    import jsonschema
    server, tok, engine = tool_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    user = [{"role": "user", "content": "What is the weather in Paris?"}]

    def prompt_tokens(messages, tools):
        return len(tok.encode(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    for choice, allowed in (("required", {"get_weather", "add"}), ({"type": "function", "function": {"name": "add"}},
                                                                      {"add"})):
        out = client.chat.completions.create(model="tiny", messages=user, tools=[WEATHER, ADD], tool_choice=choice,
                                             max_tokens=120, temperature=0)
        [call] = out.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
        assert call.function.name in allowed and out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert out.choices[0].message.content is None and out.usage.prompt_tokens == prompt_tokens(user, [WEATHER, ADD])
        stream = client.chat.completions.create(model="tiny", messages=user, tools=[WEATHER, ADD], tool_choice=choice,
                                                max_tokens=120, temperature=0, stream=True)
        chunks = [c.choices[0] for c in stream]
        [streamed] = [d for c in chunks for d in c.delta.tool_calls or []]
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)

    turn = user + [{"role": "assistant", "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"result": 7}'}]
    out = client.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER, ADD], tool_choice="none",
                                         max_tokens=8, temperature=0)
    rendered = [dict(m) for m in turn]
    rendered[1]["tool_calls"] = [dict(call.model_dump(), function=dict(name=call.function.name,
                                                                        arguments=json.loads(call.function.arguments)))]
    assert out.usage.prompt_tokens == prompt_tokens(rendered, [WEATHER, ADD]) > prompt_tokens(user, [WEATHER, ADD])
    assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)
    assert engine.metrics()["compiles_since_warmup"] == 0

    bad = dict(messages=user, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    status, out = post(server.url, "/v1/chat/completions", bad)
    assert status == 400 and out["error"]["message"].startswith("tool_choice names the function 'nope'"), out


def test_tools_on_a_template_that_never_reads_them_are_a_400(engine):
    with TestClient(api.app(engine, TOK, "tiny")) as client:  # the byte tokenizer: the plain transcript
        out = client.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "hi"}], tools=[ADD]))
    assert out.status_code == 400 and out.json()["error"]["param"] == "tools"
    assert out.json()["error"]["message"].startswith("this model's chat template does not render tools")


def test_a_full_queue_is_429(engine):
    """The app without its lifespan (no engine loop): the one waiting request stays in the queue."""
    client = TestClient(api.app(engine, TOK, "tiny"))
    engine.submit(TOK.encode("hi"), 4)
    r = client.post("/v1/completions", json=dict(prompt="hi", max_tokens=4))
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.json()
    assert "max_queue=1" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503


def test_a_chat_template_that_fails_is_a_json_400_and_anything_unexpected_a_json_500(engine, tmp_path, monkeypatch):
    tok = serve.read_tokenizer(word_tokenizer(tmp_path), None, tiny_config())
    client = TestClient(api.app(engine, tok, "tiny"), raise_server_exceptions=False)
    body = dict(messages=[{"role": "system", "content": "hi"}])
    for template, message in [("{{ raise_exception('no system messages, please') }}", "no system messages, please"),
                              ("{% if %}", "Expected an expression")]:  # a syntax error
        tok.chat_template = template
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert f"the model's chat template rejected these messages: {message}" in r.json()["error"]["message"]

    def broken(*args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(api, "chat_prompt", broken)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "RuntimeError: a bug" in r.json()["error"]["message"]


@pytest.mark.parametrize("args, message", [
    (["--slots", "0"], "argument --slots: '0' is not an int >= 1"),
    (["--port", "-1"], "argument --port: '-1' is not an int in [0, 65535]"),
    (["--port", "70000"], "'70000' is not an int in [0, 65535]"),
    (["--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["--max-queue", "0"], "argument --max-queue: '0' is not an int >= 1"),
    (["--buckets", "8,x"], "'8,x' is not a list of ints like 16,64,256"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--mesh", "0,8"], "argument --mesh: (0, 8) must be two ints >= 1"),
    (["--buckets", "2", "--slots", "4"], "the largest bucket (2 tokens, a step's budget) < slots=4"),
    (["--pages", "1"], "argument --pages: '1' is not an int >= 2"),
    (["--buckets", "32,8"], "buckets=(32, 8) must be increasing positive ints"),
    (["--max-seq-len", "4096"], "max_seq_len=4096 > the model's max_position_embeddings=2048"),
    (["--drain-timeout", "-1"], "argument --drain-timeout: '-1' is not a number >= 0"),
    (["--drain-timeout", "nan"], "argument --drain-timeout: 'nan' is not a number >= 0"),
])
def test_bad_argument_is_one_error_line(model_dir, args, message, capsys):
    code, _, err = cli(serve.main, [str(model_dir), "--port", "0", *args], capsys)
    assert one_error_line(code, err, message), (code, err[-2000:])


def test_compile_flag_picks_the_engines_path(tmp_path):
    flags = ([], ["--compile"], ["--no-compile"])
    assert [serve.parse_args([str(tmp_path), *f]).compile for f in flags] == [None, True, False]  # None: runner.default_compile()


def test_api_key_from_the_environment_and_a_warning_without_one_off_loopback(tmp_path, monkeypatch, capsys):
    """A key: no warning on 0.0.0.0 (and the folder's error line is all); none: one warning line first."""
    monkeypatch.setenv("LLAMA_XLA_API_KEY", "sesame")
    assert serve.parse_args([str(tmp_path)]).api_key == "sesame"
    argv = [str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    code, _, err = cli(serve.main, argv, capsys)
    assert one_error_line(code, err, "holds neither config.json"), err
    monkeypatch.delenv("LLAMA_XLA_API_KEY")
    code, _, err = cli(serve.main, argv, capsys)
    warning, rest = err.split("\n", 1)
    assert warning.startswith("warning: serving on 0.0.0.0 without an API key") and "--api-key" in warning
    assert one_error_line(code, rest, "holds neither config.json"), err


def test_a_pod_is_refused_with_the_way_that_works(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(serve.xr, "process_count", lambda: 2)
    code, _, err = cli(serve.main, [str(model_dir), "--port", "0"], capsys)
    assert one_error_line(code, err, "this is one of 2 hosts: the engine steps only on the host"), err
    assert "call Generator.generate with the same prompts on every host" in err


def test_a_folder_without_a_model_or_a_busy_port_is_one_error_line(model_dir, tmp_path, capsys):
    code, _, err = cli(serve.main, [str(tmp_path), "--port", "0"], capsys)
    assert one_error_line(code, err, f"{str(tmp_path)!r} holds neither config.json"), err
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, _, err = cli(serve.main, [str(model_dir), "--port", str(port)], capsys)
    assert one_error_line(code, err, f"cannot listen on 127.0.0.1:{port}"), err


def test_a_training_checkpoint_is_served_with_its_weights(tmp_path):
    """A checkpoint written by train (the sharded HF model; meta.json's extra holds the config)
    loads into the engine with the same weights, and the byte tokenizer."""
    config = tiny_config()
    trained = build_model(config, make_mesh(mesh_shape(None, config)), seed=3)
    checkpoint.save(tmp_path, 5, trained, extra=dict(config=config.to_dict(), train_config=dict(dtype="fp32")))
    # fp32 whatever LLAMA_XLA_DEFAULT_DTYPE says: the point is the same weights, bit for bit
    engine, tokenizer = serve.load_engine(tmp_path, max_seq_len=64, buckets=(8,), dtype="fp32")
    assert isinstance(tokenizer, ByteTokenizer) and engine.slots == 4
    for ours, theirs in [("embed_tokens", "model.embed_tokens"), ("lm_head", "lm_head"),
                         ("layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj")]:
        assert torch.equal(engine.model.get_submodule(ours).weight.cpu(), trained.get_submodule(theirs).weight.cpu())


LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_a_hugging_face_tokenizer_its_chat_template_or_the_plain_format(tmp_path):
    tok = serve.read_tokenizer(word_tokenizer(tmp_path), None, tiny_config())
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello how are you"}]
    assert protocol.chat_prompt(tok, messages) == "system: the cat\nuser: hello how are you\nassistant:"
    tok.chat_template = LLAMA3_TEMPLATE
    prompt = protocol.chat_prompt(tok, messages)
    assert prompt == llama3_chat(messages)
    ids = protocol.encode(tok, prompt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS, no second one
    decode, eos_ids = serve.decoder(tok)
    assert eos_ids == {tok.convert_tokens_to_ids("<|eot_id|>")} and "<|" not in decode(ids)
    # Llama 3 lists several EOS ids in generation_config.json: each ends a request
    GenerationConfig(eos_token_id=[3, 4]).save_pretrained(tmp_path)
    assert serve.decoder(tok, tiny_config(), tmp_path)[1] == {tok.eos_token_id, 3, 4, tiny_config().eos_token_id}


def test_default_mesh_replicates_kv_heads_where_needed():
    assert serve.mesh_shape_for(8, get_config("tiny")) == (1, 8)  # 4 KV heads, each copied twice
    assert serve.mesh_shape_for(16, get_config("tiny")) == (2, 8)
    assert serve.mesh_shape_for(1, get_config("tiny")) == (1, 1)
    assert serve.mesh_shape_for(16, get_config("llama2-70b")) == (1, 16)  # 8 KV heads, copied twice
    assert serve.mesh_shape_for(8, get_config("tiny", vocab_size=258)) == (4, 2)  # 258 = 2 * 3 * 43


def test_settled_text_holds_back_what_may_still_change():
    assert api.settled("ab\ufffd", ()) == "ab"  # the first bytes of a character
    assert api.settled("abc\n", ("\n\n",)) == "abc"  # may become the stop string
    assert api.settled("abc", ("xyz", "cd")) == "ab"
    assert api.settled("abc", ("xyz",)) == "abc"


def test_top_logprobs_keep_distinct_tokens_apart_writing_bytes_as_openai_does():
    c3, a9 = "é".encode()  # the byte tokenizer's ids 0xC3 and 0xA9 both decode to U+FFFD alone
    entries = [(-0.1, [(c3, -0.1), (a9, -2.0), (ord("A"), -3.0)])]
    lp = protocol.completion_logprobs(TOK, entries + [(-0.2, [])], [c3, a9])
    assert lp["tokens"] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert lp["top_logprobs"][0] == {"bytes:\\xc3": -0.1, "bytes:\\xa9": -2.0, "A": -3.0}  # three entries, not two
    assert lp["text_offset"] == [0, 1]  # offsets count the decoded text, not the keys
    chat = protocol.chat_logprobs(TOK, entries, [c3])["content"][0]
    assert (chat["token"], chat["bytes"]) == ("bytes:\\xc3", [0xC3])
    assert [(t["token"], t["bytes"]) for t in chat["top_logprobs"]] == [
        ("bytes:\\xc3", [0xC3]), ("bytes:\\xa9", [0xA9]), ("A", [0x41])]


@pytest.mark.child_process
def test_one_host_of_a_multi_host_slice_is_refused_before_the_runtime_starts(tmp_path, monkeypatch):
    """On one host of a v4-16 (2 hosts) the runtime's start would wait for the other host forever:
    serve reads the slice's size from its type first and exits 2 with one line, the runtime not started
    (init_runtime prints nothing). The folder need not exist: nothing is read."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("ACCELERATOR_TYPE", "v4-16")  # the child inherits this process's environment
    out = subprocess.run(SERVE + [str(tmp_path / "none"), "--port", "0"], capture_output=True, text=True, timeout=300)
    assert one_error_line(out.returncode, out.stderr, "v4-16 is a slice of 2 hosts and serve runs on one host"), \
        out.stderr[-2000:]
    assert "Serve from a single-host slice (v4-8, v5p-8, v5litepod-8, v6e-8)" in out.stderr and out.stdout == ""


def test_load_engine_refuses_a_multi_host_slice_before_the_runtime_starts(model_dir, monkeypatch):
    monkeypatch.setenv("ACCELERATOR_TYPE", "v5litepod-16")
    monkeypatch.setattr(serve, "init_runtime", lambda *a, **k: pytest.fail("the runtime started"))
    with pytest.raises(ValueError, match="v5litepod-16 is a slice of 4 hosts and serve runs on one host"):
        serve.load_engine(model_dir)

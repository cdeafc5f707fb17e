"""`jaxnn serve` as a client meets it: a server process on a free loopback port, driven with the official openai
client (and raw HTTP for the requests that client would refuse to send): completions, chat, streaming, 16
concurrent greedy requests equal to `generate_batch`, a stream closed early, every bad request (4xx, the server
alive afterwards), a full queue (503 with Retry-After), and SIGTERM draining the request in flight."""

import concurrent.futures
import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from serve_models import save_served_folder  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("serve")]


class Server:
    def __init__(self, folder: pathlib.Path, *flags: str):
        argv = [sys.executable, "-m", "jaxnn.cli", "serve", str(folder), "--port", "0", "--name", "tiny", *flags]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.time() + 180
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            self.log.append(line)
            found = re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", line)
            if found:
                self.url = f"http://127.0.0.1:{found.group(1)}"
                # the log read on, so that the server never waits on a full pipe
                threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
                break
            if not line and self.proc.poll() is not None:
                raise AssertionError("the server exited:\n" + "".join(self.log))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body: bytes | dict) -> tuple[int, object, dict]:
        """(status, headers (read without regard to case), JSON body) of a raw POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, reply.headers, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, err.headers, json.loads(err.read())

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as reply:
            return json.loads(reply.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_served_folder(tmp_path_factory.mktemp("served") / "gpt")


@pytest.fixture(scope="module")
def server(folder):
    server = Server(folder, "--slots", "4")
    yield server
    assert server.stop() == 0


def _reference(folder, prompts, max_tokens):
    """generate_batch's greedy tokens for `prompts`, cut after the end token, as the server's tokenizer decodes them."""
    import jax

    from jaxnn.generate import generate_batch
    from jaxnn.interop.hf import load_hf
    from jaxnn.interop.tokenizer import load_tokenizer
    from jaxnn.models import GPT

    cfg, params = load_hf(folder)
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    out = generate_batch(GPT(cfg), jax.tree.map(np.asarray, params), prompts, max_tokens, stop_tokens=eos)
    tok = load_tokenizer(folder / "tokenizer.json")
    texts = []
    for row, n in zip(out.tokens, out.lengths):
        ids = [int(t) for t in row[:n] if int(t) != eos]
        texts.append(tok.decode(ids, skip_special_tokens=True))
    return texts, [int(n) for n in out.lengths]


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert server.health()["status"] == "ok"


def test_sixteen_concurrent_greedy_requests_equal_generate_batch(server, folder):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 300, size=int(n))] for n in rng.integers(1, 24, size=16)]
    want, lengths = _reference(folder, prompts, 20)

    def ask(prompt):
        return server.client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, prompts))
    assert [r.choices[0].text for r in replies] == want
    assert [r.usage.completion_tokens for r in replies] == lengths
    assert [r.usage.prompt_tokens for r in replies] == [len(p) for p in prompts]


def test_chat_and_its_stream_say_the_same(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat sat on"}]
    whole = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampling_with_a_seed_repeats_and_a_stop_string_cuts(server):
    ask = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 16, "temperature": 0.8, "seed": 3}
    first, again = (server.client.completions.create(**ask).choices[0].text for _ in range(2))
    assert first == again
    greedy = server.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    if len(text) > 4:
        cut = server.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=16,
                                               temperature=0, stop=[text[3:5]])  # fmt: skip
        assert cut.choices[0].text == text[: text.index(text[3:5])]
        assert cut.choices[0].finish_reason == "stop"


def test_a_stream_closed_early_frees_its_slot(server):
    stream = server.client.completions.create(model="tiny", prompt="a", max_tokens=100, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while server.health()["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert server.health()["running"] == 0


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400),
        ("/v1/completions", {"prompt": "a", "temperature": 3}, 400),
        ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400),
        ("/v1/completions", {"prompt": "a", "colour": "red"}, 400),
        ("/v1/completions", {"prompt": "a " * 200}, 400),  # longer than the 128-position window
        ("/v1/completions", {"prompt": [1, 99999]}, 400),
        ("/v1/completions", {"prompt": "a", "model": "other"}, 404),
        ("/v1/chat/completions", {"messages": "hello"}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 3}, 400),
        ("/v1/nothing", {}, 404),
    ],
)
def test_a_bad_request_is_refused_and_the_server_goes_on(server, path, body, status):
    code, _, reply = server.post(path, body)
    assert code == status
    assert set(reply["error"]) >= {"message", "type", "param"}
    assert server.client.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_a_full_queue_is_503_and_sigterm_drains_the_request_in_flight(folder):
    server = Server(folder, "--slots", "1", "--max-queue", "1")
    try:
        body = {"prompt": "a", "max_tokens": 100, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: server.post("/v1/completions", body), range(4)))
        codes = sorted(code for code, _, _ in replies)
        assert 200 in codes and 503 in codes, codes
        assert all(headers.get("Retry-After") for code, headers, _ in replies if code == 503)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(server.post, "/v1/completions", {**body, "max_tokens": 120})
            while server.health()["running"] == 0 and not in_flight.done():
                time.sleep(0.005)
            server.proc.send_signal(signal.SIGTERM)  # while it decodes, unless this tiny model was quicker
            code, _, reply = in_flight.result(timeout=120)
        assert code == 200 and reply["usage"]["completion_tokens"] >= 1
        assert reply["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.proc.wait(60) == 0
    finally:
        server.proc.kill()


def test_a_trained_run_is_served(tmp_path):
    # docs/serving.md's first commands: a `jaxnn train` GPT run (bytes, no tokenizer), served and asked
    from smoke_commands import TRAIN_TINY

    run = tmp_path / "runs" / "gpt"
    argv = [sys.executable, "-m", "jaxnn.cli", "train", "--model", "gpt", "--size", "small", "--seq-len", "32",
            "--run-dir", str(run), *TRAIN_TINY.split()]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    server = Server(run, "--warm-up", "8")
    try:
        reply = server.client.completions.create(model="tiny", prompt="def ", max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5 and reply.usage.prompt_tokens == 4
        assert server.client.models.list().data[0].max_model_len == 32
    finally:
        assert server.stop() == 0


def test_a_peft_adapter_folder_is_served_with_peft_greedy_tokens(folder, tmp_path):
    # the reverse hand-off: adapters PEFT wrote, on the base folder they were trained on, answer as PeftModel does
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    from jaxnn.interop.tokenizer import load_tokenizer

    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False)
    tuned = peft.get_peft_model(base, config).eval()
    tuned.save_pretrained(tmp_path / "adapters")
    prompt = [5, 17, 99, 42, 7]
    with torch.no_grad():
        out = tuned.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = base.config.eos_token_id
    want = [int(t) for t in out[0, len(prompt) :] if int(t) != eos]
    server = Server(folder, "--adapters", str(tmp_path / "adapters"))
    try:
        reply = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    finally:
        assert server.stop() == 0
    assert reply.choices[0].text == load_tokenizer(folder / "tokenizer.json").decode(want, skip_special_tokens=True)

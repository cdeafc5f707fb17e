"""jaxnn.serve in process: continuous batching changes no request's tokens (against `generate_batch`), per-row
sampling draws what `generate` draws, chat templates render as transformers renders them, and the API's checks
refuse what they must. The HTTP server itself, driven by the openai client: tests/system/test_serve_http.py."""

import threading
import time

import jax
import numpy as np
import pytest

from jaxnn.errors import ServerBusyError
from jaxnn.generate import generate_batch
from jaxnn.layers import init_model
from jaxnn.models import GPT
from jaxnn.models.gpt import GPTConfig
from jaxnn.serve import Engine, Request
from jaxnn.serve.requests import BadRequest, chat_messages, check_body, completion_prompts, sampling


def _model(position: str):
    cfg = GPTConfig(vocab_size=64, seq_len=64, d_model=32, num_layers=2, num_heads=4, position=position)
    model = GPT(cfg)
    return model, init_model(model, jax.random.key(0), (1, 8))[1]


def _serve_all(engine: Engine, requests: list[dict], stagger: float = 0.0) -> list[list[int]]:
    """Submits every request (a few at a time when `stagger`), and waits for each one's tokens."""
    outs: list[list[int]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def collect(i):
        def on_token(token, finish):
            outs[i].append(token)
            if finish is not None:
                done[i].set()

        return on_token

    for i, r in enumerate(requests):
        engine.submit(Request(on_token=collect(i), **r))
        time.sleep(stagger * (i % 3))
    for d in done:
        assert d.wait(120)
    return outs


# The fast tier's greedy equality under staggered joins: test_warm_up_compiles_every_program_...; this one also
# runs stop tokens and limits of 1-29 tokens (make test-all).
@pytest.mark.slow
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_continuous_batching_equals_generate_batch(position):
    # 12 prompts of 1-19 tokens over 4 slots, joining while others decode: each row's greedy tokens (stop token
    # included) are generate_batch's for the same prompts.
    model, params = _model(position)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 64, size=int(n))] for n in rng.integers(1, 20, size=12)]
    limits = [int(x) for x in rng.integers(1, 30, size=12)]
    want = generate_batch(model, params, prompts, limits, stop_tokens=5)
    engine = Engine(model, params, context=64, slots=4, max_prefill=3).start()
    try:
        requests = [{"prompt": p, "max_tokens": m, "stop_ids": frozenset({5})} for p, m in zip(prompts, limits)]
        got = _serve_all(engine, requests, stagger=0.01)
    finally:
        engine.stop()
    for i, tokens in enumerate(got):
        assert tokens == list(want.tokens[i, : want.lengths[i]]), i


@pytest.mark.slow
def test_seeded_sampling_draws_what_generate_draws():
    model, params = _model("rope")
    prompt = [3, 9, 27, 17]
    settings = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    want = generate_batch(model, params, [prompt], 12, key=7, **settings)
    engine = Engine(model, params, context=64, slots=2).start()
    try:
        # two more requests share the batch, so the seeded one is not alone in its prefill or its decode steps
        others = [{"prompt": [1, 2], "max_tokens": 12, "temperature": 1.0, "seed": 1}] * 2
        got = _serve_all(engine, [{"prompt": prompt, "max_tokens": 12, "seed": 7, **settings}, *others])
    finally:
        engine.stop()
    assert got[0] == list(want.tokens[0])


@pytest.mark.slow
def test_warm_up_compiles_every_program_requests_of_those_lengths_use():
    # After warm_up(every_width(16)), prompts of 1-16 tokens joining in any grouping compile nothing more, and
    # their tokens are still generate_batch's.
    from jaxnn.serve.engine import every_width
    from jaxnn.serve.slots import decode, place, prefill

    model, params = _model("rope")
    engine = Engine(model, params, context=64, slots=4, max_prefill=2)
    assert every_width(20) == [8, 16, 20] and every_width(16) == [8, 16]
    engine.warm_up(every_width(16))
    compiled = [f._cache_size() for f in (prefill, place, decode)]
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 64, size=int(n))] for n in rng.integers(1, 17, size=9)]
    want = generate_batch(model, params, prompts, 6)
    engine.start()
    try:
        got = _serve_all(engine, [{"prompt": p, "max_tokens": 6} for p in prompts], stagger=0.01)
    finally:
        engine.stop()
    assert [f._cache_size() for f in (prefill, place, decode)] == compiled
    assert got == [list(row) for row in want.tokens]
    with pytest.raises(RuntimeError, match="before start"):
        engine.warm_up([4])


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "--warm-up must be a positive integer"), ("128", "--warm-up 128: prompts must leave room")],
)
def test_serve_refuses_a_warm_up_outside_the_context(tmp_path, capsys, value, message):
    from serve_models import save_served_folder

    from jaxnn.cli import main

    folder = save_served_folder(tmp_path / "model", n_positions=128)
    assert main(["serve", str(folder), "--port", "0", "--compile-cache", "off", "--warm-up", value]) == 2
    assert message in capsys.readouterr().err


def test_engine_refuses_what_cannot_fit_and_a_full_queue():
    model, params = _model("learned")
    engine = Engine(model, params, context=16, slots=1, max_queue=1)  # not started: requests stay queued
    with pytest.raises(ValueError, match="exceed the context of 16"):
        engine.submit(Request([1] * 10, 7, lambda t, f: None))
    engine.submit(Request([1], 4, lambda t, f: None))
    with pytest.raises(ServerBusyError):
        engine.submit(Request([1], 4, lambda t, f: None))


@pytest.mark.slow
def test_a_cancelled_request_frees_its_slot():
    model, params = _model("rope")
    engine = Engine(model, params, context=64, slots=1).start()
    try:
        first = Request([1, 2, 3], 60, lambda t, f: engine.cancel(first))
        engine.submit(first)
        # the one slot is freed after the first token, so the second request runs to its end
        assert _serve_all(engine, [{"prompt": [4, 5], "max_tokens": 3}])[0].__len__() == 3
    finally:
        engine.stop()
    assert engine.load() == {"running": 0, "waiting": 0}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": 0}, "top_k"),
        ({"prompt": "x", "seed": 2**32}, "seed"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "colour": "red"}, "colour"),
    ],
)
def test_bad_sampling_fields_name_the_field(body, param):
    from jaxnn.serve.requests import COMPLETION_FIELDS

    with pytest.raises(BadRequest) as err:
        sampling(check_body(body, COMPLETION_FIELDS))
    assert err.value.param == param and err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_prompts_and_messages_are_read_in_every_form_the_api_allows():
    assert completion_prompts({"prompt": "hi"}) == ["hi"]
    assert completion_prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert completion_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert completion_prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]
    for bad in ({"prompt": []}, {"prompt": [1, "a"]}, {"prompt": None}, {}):
        with pytest.raises(BadRequest):
            completion_prompts(bad)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert chat_messages(parts) == [{"role": "user", "content": "ab"}]
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user"}]}):
        with pytest.raises(BadRequest):
            chat_messages(bad)


def test_chat_ids_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    from serve_models import save_served_folder

    from jaxnn.serve.text import Codec

    folder = save_served_folder(tmp_path / "gpt")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "the cat sat?"},
        {"role": "assistant", "content": "on the mat"},
        {"role": "user", "content": "café, crème brûlée"},
    ]
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert Codec.from_folder(folder).encode_chat(messages) == list(want)


def test_streamed_text_waits_for_a_split_character():
    from jaxnn.serve.text import IncrementalDecoder

    decoder = IncrementalDecoder()
    encoded = "é!".encode()
    assert decoder.add([encoded[0]]) == ""
    assert decoder.add([encoded[1]]) == "é"
    assert decoder.add([encoded[2]], final=True) == "!"

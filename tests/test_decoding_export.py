"""The exported decoder (prefill and step programs, weights as safetensors) generates, in a process where jaxnn
cannot be imported, the same greedy tokens as `jaxnn.generate.generate_batch`, for a ragged batch and a stop byte."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxnn._src.ownership import RunDirError
from jaxnn.decoding_export import write_decoding_export
from jaxnn.generate import generate_batch
from jaxnn.models import GPT, GPTConfig

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "generate_exported.py"
# The example, run with jaxnn made unimportable: what a consumer of the export has is jax, numpy and safetensors.
RUN_WITHOUT_JAXNN = """
import runpy, sys
sys.modules["jaxnn"] = None  # any import of jaxnn now fails
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.system
def test_exported_decoder_generates_jaxnns_greedy_tokens_without_jaxnn(tmp_path):
    model = GPT(GPTConfig(seq_len=24, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2))
    _, params = model.init(jax.random.key(0), (1, 8))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(treedef, [a + 0.3 * jax.random.normal(k, a.shape) for k, a in zip(keys, leaves)])
    out = write_decoding_export(tmp_path / "decoder", model, params, prompt_len=8, cache_len=24)
    info = json.loads((out / "decoding.json").read_text())
    keys = {c["name"]: c["shape"] for c in info["cache"]}
    assert keys["2_block.0_attn.1_attention.k"] == ["b", 24, 2, 8] and info["vocab_size"] == 256
    with pytest.raises(RunDirError, match=r"holds the export of another checkpoint"):
        write_decoding_export(out, model, params, prompt_len=8, cache_len=24, config={"model": "gpt"})

    prompts = [b"def f(", b"x", b"return"]
    plain = generate_batch(model, params, [list(p) for p in prompts], 16)  # bucketed: 8 prompt slots, 16 new
    stop = int(plain.tokens[0, 3])  # row 0 stops at its fourth new byte or earlier; the others may run on
    want = generate_batch(model, params, [list(p) for p in prompts], 16, stop_tokens=stop)
    assert want.lengths[0] <= 4 and want.tokens[0, want.lengths[0] - 1] == stop
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    argv = [str(EXAMPLE), str(out), *(p.decode() for p in prompts), "--new-tokens", "16"]
    argv += ["--stop", chr(stop).encode("unicode_escape").decode(), "--json", str(tmp_path / "tokens.json")]
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_JAXNN, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "tokens.json").read_text())
    assert [len(row) for row in got] == list(want.lengths)
    for row, tokens, n in zip(got, want.tokens, want.lengths):
        np.testing.assert_array_equal(row, tokens[:n])

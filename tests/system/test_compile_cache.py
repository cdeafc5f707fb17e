"""The persistent compilation cache: where it goes, how it is turned off, and that a second run reuses it."""

import json
import os
import subprocess
import sys

import pytest

from jaxnn import cli
from jaxnn._src import compile_cache
from jaxnn.cli.train import config_from_args
from jaxnn.config import ConfigError, FitConfig

# One tiny `jaxnn.fit` run in a fresh process; prints the cache hits and misses jax reported.
FIT_RUN = """
import json, sys
import jax, numpy as np
from jax import monitoring
import jaxnn
from jaxnn.models import MLP, MLPConfig

events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
jaxnn.fit(MLP(MLPConfig(hidden=(8,), num_classes=2)), (x, y), steps=2, batch_size=8, progress=False, plots=False,
          compile_cache=sys.argv[1])
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def test_resolve_reads_the_setting_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve("auto") == str(tmp_path / "jaxnn" / "xla")
    assert compile_cache.resolve(str(tmp_path / "c")) == str(tmp_path / "c")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve("auto") == str(tmp_path / "env")
    for off in ("", "off", "OFF", "0", "none"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.resolve("auto") is None
    assert compile_cache.resolve("off") is None


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="compile_cache"):
        FitConfig(compile_cache="")
    with pytest.raises(compile_cache.CompileCacheError, match="compile_cache"):
        compile_cache.resolve(None)


def test_an_unusable_directory_is_refused_by_name(tmp_path, monkeypatch):
    # As in a process where jax has no cache directory yet (this session's is set by tests/conftest.py).
    monkeypatch.setattr(compile_cache, "_jax_option", lambda name: None)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(compile_cache.CompileCacheError, match="file"):
        compile_cache.enable(str(blocker / "xla"))


def test_cli_flags_set_the_cache(tmp_path):
    parse = cli.build_parser().parse_args
    base = ["train", "--run-dir", str(tmp_path / "run")]
    assert config_from_args(parse(base)).fit.compile_cache == "auto"
    assert config_from_args(parse([*base, "--no-compile-cache"])).fit.compile_cache == "off"
    assert config_from_args(parse([*base, "--compile-cache", "/x"])).fit.compile_cache == "/x"


def test_fit_writes_the_cache_and_a_second_run_reuses_it(tmp_path):
    cache = tmp_path / "xla"
    # Not the session's own cache (tests/conftest.py): this run must start with nothing cached.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", compile_cache.ENV)}
    env = {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}

    def run() -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", FIT_RUN, str(cache)], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = run()
    entries = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
    assert cold["misses"] > 0 and entries, (cold, entries)
    warm = run()
    assert warm["hits"] >= len(entries) and warm["misses"] == 0, (warm, len(entries))
    assert sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache")) == entries


# `jaxnn train` in a fresh process, as the command runs (host-memory settings on), with jax's cache events counted.
CLI_RUN = """
import json, sys
from jax import monitoring
from jaxnn.cli.main import main

events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
status = main(sys.argv[1:])
print(json.dumps({"status": status, "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


@pytest.mark.slow
def test_a_1024_token_gpt_step_is_cached_with_the_commands_host_memory_settings(tmp_path):
    # The step's scratch is several of XLA's 48 MB scratch blocks: split, XLA could not serialise it ("Multiple temp
    # buffer allocations found"), so the command keeps the scratch in one block for a short run with the cache on.
    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", compile_cache.ENV, "JAXNN_MALLOC")}
    env = {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env[compile_cache.ENV] = str(cache)

    def run(name: str) -> dict:
        flags = ["train", "--model", "gpt", "--size", "small", "--seq-len", "1024", "--steps", "1"]
        flags += ["--batch-size", "2", "--no-summary", "--run-dir", str(tmp_path / name)]
        proc = subprocess.run(
            [sys.executable, "-c", CLI_RUN, *flags], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Error writing persistent compilation cache" not in proc.stderr, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = run("cold")
    steps = [p.name for p in cache.iterdir() if p.name.startswith("jit_step") and p.name.endswith("-cache")]
    assert cold["misses"] > 0 and steps, cold
    warm = run("warm")
    assert warm["status"] == 0 and warm["misses"] == 0 and warm["hits"] >= cold["misses"], (cold, warm)

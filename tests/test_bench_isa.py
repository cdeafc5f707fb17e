"""Capped benchmark runs (benchmarks/isa.py): the cap reaches every peer's child process and its labels, and the
oneDNN calibration keeps one cache file per cap. No benchmark is timed here."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import benchmarks.peers.__main__ as peers
from benchmarks import isa
from jaxnn.kernels.onednn import choice

AVX2_SWITCHES = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

# A stand-in for each peer module: writes, as its one row, the environment it was started with.
ECHO_ENV = (
    "import json, os, sys; out = sys.argv[sys.argv.index('--out') + 1]; "
    "json.dump({'library': sys.argv[2], 'rows': [{'env': dict(os.environ)}]}, open(out, 'w'))"
)


def test_every_peer_process_starts_with_every_librarys_cap(monkeypatch):
    real_run = subprocess.run
    started, under_gdb = [], set()

    def run_echo(cmd, **kwargs):
        if "--args" in cmd:  # a capped child starts inside gdb, which holds YNNPACK to AVX2 (capped_command)
            assert cmd[cmd.index("-x") + 1] == isa.YNN_SCRIPT
            cmd = cmd[cmd.index("--args") + 1 :]
            under_gdb.add(cmd[2])
        started.append(cmd[2])
        return real_run([sys.executable, "-c", ECHO_ENV, *cmd[2:]], **kwargs)

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setattr(peers.subprocess, "run", run_echo)
    for library in peers.PEERS:
        (row,) = peers.run_peer(library, ["tiny"], ["fp32"], 1, "avx2")["rows"]
        env = row["env"]
        assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", "--xla_cpu_max_isa=AVX2"]
        assert {k: env[k] for k in AVX2_SWITCHES} == AVX2_SWITCHES
        (native,) = peers.run_peer(library, ["tiny"], ["fp32"], 1)["rows"]
        assert "xla_cpu_max_isa" not in native["env"]["XLA_FLAGS"]
        assert not AVX2_SWITCHES.keys() & native["env"].keys()
    assert started == [f"benchmarks.peers.{m}" for m in peers.PEERS.values() for _ in range(2)]
    # Where gdb is installed, every capped process that runs XLA starts under it; PyTorch's never does.
    xla_peers = {f"benchmarks.peers.{m}" for name, m in peers.PEERS.items() if name not in peers.NO_XLA_PEERS}
    assert under_gdb == (xla_peers if shutil.which("gdb") else set())


def test_a_capped_command_runs_inside_gdb_where_gdb_is_installed(monkeypatch):
    argv = [sys.executable, "-c", "print(1)"]
    assert isa.capped_command("native", argv) == argv
    monkeypatch.setattr(isa.shutil, "which", lambda name: None)
    assert isa.capped_command("avx2", argv) == argv and isa.cap_label("avx2") == "capped to AVX2 (not YNNPACK: no gdb)"
    monkeypatch.setattr(isa.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert isa.capped_command("avx2", argv) == [
        "/usr/bin/gdb", "-q", "-batch", "-iex", "set auto-load off", "-return-child-result", "-x", isa.YNN_SCRIPT,
        "--args", *argv,
    ]  # fmt: skip
    assert isa.cap_label("avx2") == "capped to AVX2"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb holds YNNPACK to AVX2")
def test_a_bf16_product_under_gdb_gives_its_value_and_exit_status():
    # The script stops at YNNPACK's first feature query; the program must run on to its own end and status.
    probe = (
        "import sys, jax.numpy as jnp; a = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) % 7; "
        "p = jnp.dot(a.astype(jnp.bfloat16), a.astype(jnp.bfloat16), preferred_element_type=jnp.float32); "
        "print('SUM', float(p.sum())); sys.exit(3)"
    )
    out = subprocess.run(
        isa.capped_command("avx2", [sys.executable, "-c", probe]),
        env=isa.capped_env("avx2"),
        capture_output=True,
        text=True,
    )
    a = np.arange(64 * 64).reshape(64, 64) % 7
    assert out.returncode == 3, out.stderr[-2000:]
    assert f"SUM {float((a @ a).sum())}" in out.stdout


def test_capped_env_replaces_an_earlier_cap_and_native_removes_every_cap():
    base = {"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2 --xla_backend_optimization_level=0", "DNNL_MAX_CPU_ISA": "SSE41"}
    capped = isa.capped_env("avx2", base)
    assert capped["XLA_FLAGS"] == "--xla_backend_optimization_level=0 --xla_cpu_max_isa=AVX2"
    assert "DNNL_MAX_CPU_ISA" not in capped and capped[isa.ENV_CAP] == "avx2"
    assert isa.capped_env("native", capped) == {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
    assert isa.capped_env("native", {"ONEDNN_MAX_CPU_ISA": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}) == {}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is in the bench extra")
def test_pytorch_started_with_the_cap_dispatches_to_avx2_kernels():
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=isa.capped_env("avx2"), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "AVX2"


def test_a_capped_table_and_json_say_capped(monkeypatch, tmp_path, capsys):
    def fake_run_peer(library, models, precisions, repeats, cap):
        assert cap == "avx2"
        return {
            "library": library,
            "rows": [{"library": library, "model": "tiny", "precision": "fp32", "step_ms": 2.0}],
        }

    monkeypatch.setattr(peers, "run_peer", fake_run_peer)
    path = tmp_path / "capped.json"
    peers.main(["--isa", "avx2", "--peers", "jaxnn", "pytorch", "--models", "tiny", "--precisions", "fp32",
                "--json", str(path)])  # fmt: skip
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("CAPPED TO AVX2 (XLA, oneDNN and PyTorch alike)")
    assert "capped to AVX2, 20" in out  # the "measured on" line: CPU, then the cap, then the date
    record = json.loads(path.read_text())
    assert (record["isa"], record["capped"]) == ("avx2", "capped to AVX2")
    assert record["cpu"].endswith(", capped to AVX2")
    assert [r["step_ms"] for r in record["median_ms"]] == [2.0, 2.0]


def test_the_onednn_calibration_cache_is_keyed_by_the_cap(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in ("XLA_FLAGS", *choice.ONEDNN_ISA_ENV):
        monkeypatch.delenv(name, raising=False)
    assert choice.isa_caps() == {}
    native = choice.cache_path("3.7")
    for name, value in isa.capped_env("avx2", {}).items():
        monkeypatch.setenv(name, value)
    assert choice.isa_caps() == {"xla": "AVX2", "onednn": "AVX2"}
    capped = choice.cache_path("3.7")
    assert capped != native and capped.startswith(str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2 --xla_cpu_max_isa=avx512")
    assert choice.isa_caps()["xla"] == "AVX512"
    assert choice.cache_path("3.7") not in (native, capped)

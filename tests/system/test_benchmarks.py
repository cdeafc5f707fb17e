"""The benchmark commands run end to end at their smallest sizes and write what they promise.

These check that `make bench`, `make bench-peers`, `make bench-input` and `make bench-parallel` keep working; they
time nothing against a target (speed targets live in the benchmarks themselves, never in timed tests).
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, devices: int | None = None) -> str:
    """Runs `python -m module args` from the checkout in a fresh process, returns its stdout; fails with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_make_bench_quick_reports_both_variants_and_the_peaks(tmp_path):
    out = tmp_path / "bench.json"
    text = run_module("benchmarks.train_steps", "--quick", "--models", "tiny", "--json", str(out))
    assert "tiny   fp32" in text and "tiny   bf16" in text
    record = json.loads(out.read_text())
    assert record["platform"] == "cpu" and all(peak["gflops"] > 0 for peak in record["peaks"].values())
    rows = {row["precision"]: row for row in record["rows"]}
    assert set(rows) == {"fp32", "bf16"}
    for row in rows.values():
        assert row["model"] == "tiny" and row["step_ms"] > 0 and row["scan_step_ms"] > 0 and row["scan_k"] > 1
        assert row["flops_per_step"] > 0 and row["fraction_of_peak"] > 0


def test_bench_peers_times_jaxnn_with_and_without_metrics(tmp_path):
    out = tmp_path / "peers.json"
    text = run_module(
        "benchmarks.peers",
        "--peers",
        "jaxnn",
        "jaxnn_metrics",
        "--models",
        "tiny",
        "--precisions",
        "fp32",
        "--repeats",
        "2",
        "--json",
        str(out),
    )
    assert "jaxnn_metrics" in text.splitlines()[1]
    medians = {row["library"]: row["step_ms"] for row in json.loads(out.read_text())["median_ms"]}
    assert set(medians) == {"jaxnn", "jaxnn_metrics"} and all(ms > 0 for ms in medians.values())


def test_bench_input_pins_the_device_core_and_reports_idle_fractions(tmp_path):
    out = tmp_path / "input.json"
    args = ["--steps", "2", "--repeats", "1", "--batch-size", "8", "--fractions", "0.5", "--out", str(out)]
    run_module("benchmarks.input_pipeline", *args)
    record = json.loads(out.read_text())
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2:
        assert record["pinning"].startswith("XLA pinned to core")
    assert {row["kind"] for row in record["rows"]} == {"numpy", "sleep"}
    for row in record["rows"]:
        assert row["host_s"] > 0 and row["step_s"] > 0
        for mode in ("off", "on"):
            assert 0.0 <= row[mode]["idle_frac"] < 1.0 and row[mode]["wall_s"] > 0
    assert len(record["backends"]) == 5 and all(s > 0 for s in record["backends"].values())


def test_bench_input_capacity_sets_host_rates_against_the_projected_step_rate(tmp_path):
    out = tmp_path / "capacity.json"
    args = ["--capacity", "--workloads", "mlp", "--batches", "3", "--repeats", "1", "--out", str(out)]
    text = run_module("benchmarks.input_pipeline", *args, "--backends", "inline", "grain threads=1")
    assert "PROJECTED" in text
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["backends"]) == {"inline", "grain threads=1"} and row["best_per_core"] > 0
    assert row["step_flops"] > 0 and row["h200_steps_per_s"] > 0 and row["cores_needed"] > 0


def test_bench_parallel_times_every_form_on_each_device_count(tmp_path):
    out = tmp_path / "parallel.jsonl"
    run_module(
        "benchmarks.data_parallel",
        "--devices",
        "1",
        "2",
        "--repeats",
        "2",
        "--global-batch",
        "16",
        "--json",
        str(out),
        devices=2,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert {(r["form"], r["devices"]) for r in rows} == {(f, n) for f in ("jit", "shard_map", "pmap") for n in (1, 2)}
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["efficiency"] == 1.0 for r in rows if r["devices"] == 1)


def test_bench_attention_times_each_block_count_against_jax_xla(tmp_path):
    out = tmp_path / "attention.json"
    text = run_module("benchmarks.attention_cpu", "--shapes", "1x64x2x8", "--blocks", "1", "2", "--repeats", "1",
                      "--json", str(out))  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert {"xla", "blocked:1", "blocked:2"} <= set(row["ms"])
    assert row["default_blocks"] == 2 and all(ms > 0 for ms in row["ms"].values())
    assert "1x64x2x8" in text

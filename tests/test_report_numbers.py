"""The numbers REPORT.md and the benchmarks print: peaks no rate of their run exceeds, no speed-up over one device
count, committed results never replaced unless asked, plots whose coinciding curves stay distinguishable, and
parameter counts in a unit that keeps them readable. Synthetic records; no experiment is run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import train_steps
from experiments import common, exp_matmul, exp_parallel, report, roofline
from experiments.common import params_label
from experiments.peaks import ceiling

REPO = Path(__file__).resolve().parents[1]


def _mm_record(peak: float, rates: dict[tuple[str, int], float]) -> dict:
    rows = [
        {"backend": "cpu", "dtype": d, "n": n, "gflops": g, "median": 2 * n**3 / g / 1e9} for (d, n), g in rates.items()
    ]
    return {"rows": rows, "peaks": {"cpu": {"gflops": peak, "size": 2048}}}


def test_a_rate_above_the_peak_measurement_raises_the_peak_and_says_which():
    # The committed EPYC run: a 2048^3 peak of 233 GFLOP/s beside a 1024^3 bf16 product at 364.
    record = _mm_record(233.0, {("bf16", 512): 300.0, ("bf16", 1024): 364.0, ("f32", 1024): 400.0})
    top = exp_matmul.bf16_ceilings(record)["cpu"]
    assert top.gflops == max(r["gflops"] for r in record["rows"] if r["dtype"] == "bf16") == 364.0
    assert top.note == "raised to the n=1024 product's 364 GFLOP/s (the peak measurement read 233)"
    # An fp32 rate never raises the bf16 peak, and a peak above every rate stays as measured, with no note.
    assert exp_matmul.bf16_ceilings(_mm_record(500.0, {("bf16", 1024): 364.0}))["cpu"].note == ""
    assert report._ceiling_cell(top) == "364 GFLOP/s (the n=1024 product; the peak measurement read 233)"
    assert ceiling(None, [("a", None)]) is None and ceiling(None, [("a", 3.0)]).gflops == 3.0


def test_make_bench_never_prints_a_step_above_100_percent_of_peak():
    peaks = {"fp32": {"gflops": 90.0, "size": 2048}, "bf16": {"gflops": 71.9, "size": 2048}}
    rows = [
        {"model": "gpt", "precision": "bf16", "gflops": 104.0},
        {"model": "cnn", "precision": "bf16", "gflops": 50.0},
        {"model": "gpt", "precision": "fp32", "gflops": 60.0},
    ]
    tops = train_steps._ceilings(peaks, rows)
    assert tops["bf16"].gflops == 104.0 and tops["fp32"].gflops == 90.0
    assert [round(r["gflops"] / tops[r["precision"]].gflops, 3) for r in rows] == [1.0, round(50 / 104, 3), 0.667]
    result = {
        "device": "cpu",
        "jax": "x",
        "peaks": peaks,
        "ceilings": {p: {"gflops": c.gflops, "note": c.note} for p, c in tops.items()},
        "rows": [],
    }
    text = train_steps.format_report(result)
    assert "bf16 peak raised to the gpt step's 104 GFLOP/s (the peak measurement read 72)." in text
    assert "fp32 peak raised" not in text


def _layer(name: str, seconds: float, flops: float) -> dict:
    return {"layer": name, "pass_": "forward+backward", "seconds": seconds, "flops": flops,
            "flops_per_s": flops / seconds, "intensity": 10.0, "bound": "compute"}  # fmt: skip


def test_the_roofline_divides_by_a_peak_no_layer_exceeds():
    peaks = {"matmul_flops": {"float32": 100e9, "bfloat16": 500e9}}
    profile = lambda policy, dtype, rate: {  # noqa: E731
        "policy": policy,
        "dtype": dtype,
        "peaks": peaks,
        "rows": [_layer("1_dense", 1.0, rate), _layer("2_dense", 1.0, rate / 2)],
        "whole": [],
    }
    record = {"profiles": [profile("fp32", "float32", 50e9), profile("bf16", "bfloat16", 515e9)]}
    tops = roofline.ceilings(record)
    assert tops["fp32"].gflops == 100.0 and tops["bf16"].gflops == 515.0
    table = "\n".join(roofline._measured_table({**record, "profiles": [
        {**p, "layer_sum_s": {"forward+backward": 2.0}} for p in record["profiles"]]}))  # fmt: skip
    percents = [int(c.strip().rstrip("%")) for c in table.split("|") if c.strip().endswith("%")]
    assert max(percents) == 100 and 50 in percents
    assert "bf16 % peak: the peak raised to 1_dense (forward+backward)'s 515 GFLOP/s" in table


def test_a_form_measured_on_one_device_count_has_no_speedup():
    rows = [
        {"form": "jit", "devices": 1, "samples_per_s": 100.0, "first_loss": 2.0},
        {"form": "jit", "devices": 8, "samples_per_s": 190.0, "first_loss": 2.0},
        {"form": "pmap", "devices": 1, "samples_per_s": 100.0, "first_loss": 2.0},
    ]
    record = {"rows": rows}
    assert exp_parallel.summary(record)["scaling"] == {"jit": {"devices": 8, "speedup": 1.9}}
    assert report._scaling_cell(record, "jit") == "1.90x (N=8)"
    assert report._scaling_cell(record, "pmap") == f"{report.NOT_MEASURED} (ran on 1 device only)"
    assert report._scaling_cell(record, "shard_map") is None


def test_the_roofline_section_never_says_no_gpu_run_beside_one():
    results = {"gpu-h200": {"exp_matmul": {}}, "cpu-x": {}}
    lines = "\n".join(roofline.section({**results, "cpu-x": {"roofline_cnn": None}}, REPO, REPO))
    assert "No GPU run yet" not in lines and "The GPU results (`gpu-h200`) hold no roofline run" in lines


def test_a_rerun_writes_beside_a_committed_results_file_and_the_report_reads_the_new_one(tmp_path, monkeypatch):
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "results/*/exp_matmul.json"], capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.skip("needs the git checkout and its committed results")
    committed = REPO / tracked[0]
    assert common.committed(committed) and not common.committed(tmp_path / "exp_matmul.json")
    before = committed.read_bytes()
    common.set_overwrite(False)
    local = common.output_path(committed)
    assert local == committed.with_name("exp_matmul-local.json")
    assert common.output_path(tmp_path / "exp_matmul.json") == tmp_path / "exp_matmul.json"
    common.set_overwrite(True)  # told to
    assert common.output_path(committed) == committed
    common.set_overwrite(False)
    # The report prefers the rerun: a -local record stands in for the committed one of its name.
    (tmp_path / "cpu-x").mkdir()
    (tmp_path / "cpu-x" / "exp_matmul.json").write_text(json.dumps({"name": "exp_matmul", "run": "committed"}))
    (tmp_path / "cpu-x" / "exp_matmul-local.json").write_text(json.dumps({"name": "exp_matmul", "run": "rerun"}))
    assert common.load_results(tmp_path)["cpu-x"]["exp_matmul"]["run"] == "rerun"
    assert committed.read_bytes() == before


def test_coinciding_curves_get_their_own_styles_and_a_note():
    styles = [common.curve_style(i, 100) for i in range(3)]
    assert len({(s["ls"], s["marker"]) for s in styles}) == 3
    assert len({s["markevery"][0] for s in styles}) == 3  # markers set off, so stacked curves show each one
    fp32 = [2.0, 1.0, 0.5]
    note = common.coincide_note({"fp32": fp32, "bf16": [2.01, 1.0, 0.505], "fp16": [2.0, 1.5, 0.5]})
    assert note == "bf16 lie within 1.0% of fp32 throughout"
    assert common.coincide_note({"fp32": fp32, "fp16": [3.0, 1.0, 0.5]}) is None


def test_parameter_counts_keep_their_figure():
    counts = [12, 8_123, 412_000, 1_300_000, 124_000_000, 7_000_000_000]
    assert [params_label(n) for n in counts] == ["12", "8.1k", "412k", "1.3M", "124M", "7B"]

"""The per-layer profile: XLA's FLOP counts against the analytic ones, the projection's arithmetic, `jaxnn profile`
end to end on a tiny model, and the training loop's profiler trace."""

import json

import numpy as np
import pytest

from jaxnn.layers import Conv, Dense, Relu, serial
from jaxnn.profile import MachinePeaks, ProfileError, profile_layers
from jaxnn.profile.measure import bound_of
from jaxnn.profile.projection import Accelerator, ProjectionError, accelerator

# Hand-set ceilings: these tests check counts and arithmetic, not speed, so nothing is measured for them.
PEAKS = MachinePeaks("test", {"float32": 1e11, "bfloat16": 2e11}, 1e10, 0, 0)


def rows(prof):
    return {(r.layer, r.pass_): r for r in prof.rows}


def test_dense_flops_are_the_analytic_count():
    b, n_in, n_mid, n_out = 4, 8, 16, 32
    prof = profile_layers(
        serial(Dense(n_mid), Dense(n_out)), (n_in,), batch_size=b, peaks=PEAKS, repeats=1, min_window_s=1e-3
    )
    r = rows(prof)
    # Forward: the product's 2*B*in*out plus one add per output for the bias.
    assert r["0_dense", "forward"].flops == 2 * b * n_in * n_mid + b * n_mid
    assert r["1_dense", "forward"].flops == 2 * b * n_mid * n_out + b * n_out
    # Backward: dW = x^T g and dx = g W^T are 2*B*in*out each; db sums B rows, which XLA counts as (B-1) adds per
    # output. The first layer needs no dx (its input is the data).
    assert r["0_dense", "forward+backward"].flops == 4 * b * n_in * n_mid + b * n_mid + (b - 1) * n_mid
    assert r["1_dense", "forward+backward"].flops == 6 * b * n_mid * n_out + b * n_out + (b - 1) * n_out


def test_conv_forward_flops_are_the_analytic_count():
    b, h, w, c_in, c_mid, c_out, k = 2, 6, 6, 3, 4, 5, 3
    model = serial(Conv(c_mid, k, padding="VALID"), Conv(c_out, k, padding="SAME"))
    r = rows(profile_layers(model, (h, w, c_in), batch_size=b, peaks=PEAKS, repeats=1, min_window_s=1e-3))
    # XLA counts every kernel tap at every output position, taps on SAME's zero padding included, plus the bias.
    ho, wo = h - k + 1, w - k + 1
    assert r["0_conv", "forward"].flops == 2 * b * ho * wo * c_mid * k * k * c_in + b * ho * wo * c_mid
    assert r["1_conv", "forward"].flops == 2 * b * ho * wo * c_out * k * k * c_mid + b * ho * wo * c_out


def test_rows_derive_from_time_flops_and_bytes():
    model = serial(Dense(64), Relu)
    prof = profile_layers(
        model, (32,), batch_size=8, policy="bf16", peaks=PEAKS, repeats=1, min_window_s=1e-3, accelerator=Accelerator()
    )
    assert prof.dtype == "bfloat16"
    assert [r.pass_ for r in prof.rows] == ["forward", "forward+backward"] * 2
    for r in (*prof.rows, *prof.whole):
        assert r.seconds > 0 and r.bytes > 0
        assert r.intensity == pytest.approx(r.flops / r.bytes)
        assert r.bandwidth_fraction == pytest.approx(r.bytes / r.seconds / PEAKS.bandwidth)
        assert r.peak_fraction == pytest.approx(r.flops / r.seconds / 2e11)
        assert r.bound == bound_of(r.intensity, PEAKS.ridge("bfloat16"), r.peak_fraction)
        bound = max(r.flops / 790e12, r.bytes / 4.3e12)
        assert r.projected_s == pytest.approx(bound) and r.speedup == pytest.approx(r.seconds / bound)
    assert prof.layer_sum("forward") == pytest.approx(sum(r.seconds for r in prof.rows if r.pass_ == "forward"))
    assert "whole model" in str(prof) and "projected (not measured)" in str(prof)


def test_bad_input_is_refused():
    with pytest.raises(ProfileError, match="in_shape"):
        profile_layers(Dense(2), (0, 3), peaks=PEAKS)
    with pytest.raises(ProfileError, match="batch_size"):
        profile_layers(Dense(2), (3,), batch_size=0, peaks=PEAKS)
    with pytest.raises(ProfileError, match="Layer"):
        profile_layers("dense", (3,), peaks=PEAKS)
    with pytest.raises(ProfileError, match="bandwidth"):
        MachinePeaks("test", {"float32": 1e11}, 0.0, 0, 0)
    with pytest.raises(ProjectionError, match="positive"):
        accelerator(bf16_tflops=0)
    with pytest.raises(ProjectionError, match="bandwidth"):
        Accelerator(bandwidth=-1.0)


def test_projection_uses_the_larger_of_compute_and_memory_time():
    a = accelerator(bf16_tflops=100, bandwidth_tbs=1)
    assert a.lower_bound(1e12, 1e9, "bfloat16") == pytest.approx(1e-2)  # compute: 1e12 / 1e14
    assert a.lower_bound(1e9, 1e12, "bfloat16") == pytest.approx(1.0)  # memory: 1e12 / 1e12
    assert a.peak("float32") == 67e12 and "given: bf16 100" in a.source


@pytest.mark.slow
def test_cli_profile_writes_table_json_and_plots(tmp_path, capsys):
    from jaxnn.cli import main

    out = tmp_path / "prof"
    argv = ["profile", "--model", "mlp", "--size", "small", "--batch-size", "4", "--repeats", "1"]
    argv += ["--matmul-size", "64", "--copy-mib", "1", "--precision", "fp32", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fwd+bwd" in text and "H200" in text
    saved = json.loads((out / "profile.json").read_text())
    assert [p["policy"] for p in saved] == ["fp32"]
    assert {"roofline.png", "layer_time.png"} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize(
    "flags", [["--model", "nope"], ["--peak-bf16", "-5"], ["--in-shape", "28,x"], ["--precision", "fp4"]]
)
def test_cli_profile_refuses_bad_input_before_writing(tmp_path, capsys, flags):
    from jaxnn.cli import main

    out = tmp_path / "prof"
    assert main(["profile", *flags, "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not out.exists()


def test_fit_profile_dir_writes_a_trace(tmp_path):
    import jaxnn
    from jaxnn.models import MLP, MLPConfig

    x = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
    y = np.arange(64) % 10
    trace = tmp_path / "trace"
    jaxnn.fit(
        MLP(MLPConfig().small()), (x, y), steps=6, batch_size=16, progress=False, plots=False, profile_dir=str(trace)
    )
    assert list(trace.glob("plugins/profile/*/*.xplane.pb"))
    assert list(trace.glob("plugins/profile/*/perfetto_trace.json.gz"))
    table = (trace / "kernel_table.txt").read_text()  # where the traced steps' time went, read from the trace
    assert table.startswith("cpu runtime:") and "by kind:" in table


def test_report_section_labels_projections_and_prefers_measured_gpu_peaks(tmp_path):
    from experiments import common, roofline

    prof = profile_layers(
        serial(Dense(8)), (4,), batch_size=2, peaks=PEAKS, repeats=1, min_window_s=1e-3, accelerator=Accelerator()
    )
    figures = {"model": "cnn", "profiles": [prof.as_dict()], "peaks": PEAKS.as_dict()}
    common.write_results(tmp_path, "roofline_cnn", "tiny", {**figures, "accelerator": Accelerator().as_dict()}, None)
    text = "\n".join(roofline.section(common.load_results(tmp_path), tmp_path, tmp_path))
    assert "projected, not measured" in text and "No GPU run yet" in text and "0_dense" in text
    assert roofline.projected_accelerator(tmp_path).peak("bfloat16") == 790e12  # no GPU results: the defaults
    gpu = {"name": "exp_matmul", "date": "2027-01-01", "peaks": {"gpu": {"gflops": 600e3}}}
    gpu["rows"] = [{"backend": "gpu", "dtype": "f32", "n": 8192, "gflops": 50e3}]
    (tmp_path / "gpu-h200").mkdir()
    (tmp_path / "gpu-h200" / "exp_matmul.json").write_text(json.dumps(gpu))
    measured = roofline.projected_accelerator(tmp_path)
    assert measured.peak("bfloat16") == pytest.approx(600e12) and measured.peak("float32") == pytest.approx(50e12)
    assert "measured in results/gpu-h200/" in measured.source


def test_plots_without_matplotlib_name_the_extra(tmp_path, monkeypatch):
    import sys

    from jaxnn.profile.plots import roofline_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails, as when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'jaxnn\[plots\]'"):
        roofline_png([], tmp_path / "roofline.png")


def test_the_bound_follows_intensity_against_the_roof_the_bytes_come_from():
    peaks = MachinePeaks("test", {"float32": 1e11}, 1e9, 0, 0, cache_bandwidth=5e10, cache_mib=4)
    assert peaks.ridge("float32") == 100 and peaks.ridge_for("float32", 8 * 2**20) == 2  # fits: the caches' roof
    assert peaks.ridge_for("float32", 9 * 2**20) == 100
    assert bound_of(3.0, peaks.ridge_for("float32", 2**20), 0.1) == "compute"
    assert bound_of(3.0, peaks.ridge("float32"), 0.1) == "memory"
    # A bandwidth measured low cannot call a program that runs at the compute roof memory-bound.
    assert bound_of(3.0, peaks.ridge("float32"), 0.6) == "compute"
    assert bound_of(None, 1.0, 0.9) is None


@pytest.mark.slow
def test_on_a_busy_machine_the_cnns_convolutions_are_compute_bound(tmp_path):
    """With another process spinning on a core, `jaxnn profile` (in its own process, with XLA's usual flags: the
    suite's unoptimised backend would slow the measured copies) says so, and the CNN's convolutions, at the 8x8
    digits `jaxnn train` trains on by default, are compute-bound. The first one, on 1 input channel, does about
    one FLOP per byte it moves and is left out: memory-bound on any machine."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = ["profile", "--model", "cnn", "--precision", "fp32", "--batch-size", "32", "--matmul-size", "1024",
            "--copy-mib", "128", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        done = subprocess.run([sys.executable, "-m", "jaxnn.cli", *argv], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    finally:
        busy.kill()
    assert done.returncode == 0, done.stderr
    (prof,) = json.loads((tmp_path / "profile.json").read_text())
    assert prof["in_shape"] == [32, 8, 8, 1]
    convs = [r for r in prof["rows"] if r["layer"].endswith("_conv") and not r["layer"].startswith("0_")]
    assert len(convs) == 4 and all(r["bound"] == "compute" for r in convs), [
        (r["layer"], r["intensity"]) for r in convs
    ]
    assert "note: the machine is busy" in done.stdout or os.getloadavg()[0] <= 1.5

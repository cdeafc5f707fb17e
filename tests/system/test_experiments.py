"""Experiments: the machine tag, the HLO library-call reader, the float64 references, every experiment's code path
(through `gpu_check --dry-run` at tiny sizes), and the report builder on a fixture of results files."""

import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from experiments import common, exp_inference, exp_matmul, exp_parallel, exp_precision, gpu_check, report
from jaxnn._src.optional import installed
from jaxnn.models import MLP
from jaxnn.profile.timing import time_fn
from jaxnn.train.data_parallel import FORMS

EXPERIMENTS = [
    "exp_matmul",
    "exp_precision",
    "exp_sequential",
    "exp_pipeline",
    "exp_inference",
    "exp_parallel",
    "exp_train",
]


# ----------------------------------------------------------------------------------------------- helpers


def test_cpu_tag_names_model_cores_and_units():
    tag = common.cpu_tag()
    assert re.fullmatch(r"cpu-[a-z0-9-]+-\d+core(-avx512|-avx2)?(-bf16)?(-amx)?(-arm64)?", tag), tag
    assert f"-{common.cpu_cores()}core" in tag and common.cpu_model_slug(common.cpu_model()) in tag
    assert ("avx512" in tag) == ("avx512f" in common.cpu_flags())
    assert ("-bf16" in tag) == ("avx512_bf16" in common.cpu_flags())
    assert ("amx" in tag) == bool(common.cpu_flags() & {"amx_tile", "amx_bf16"})


def test_machines_that_differ_in_matrix_units_get_their_own_tags():
    # Two 2-core machines whose bf16 products differ by 4x (no bf16 instructions against AVX512-BF16) must not
    # overwrite each other's results.
    xeon = common.cpu_tag("Intel(R) Xeon(R) Processor @ 2.80GHz", {"avx2", "avx512f"}, 2)
    epyc = common.cpu_tag("AMD EPYC 9R14 96-Core Processor", {"avx2", "avx512f", "avx512_bf16"}, 2)
    amx = common.cpu_tag("Intel(R) Xeon(R) Platinum 8488C", {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, 2)
    assert xeon == "cpu-intel-xeon-2core-avx512"
    assert epyc == "cpu-amd-epyc-9r14-2core-avx512-bf16"
    assert amx == "cpu-intel-xeon-platinum-8488c-2core-avx512-bf16-amx"


# One worker runs the whole module: its dry run of every experiment (a session fixture) is the expensive part.
pytestmark = pytest.mark.xdist_group("experiments")


def test_device_tag_of_a_gpu():
    h200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    assert common.device_tag(h200) == "gpu-h200"
    a100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB")
    assert common.device_tag(a100) == "gpu-a100-sxm4-80gb"


GPU_HLO = """
ENTRY %main (a.1: bf16[64,64], b.1: bf16[64,64]) -> f32[64,64] {
  %a.1 = bf16[64,64]{1,0} parameter(0)
  %b.1 = bf16[64,64]{1,0} parameter(1)
  %x.2 = f32[64,64]{1,0} parameter(2)
  %custom-call.1 = (f32[64,64]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$lt$matmul", backend_config={}
  %conv = (f32[8,32,32,64]{3,2,1,0}, u8[0]{0}) custom-call(%x.2, %x.2), window={size=3x3}, custom_call_target="__cudnn$convForward"
  %typed = f32[64,64]{1,0} custom-call(bf16[64,64]{1,0} %a.1, bf16[64,64]{1,0} %b.1), custom_call_target="__cublas$gemm"
  ROOT %gemm_fusion_dot = f32[64,64]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%c, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""


def test_library_calls_reads_targets_and_operand_types():
    calls = common.library_calls(GPU_HLO)
    by_target = {c["target"]: c for c in calls}
    assert set(by_target) == {"__cublas$lt$matmul", "__cublas$gemm", "__cudnn$convForward", "__triton_gemm"}
    assert by_target["__cublas$gemm"]["operand_dtypes"] == ["bf16", "bf16"]
    assert by_target["__cublas$lt$matmul"]["operand_dtypes"] == ["bf16", "bf16"]
    assert by_target["__cudnn$convForward"]["operand_dtypes"] == ["f32", "f32"]
    assert by_target["__triton_gemm"]["result"] == "f32[64,64]"


def test_library_calls_on_this_backends_compiled_bf16_product():
    a = jnp.ones((64, 64), jnp.bfloat16)
    product = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    calls = common.library_calls(common.compiled_hlo(product, a, a))
    # Whatever kernel XLA picks here, any library call it makes on these operands must read as bf16.
    for call in calls:
        assert set(call["operand_dtypes"]) <= {"bf16", "f32", "?"}
    assert gpu_check.tensor_core_check(32)["matmul_n"] == 32


def _tensor_core_check_of(monkeypatch, hlo: str) -> dict:
    """`gpu_check.tensor_core_check` reading `hlo` as the compiled program of its bf16 product."""
    monkeypatch.setattr(common, "compiled_hlo", lambda *args: hlo)
    return gpu_check.tensor_core_check(8)


F32_GEMMS = {
    # The bf16 inputs converted to f32 and multiplied as f32 x f32: the product tensor cores do not run fast.
    "converted operands": """
ENTRY %main (a.1: bf16[64,64]) -> f32[64,64] {
  %a.1 = bf16[64,64]{1,0} parameter(0)
  %convert.1 = f32[64,64]{1,0} convert(%a.1)
  %custom-call.1 = (f32[64,64]{1,0}, s8[4194304]{0}) custom-call(%convert.1, %convert.1), custom_call_target="__cublas$lt$matmul", backend_config={}
  ROOT %gte = f32[64,64]{1,0} get-tuple-element(%custom-call.1), index=0
}
""",
    "typed f32 operands": """
ENTRY %main (a.1: f32[64,64], b.1: f32[64,64]) -> f32[64,64] {
  %a.1 = f32[64,64]{1,0} parameter(0)
  %b.1 = f32[64,64]{1,0} parameter(1)
  ROOT %gemm = f32[64,64]{1,0} custom-call(f32[64,64]{1,0} %a.1, f32[64,64]{1,0} %b.1), custom_call_target="__cublas$gemm"
}
""",
    "mixed bf16 x f32": """
ENTRY %main (a.1: bf16[64,64], b.1: f32[64,64]) -> f32[64,64] {
  %a.1 = bf16[64,64]{1,0} parameter(0)
  %b.1 = f32[64,64]{1,0} parameter(1)
  ROOT %gemm = f32[64,64]{1,0} custom-call(%a.1, %b.1), custom_call_target="__cublas$gemm"
}
""",
}


@pytest.mark.parametrize("case", sorted(F32_GEMMS))
def test_gpu_check_does_not_count_an_f32_gemm_as_bf16(case, monkeypatch):
    info = _tensor_core_check_of(monkeypatch, F32_GEMMS[case])
    assert len(info["gemm_calls"]) == 1 and "f32" in info["gemm_calls"][0]["operand_dtypes"], info["gemm_calls"]
    assert info["bf16_gemm"] is False
    # The same call on bf16 operands is what the check looks for.
    bf16 = F32_GEMMS["converted operands"].replace("%convert.1, %convert.1", "%a.1, %a.1")
    assert _tensor_core_check_of(monkeypatch, bf16)["bf16_gemm"] is True


# A Triton GEMM fusion is read by its operands only: here they are bf16, but the fused computation converts them
# and multiplies f32 x f32.
TRITON_F32_DOT = """
%triton_gemm_computation (p0: bf16[64,64], p1: bf16[64,64]) -> f32[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %cv0 = f32[64,64]{1,0} convert(%p0)
  %cv1 = f32[64,64]{1,0} convert(%p1)
  ROOT %dot.1 = f32[64,64]{1,0} dot(%cv0, %cv1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a.1: bf16[64,64], b.1: bf16[64,64]) -> f32[64,64] {
  %a.1 = bf16[64,64]{1,0} parameter(0)
  %b.1 = bf16[64,64]{1,0} parameter(1)
  ROOT %gemm_fusion_dot = f32[64,64]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""


@pytest.mark.xfail(
    strict=True,
    reason="experiments/common.library_calls reads a library fusion's operand types only, so gpu_check's bf16_gemm "
    "accepts a __triton_gemm fusion of bf16 inputs whose dot is f32 x f32 (converted inside the fusion)",
)
def test_gpu_check_does_not_count_a_fusion_with_an_f32_dot_as_bf16(monkeypatch):
    assert _tensor_core_check_of(monkeypatch, TRITON_F32_DOT)["bf16_gemm"] is False


def test_parallel_experiment_forms_take_the_same_step(monkeypatch):
    """exp_parallel's agreement figure, `first_loss`, is the loss the step reports: that of the state before the
    update, so it agrees between forms whatever their gradient reduction or update does. Here the experiment's own
    measurement (`_measure`, tiny preset, 2 devices) runs once per form, and the parameters after the step it times
    are compared between forms, and against the initial ones (the step must have moved them)."""
    taken = {}
    library_step = exp_parallel.data_parallel_train_step

    def recording(*args, **kwargs):
        dp = library_step(*args, **kwargs)

        def step(state, batch):
            new_state, metrics = dp.step(state, batch)
            taken[dp.form] = (dp.unreplicate(state).params, dp.unreplicate(new_state).params)
            return new_state, metrics

        return dp._replace(step=step)

    monkeypatch.setattr(exp_parallel, "data_parallel_train_step", recording)
    # One initial state for the three forms (each would compile its own initialiser: seconds, for the same arrays).
    created = {}
    library_create = exp_parallel.create_sharded_state

    def create_once(make, mesh):
        if mesh not in created:
            created[mesh] = library_create(make, mesh)
        return created[mesh]

    monkeypatch.setattr(exp_parallel, "create_sharded_state", create_once)
    monkeypatch.setattr(exp_parallel, "time_fn", lambda fn, repeats: time_fn(fn, warmup=0, repeats=1, number=1))
    cfg = exp_parallel.CONFIG["tiny"]
    model = MLP(cfg["cfg"])
    rows = [exp_parallel._measure(model, form, 2, 2 * cfg["per_device"], repeats=1) for form in FORMS]
    assert set(taken) == set(FORMS) and {r["devices"] for r in rows} == {2}
    before, ref = taken["jit"]
    moved = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(before))
    ]
    assert min(moved) > 1e-4, moved  # Adam's first step moves every parameter by about the learning rate (1e-3)
    for form in ("shard_map", "pmap"):
        start, after = taken[form]
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), start, before)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), after, ref
        )


def test_conv_reference_matches_exact_fp32_convolution():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 6, 6, 3)), rng.standard_normal((3, 3, 3, 4))
    conv = exp_precision._conv(lax.Precision.HIGHEST, jnp.float32)
    out = np.asarray(conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)))
    assert common.relative_error(out, exp_precision.conv_reference(x, w)) < 1e-5


def test_relative_error_never_passes_nan():
    ref = np.ones(4)
    assert common.relative_error(ref, ref) == 0.0
    assert common.relative_error(np.array([1.0, np.nan, 1.0, 1.0]), ref) == float("inf")


def test_budget_skips_once_spent():
    budget = common.Budget(0.0)
    assert budget.over()
    assert not common.Budget(None).over()
    with pytest.raises(ValueError, match="unknown size"):
        common.preset({"quick": 1}, "huge")


def test_gpu_check_stops_with_a_clear_message_off_the_gpu(tmp_path, capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a GPU" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_gpu_check_names_every_missing_module_before_starting(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "REQUIRED_MODULES", ["json", "no_such_module", "experiments.no_such_experiment"])
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_module" in err and "experiments.no_such_experiment" in err, err
    assert "json" not in err.split(":", 2)[-1].split(", ")  # present modules are not listed
    assert not list(tmp_path.iterdir())


def test_gpu_check_refuses_an_archive_it_cannot_write(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--archive", "results.zip"])
    assert "--archive 'results.zip': name a folder or a .tar.gz file" in capsys.readouterr().err
    args = gpu_check.parse_args(["--only", "exp_matmul"])
    assert args.mfu is False and gpu_check.parse_args(["--only", "bench_gpu_mfu"]).mfu is True
    assert gpu_check.parse_args(["--no-mfu"]).mfu is False and gpu_check.parse_args([]).mfu is True


def test_gpu_budgets_fit_the_run():
    # The MFU benchmark (~60-90 s, kept back from the experiments) and jax's start come on top of the experiments'
    # soft budgets; the MFU child's hard timeout ends the run inside one 10-minute command whatever happens.
    assert sum(gpu_check.BUDGETS.values()) + gpu_check.MFU_RESERVE_S + gpu_check.OVERRUN_MARGIN_S <= 430
    assert gpu_check.TOTAL_LIMIT_S <= 430 and gpu_check.TOTAL_LIMIT_S + gpu_check.MFU_GRACE_S + 60 < 600


@pytest.mark.slow
def test_gpu_check_killed_midway_keeps_the_finished_parts(tmp_path):
    """SIGKILL (what a machine's time limit does) once the first experiment has finished: every finished part's
    file is there and readable, and gpu_check.json says the run did not complete."""
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--dry-run", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([*cmd, "--only", "exp_precision", "exp_train"], env=env, stdout=subprocess.DEVNULL)
    deadline, check = time.monotonic() + 240, None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(tmp_path.glob("*/gpu_check.json"))
            check = json.loads(found[0].read_text()) if found else None
            if check and any(row["name"] == "exp_precision" for row in check["table"]):
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert check is not None and proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    folder = found[0].parent
    check = json.loads((folder / "gpu_check.json").read_text())
    # --only without bench_gpu_mfu skips the MFU child, which runs after the experiments anyway.
    assert check["complete"] is False and [r["name"] for r in check["table"]] == ["exp_precision"]
    assert "lowerings" in check and check["check"]["backend"] == jax.default_backend()
    assert json.loads((folder / "exp_precision.json").read_text())["rows"]
    assert not (folder / "exp_train.json").exists()  # killed while it ran


# ----------------------------------------------------------------------------------------------- the dry run


# Slow (about a minute on 2 cores, nearly all XLA compilation) but it is the one test of every experiment's code
# path and of the script a GPU run depends on.
# Session scope: under xdist a module fixture would be set up again whenever other modules' tests interleave.
@pytest.fixture(scope="session")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    # Start jax first, so the dry run's request for 2 simulated devices cannot change the 8 that conftest gave
    # this worker's later test modules (it then runs on the devices that exist).
    assert jax.device_count() >= 2
    archive = tmp_path_factory.mktemp("archive")
    code = gpu_check.main(["--dry-run", "--out", str(out), "--archive", f"{archive}/"])
    return code, out / common.machine_tag(), archive


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_experiment(dry_run):
    code, folder, _ = dry_run
    check = json.loads((folder / "gpu_check.json").read_text())
    failed = [row for row in check["table"] if not row["status"].startswith("ok")]
    assert code == 0 and not failed, failed
    # The experiments first, in their budgets' order, then the LoRA, serving and MFU benchmarks in processes of
    # their own.
    assert check["complete"] is True and [row["name"] for row in check["table"]] == [
        *gpu_check.BUDGETS,
        "bench_lora",
        "bench_serve",
        "bench_gpu_mfu",
    ]
    served = {(row["server"], row["concurrency"]) for row in check["serve"]}
    engine = "jaxnn engine (no HTTP)"
    assert served == {(engine, 1), (engine, 4), (f"{engine} --slots 1", 4)}
    assert all(row["tokens_per_s"] > 0 and row["requests"] == 2 * row["concurrency"] for row in check["serve"])
    quantised = ["lora r=8 int8", "lora r=8 nf4"] if importlib.util.find_spec("qwix") else []
    assert [row["method"] for row in check["lora"]] == ["full", "lora r=8", *quantised]
    assert check["dry_run"] is True and check["check"]["backend"] == jax.default_backend()
    mfu = json.loads((folder / "gpu_mfu.json").read_text())
    assert mfu["dry_run"] is True and mfu["mfu"] > 0 and mfu["num_params"] > 0
    # The same step on packed batches: real tokens on most positions, its MFU set against the unpacked step's.
    packed = mfu["packed"]
    assert 0.5 < packed["real_token_share"] < 1 and packed["mfu_over_unpacked"] == pytest.approx(
        packed["mfu"] / mfu["mfu"]
    )
    assert check["mfu"]["mfu_datasheet"] == pytest.approx(mfu["model_tflops"] / 989.0)
    # Where each step's device time went, read from a trace of two more steps of it.
    assert mfu["fp8"]["policy"] == "fp8-delayed" and mfu["fp8"]["step_s"] > 0
    for kernels in (mfu["kernels"], mfu["fp8"]["kernels"], packed["kernels"]):
        assert kernels["steps"] == 2 and kernels["rows"] and "matmul" in kernels["by_kind"]
        assert sum(kernels["by_kind"].values()) == pytest.approx(1.0)
    assert check["check"]["bf16_tflops"] > 0
    # One archive of the whole folder, and the two summaries beside it: what a GPU machine hands back.
    archive = dry_run[2]
    assert sorted(p.name for p in archive.iterdir()) == sorted(
        [f"{folder.name}.tar.gz", "gpu_check.json", "gpu_mfu.json"]
    )
    with tarfile.open(archive / f"{folder.name}.tar.gz") as tar:
        packed = set(tar.getnames())
    # Every file; the profiler's traces (a folder, summarised in gpu_mfu.json) stay behind.
    assert packed == {f"{folder.name}/{p.name}" for p in folder.iterdir() if p.is_file()}
    assert set(check["lowerings"]["grad_ms"]) == {
        "conv xla",
        "conv im2col",
        "max_pool reduce_window",
        "max_pool reshape",
    }
    assert all(ms > 0 for ms in check["lowerings"]["grad_ms"].values())
    for name in EXPERIMENTS:
        record = json.loads((folder / f"{name}.json").read_text())
        assert record["name"] == name and record["size"] == "tiny"
        assert record["machine"]["tag"] == folder.name and record["machine"]["jax_version"] == jax.__version__
        assert (folder / f"{name}.png").stat().st_size > 1000


@pytest.mark.slow
def test_dry_run_figures_are_measured(dry_run):
    _, folder, _ = dry_run
    load = lambda name: json.loads((folder / f"{name}.json").read_text())  # noqa: E731
    mm = load("exp_matmul")
    assert {r["dtype"] for r in mm["rows"]} == {"f32", "bf16"}
    for r in mm["rows"]:
        assert r["min"] <= r["median"] <= r["max"] and r["gflops"] == pytest.approx(2 * r["n"] ** 3 / r["median"] / 1e9)
    prec = {(r["op"], r["mode"]): r for r in load("exp_precision")["rows"]}
    assert prec[("matmul", "fp32")]["rel_error"] < 1e-5  # exact fp32 against float64
    assert 1e-4 < prec[("matmul", "bf16")]["rel_error"] < 2e-2  # bf16 operands: 8-bit mantissa
    assert prec[("matmul", "fp32")]["speedup_vs_fp32"] == 1.0
    seq = load("exp_sequential")
    assert {r["case"] for r in seq["rows"]} == {"chain", "chain_parallel", "rnn", "rnn_parallel"}
    pipe = load("exp_pipeline")
    assert {r["arrangement"] for r in pipe["rows"]} == {"sync", "overlapped", "device"}
    assert all(0.0 <= r["device_idle"] <= 1.0 for r in pipe["rows"])
    split = pipe["split"]  # the real crop+flip on the host and in the step, with the projection labelled
    assert split["host_images_per_s_per_core"] > 0 and split["host_keeps_up_to_steps_per_s_per_core"] > 0
    if split["notes"]:  # no dm-pix: the device rows say why they are missing
        assert "dm-pix is not installed" in split["notes"][0] and "in_step" not in split
    else:
        assert 0.0 <= split["in_step"]["input_wait_fraction"] <= 1.0
        assert split["projected"]["label"] == "projected, not measured" and split["projected"]["step_s"] > 0
    inf = load("exp_inference")
    assert all(r["p50_ms"] <= r["p99_ms"] for r in inf["rows"]) and {r["model"] for r in inf["rows"]} == {"cnn", "gpt"}
    par = load("exp_parallel")
    losses = [r["first_loss"] for r in par["rows"]]
    assert {r["form"] for r in par["rows"]} == {"jit", "shard_map", "pmap"}
    assert max(losses) - min(losses) < 1e-4  # the three forms compute the same step on the same batch
    train = load("exp_train")
    # The dry run spends exp_train's budget before it starts: its two decisive rows run (bf16 first, then the
    # fp32 baseline it is compared with), and the rest is recorded as skipped.
    assert [(r["model"], r["precision"]) for r in train["rows"]] == [("cnn", "bf16"), ("cnn", "fp32")]
    assert train["skipped"] == ["gpt fp16"] and train["budget_s"] == 0.0
    assert all(r["finite"] for r in train["rows"])
    # Each row says where its step's device time went (kinds from the operations' names: no second compile).
    for row in train["rows"]:
        assert row["kernels"]["rows"] and sum(row["kernels"]["by_kind"].values()) == pytest.approx(1.0)


@pytest.mark.slow
def test_report_on_the_dry_run_has_every_claim(dry_run, tmp_path):
    _, folder, _ = dry_run
    text = report.build(folder.parent, tmp_path / "REPORT.md")
    for n in range(1, 8):
        assert f"## Claim {n}:" in text
    assert "GPU (not measured)" in text and f"CPU `{folder.name}`" in text
    if installed("dm_pix"):  # claim 5's verdict names where host augmentation stops keeping up
        assert "host augmentation keeps up while the step rate stays under" in text
    assert "12x" in text and "about 8x" in text and "about 15x" in text


# ----------------------------------------------------------------------------------------------- the report


def _machine(tag, backend, kind):
    return {
        "tag": tag,
        "backend": backend,
        "device_kind": kind,
        "device_count": 1,
        "cpu_model": "x",
        "cpu_cores": 16,
        "cpu_flags": [],
        "jax_version": "0.11.2",
        "python": "3.12",
    }


def _write(root, tag, name, record):
    path = root / tag / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "date": "2026-11-30T00:00:00+00:00", "size": "gpu", **record}))


def _mm_rows(backend, times):
    return [
        {
            "backend": backend,
            "dtype": d,
            "n": n,
            "median": t * (0.5 if d == "bf16" else 1),
            "p25": t,
            "p75": t,
            "min": t,
            "max": t,
            "gflops": 2 * n**3 / t / 1e9,
        }
        for n, t in times.items()
        for d in ("f32", "bf16")
    ]


@pytest.fixture
def gpu_fixture(tmp_path):
    """A GPU machine's results (GPU and host-CPU rows) and no CPU-machine results: figures chosen so that each
    verdict rule lands on a known side."""
    tag, m = "gpu-h200", _machine("gpu-h200", "gpu", "NVIDIA H200")
    _write(
        tmp_path,
        tag,
        "exp_matmul",
        {
            "machine": m,
            "rows": _mm_rows("gpu", {64: 2e-5, 4096: 1e-4}) + _mm_rows("cpu", {64: 5e-6, 4096: 0.1}),
            "peaks": {"gpu": {"gflops": 700000.0}, "cpu": {"gflops": 900.0}},
        },
    )
    prec_rows = [
        {
            "op": "matmul",
            "mode": mode,
            "gflops": g,
            "speedup_vs_fp32": g / 50000,
            "rel_error": e,
            "kernels": [{"target": "__cublas$lt$matmul", "operand_dtypes": ["bf16", "bf16"]}],
        }
        for mode, g, e in (("fp32", 50000, 1e-7), ("bf16", 700000, 3e-3))
    ]
    _write(tmp_path, tag, "exp_precision", {"machine": m, "rows": prec_rows})
    seq_rows = [
        {"backend": b, "case": c, "hidden": 16, "steps": 1000, "median": t, "us_per_step": t * 1e3}
        for b, c, t in (
            ("gpu", "chain", 0.01),
            ("gpu", "chain_parallel", 1e-5),
            ("cpu", "chain", 0.001),
            ("cpu", "chain_parallel", 1e-4),
            ("gpu", "rnn", 0.012),
            ("cpu", "rnn", 0.002),
        )
    ]
    _write(tmp_path, tag, "exp_sequential", {"machine": m, "rows": seq_rows})
    _write(
        tmp_path,
        tag,
        "gpu_check",
        {
            "machine": m,
            "dry_run": False,
            "check": {
                "bf16_gemm": True,
                "cudnn_conv": True,
                "gemm_calls": [{"target": "__cublas$lt$matmul"}],
                "conv_calls": [{"target": "__cudnn$convForward"}],
            },
        },
    )
    pipe_rows = [
        {"arrangement": a, "cost": c, "samples_per_s": s, "device_idle": i}
        for c in (1, 16)
        for a, s, i in (("sync", 1000, 0.7), ("overlapped", 3000, 0.1), ("device", 5000, 0.0))
    ]
    _write(tmp_path, tag, "exp_pipeline", {"machine": m, "rows": pipe_rows})
    inf_rows = [
        {"backend": b, "model": "cnn", "batch": n, "p50_ms": p, "p99_ms": 2 * p, "samples_per_s": s}
        for b, n, p, s in (
            ("gpu", 1, 0.3, 3000),
            ("gpu", 4096, 5.0, 800000),
            ("cpu", 1, 0.2, 5000),
            ("cpu", 256, 40.0, 6000),
        )
    ]
    _write(tmp_path, tag, "exp_inference", {"machine": m, "rows": inf_rows})
    train_rows = [
        {"model": "cnn", "precision": p, "step_ms": ms, "finite": True, "test_accuracy": acc}
        for p, ms, acc in (("fp32", 4.0, 0.97), ("bf16", 2.0, 0.96))
    ]
    _write(
        tmp_path,
        tag,
        "exp_train",
        {
            "machine": m,
            "rows": train_rows,
            "failures": [{"model": "gpt", "precision": "bf16", "error": "JaxRuntimeError: UNIMPLEMENTED"}],
        },
    )
    return tmp_path


def _summary_verdicts(text):
    """{claim title: overall verdict} from the report's summary table."""
    return {k: v.strip() for k, v in re.findall(r"^\| \d\. \[([^\]]+)\]\(#[^)]+\) \| ([^|]+) \|", text, re.M)}


def test_report_fills_gpu_column_and_marks_missing_cpu_not_measured(gpu_fixture):
    text = report.build(gpu_fixture, gpu_fixture / "REPORT.md")
    assert "CPU (not measured)" in text and "GPU `gpu-h200`" in text
    table_rows = [line for line in text.splitlines() if line.startswith("| accelerator / host CPU")]
    assert table_rows == ["| accelerator / host CPU, largest fp32 | not measured | 1000.00x |"]
    verdicts = _summary_verdicts(text)
    assert verdicts == {
        "Parallel matrix work": "confirmed",
        "Latency": "confirmed",
        "Tensor cores": "confirmed",
        "Libraries": "confirmed",
        "Split the work": "refuted",
        "Big data, big batches": "not measured",
        "Inference": "confirmed",
    }
    assert "| train cnn bf16: step speedup, quality (fp32's) | not measured | 2.00x; 0.960 (0.970) |" in text
    assert "| train gpt bf16: step speedup, quality (fp32's) | not measured | failed: JaxRuntimeError" in text
    # The numbers behind a verdict are the file's, not typed: 700000 / 50000 = 14x.
    assert "14.00x exact fp32" in text


def test_report_with_no_gpu_results_never_invents_gpu_figures(tmp_path):
    m = _machine("cpu-2core-avx512", "cpu", "cpu")
    _write(
        tmp_path,
        "cpu-2core-avx512",
        "exp_matmul",
        {"machine": m, "rows": _mm_rows("cpu", {64: 1e-5, 2048: 0.08}), "peaks": {"cpu": {"gflops": 200.0}}},
    )
    text = report.build(tmp_path, tmp_path / "REPORT.md")
    gpu_cells = [
        line.rsplit("|", 2)[1].strip()
        for line in text.splitlines()
        if line.startswith("| ")
        and "figure" not in line
        and "claim" not in line
        and "tag" not in line
        and not line.startswith("| `")
    ]
    assert gpu_cells and set(gpu_cells) == {"not measured"}
    assert "No GPU results yet" in text
    assert _summary_verdicts(text)["Parallel matrix work"] == "not measured"


def test_backends_interleave_per_size_so_a_spent_budget_keeps_both():
    sizes = {"gpu": [64, 128, 4096, 8192], "cpu": [64, 128, 4096]}
    pairs = common.interleaved(sizes, exp_matmul.decisive_first)
    assert pairs[:4] == [(8192, "gpu"), (64, "gpu"), (64, "cpu"), (128, "gpu")]
    assert sorted(pairs) == sorted((n, b) for b, ns in sizes.items() for n in ns)
    assert exp_inference.decisive_first([256, 1, 16, 4096]) == [1, 4096, 16, 256]


def test_report_survives_any_subset_of_rows(gpu_fixture):
    """A GPU run cut short: sweeps one machine has and the other lacks, experiments without their rows or with
    one backend only. The report builds, and every gap reads 'not measured'."""
    cpu, g = "cpu-intel-xeon-2core-avx512", "gpu-h200"
    par = lambda sweep: {"rows": [], "simulated_devices": False, "sweep": sweep}  # noqa: E731
    sweep = lambda *b: [{"global_batch": n, "samples_per_s": 10.0 * n} for n in b]  # noqa: E731
    _write(gpu_fixture, cpu, "exp_parallel", {"machine": _machine(cpu, "cpu", "cpu"), **par(sweep(8, 16))})
    _write(gpu_fixture, g, "exp_parallel", {"machine": _machine(g, "gpu", "NVIDIA H200"), **par(sweep(16, 4096))})
    m = _machine(g, "gpu", "NVIDIA H200")
    _write(gpu_fixture, g, "exp_sequential", {"machine": m, "rows": []})
    _write(gpu_fixture, g, "exp_pipeline", {"machine": m})  # no rows key at all
    mm = json.loads((gpu_fixture / g / "exp_matmul.json").read_text())
    _write(gpu_fixture, g, "exp_matmul", {**mm, "rows": [r for r in mm["rows"] if r["backend"] == "gpu"], "peaks": {}})
    inf = json.loads((gpu_fixture / g / "exp_inference.json").read_text())
    _write(gpu_fixture, g, "exp_inference", {**inf, "rows": [r for r in inf["rows"] if r["batch"] != 1]})
    text = report.build(gpu_fixture, gpu_fixture / "REPORT.md")
    assert "| train samples/s, batch 4096 (1 device) | not measured | 40,960 |" in text
    assert "| train samples/s, batch 8 (1 device) | 80.0 | not measured |" in text
    verdicts = _summary_verdicts(text)
    assert verdicts["Parallel matrix work"] == verdicts["Latency"] == "not measured"
    assert verdicts["Split the work"] == verdicts["Inference"] == "not measured"
    assert verdicts["Big data, big batches"] == "confirmed"


def test_report_sets_each_projection_beside_its_measurement(gpu_fixture):
    """Synthetic program costs next to the synthetic GPU run: the projected column is labelled, apart from the
    measured one, and where both exist the cell gives measured / projected, worked out by hand here."""
    programs = [
        {"dtype": d, "n": n, "flops": 2.0 * n**3, "nbytes": 12.0 * n * n, "kind": "fp32" if d == "f32" else "bf16"}
        for n in (64, 4096)
        for d in ("f32", "bf16")
    ]
    programs = [{**r, "kernels": 1, "loop_trips": 0, "h2d_bytes": 0.0, "d2h_bytes": 0.0} for r in programs]
    chain = {"case": "chain", "hidden": 16, "steps": 1000, "flops": 1e6, "nbytes": 1e6, "kind": "tf32"}
    chain |= {"kernels": 4002, "loop_trips": 500, "h2d_bytes": 0.0, "d2h_bytes": 0.0}
    (gpu_fixture / "projected").mkdir()
    (gpu_fixture / "projected" / "costs.json").write_text(
        json.dumps(
            {
                "compiled_on": "cpu-x",
                "date": "2026-12-02",
                "programs": {"exp_matmul": programs, "exp_sequential": [chain]},
            }
        )
    )
    text = report.build(gpu_fixture, gpu_fixture / "REPORT.md")
    assert "| figure | CPU (not measured) | GPU `gpu-h200` | GPU H200 (projected, not measured) |" in text
    # fp32 4096^3 on the model: 1.374e11 FLOPs / 67e12 FLOP/s + one 5 µs launch = 2.0563 ms -> 66,837 GFLOP/s;
    # measured in the fixture: 1.374e11 / 1e-4 s = 1,374,390 GFLOP/s, 20.56x the projection.
    projected = 2 * 4096**3 / (2 * 4096**3 / 67e12 + 5e-6) / 1e9
    assert round(projected) == 66837
    row = next(line for line in text.splitlines() if line.startswith("| best fp32 (exact) |"))
    assert row.endswith("| 66,837 GFLOP/s (n=4096); measured 1,374,390, measured/projected 20.56x |"), row
    assert "| 1,374,390 GFLOP/s (n=4096) |" in row  # the measured column is the measurement, untouched
    assert "| bf16 matmul kernels | not measured | `__cublas$lt$matmul` | not projected |" in text
    # Each claim keeps its measured verdict and gets a projected one on its own line after it.
    lines = text.splitlines()
    projected_lines = [i for i, line in enumerate(lines) if line.startswith("**Projected verdict (projected, not")]
    assert len(projected_lines) == 7
    assert all([x for x in lines[:i] if x.startswith("**")][-1].startswith("**Verdict: ") for i in projected_lines)
    first = next(line for line in lines if line.startswith("| 1. [Parallel matrix work]"))
    assert "| confirmed |" in first and first.endswith("| projected: not measured |")  # no CPU results to project
    # The model refit from the measured run: each peak from the fastest measured product of its dtype.
    assert "Refit from the measured run `gpu-h200`" in text
    assert "- peak fp32: 67 -> 1374 TFLOP/s" in text and "- peak bf16: 790 -> 1374 TFLOP/s" in text
    # The chain's 10 ms less 500 loop latencies of 10 µs and a 0.23 µs roofline, over 4,002 kernels: 1.25 µs each.
    assert "- kernel launch: 5 -> 1.25 µs (exp_sequential chain, hidden 16: 10 ms measured for 4002 kernels)" in text


REPO = Path(__file__).resolve().parents[2]


def committed_results(dest: Path, keep=lambda folder: folder.startswith("cpu-") or folder == "projected") -> list[str]:
    """Extracts the results/<folder>/ folders that `keep` names, as committed (git HEAD), into `dest`: never the
    files a user's own runs left in the checkout's results/ (a new machine's folder, a rerun that replaced a
    committed file). Returns the folders extracted."""
    cmd = ["git", "-C", str(REPO), "archive", "--format=tar", "HEAD", "--", "results"]
    archive = subprocess.run(cmd, capture_output=True)
    if archive.returncode:
        pytest.skip(f"the committed results are read from git HEAD: {archive.stderr.decode().strip()[:200]}")
    found = set()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and len(parts) > 2 and keep(parts[1]):
                found.add(parts[1])
                target = dest.joinpath(*parts[1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    return sorted(found)


@pytest.fixture
def committed_plus_gpu(gpu_fixture):
    """The committed CPU results of this repository (and its projected costs) beside the synthetic GPU run."""
    assert any(name.startswith("cpu-") for name in committed_results(gpu_fixture))
    return gpu_fixture


def test_the_committed_results_fixture_ignores_a_users_own_results(tmp_path):
    """A results folder or a changed file only in the working tree (a user's `make experiments`) never reaches the
    fixture: what it extracts is byte for byte what HEAD holds."""
    stray = REPO / "results" / "cpu-stray-test-machine"
    stray.mkdir()
    try:
        (stray / "exp_matmul.json").write_text("{}")
        names = committed_results(tmp_path)
    finally:
        shutil.rmtree(stray)
    assert "cpu-stray-test-machine" not in names and names
    for path in tmp_path.rglob("*.json"):
        rel = path.relative_to(tmp_path).as_posix()
        head = subprocess.run(["git", "-C", str(REPO), "show", f"HEAD:results/{rel}"], capture_output=True, check=True)
        assert path.read_bytes() == head.stdout, rel


def _sections(text):
    return {part.split("\n", 1)[0]: part for part in text.split("\n## ")[1:]}


def test_the_report_reads_at_a_glance_without_nan_or_repeats(committed_plus_gpu):
    cpus = sorted(p.name for p in committed_plus_gpu.glob("cpu-*"))
    this = cpus[-1]
    text = report.build(committed_plus_gpu, committed_plus_gpu / "REPORT.md", this=this)
    assert not re.search(r"\bnan\b", text, re.I) and "(N=1)" not in text
    tables = [s for s in _sections(text) if s == "At a glance"]
    assert len(tables) == 1 and text.index("## At a glance") < text.index("## Machines")
    assert set(_summary_verdicts(text)) == {title for title, _ in report.CLAIMS.values()}
    header = next(line for line in text.splitlines() if line.startswith("| claim | verdict |"))
    assert header.index(f"`{this}` (this machine)") < header.index("(committed)")
    assert f"| `{this}` | this machine |" in text
    for title, section in _sections(text).items():
        if not title.startswith("Claim"):
            continue
        sentences = [s.strip() for s in re.split(r"(?<=[.;])\s", section) if len(s.strip()) > 30]
        repeated = {s for s in sentences if sentences.count(s) > 1 and not s.startswith("|")}
        assert not repeated, (title, repeated)


def test_every_figure_in_the_summary_is_one_its_section_shows(committed_plus_gpu):
    from experiments import glance

    text = report.build(committed_plus_gpu, committed_plus_gpu / "REPORT.md", this=None)
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("| claim | verdict |"))
    tags = re.findall(r"`([^`]+)`", head)
    sections = _sections(text)
    traced = 0
    for row in (line for line in lines if re.match(r"\| \d\. \[", line)):
        number = int(row[2])
        cells = [c.strip() for c in row.strip("|").split(" | ")][2 : 2 + len(tags)]
        section = next(s for title, s in sections.items() if title.startswith(f"Claim {number}:"))
        for tag, cell in zip(tags, cells):
            figure = cell.split(": ", 1)[1] if ": " in cell else None
            if figure is None:
                continue
            short = next((s for label, s in glance.HEADLINES[number] if figure.startswith(s + " ")), None)
            if short is not None:  # a table figure: the section's row of that name, this machine's column
                label = next(label for label, s in glance.HEADLINES[number] if s == short)
                table = section.splitlines()
                columns = next(line for line in table if line.startswith("| figure |")).strip("|").split(" | ")
                column = next(i for i, c in enumerate(columns) if f"`{tag}`" in c)
                table_row = next(line for line in table if line.startswith(f"| {label} |"))
                assert table_row.strip("|").split(" | ")[column].strip() == figure[len(short) + 1 :], (cell, tag)
            else:  # the verdict's own figure: the section's sentence for that machine
                assert figure.removesuffix("...")[:80].lower() in section.lower(), cell
            traced += 1
    assert traced >= 10

"""The projected GPU column's model (`jaxnn.profile.projection.GpuModel`) on hand-computed cases, and the kernel
count `experiments.projected` reads from compiled HLO."""

import json

import jax
import jax.numpy as jnp
import pytest

from experiments import exp_sequential
from jaxnn.profile import program_cost
from jaxnn.profile.projection import GpuModel, ProgramCost, ProjectionError


def test_a_large_bf16_product_is_compute_bound_at_the_bf16_peak():
    # 8192^3 bf16: 1.1e12 FLOPs / 790e12 FLOP/s = 1.392 ms, above 5.4e8 bytes / 4.3e12 B/s = 0.126 ms; + 5 µs launch.
    cost = ProgramCost(flops=1.1e12, nbytes=5.4e8, kind="bf16")
    model = GpuModel()
    assert model.device_s(cost) == pytest.approx(1.1e12 / 790e12 + 5e-6)
    assert model.queued_s(cost) == model.device_s(cost)  # the device, not the host's dispatch, sets the pace


def test_a_small_program_is_launch_and_dispatch_bound():
    # 3 kernels x 5 µs + max(1e6 / 67e12, 1e5 / 4.3e12) = 15.023 µs on the device; queued calls wait on the
    # 20 µs dispatch; one request adds a copy in (10 µs + 1e6 B / 55e9 B/s = 28.18 µs), none out.
    cost = ProgramCost(flops=1e6, nbytes=1e5, kind="fp32", kernels=3, h2d_bytes=1e6)
    model = GpuModel()
    device = 15e-6 + 1e5 / 4.3e12
    assert model.device_s(cost) == pytest.approx(device)
    assert model.queued_s(cost) == pytest.approx(20e-6)
    assert model.request_s(cost) == pytest.approx(20e-6 + 10e-6 + 1e6 / 55e9 + device)


def test_a_dependent_loop_pays_a_launch_per_kernel_and_a_copy_latency_per_iteration():
    # 1000 iterations of 2 kernels: 2000 x 5 µs + 1000 x 10 µs = 20 ms, whatever the (tiny) arithmetic.
    cost = ProgramCost(flops=2.6e5, nbytes=5e5, kind="tf32", kernels=2000, loop_trips=1000)
    assert GpuModel().device_s(cost) == pytest.approx(20e-3, rel=1e-3)


def test_the_model_names_what_it_lacks_and_refuses_bad_parameters():
    with pytest.raises(ProjectionError, match="no peak for 'int8'.*bf16"):
        GpuModel().device_s(ProgramCost(1.0, 1.0, "int8"))
    with pytest.raises(ProjectionError, match="launch_s must be a positive number, got -1"):
        GpuModel(launch_s=-1)
    assert set(GpuModel().sources) >= {"bf16", "fp32", "bandwidth", "launch", "dispatch", "transfer"}


HLO = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %h = f32[8]{0} get-tuple-element(%p), index=1
  %dot = f32[8]{0} dot(%h, %h), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %tanh = f32[8]{0} fusion(%dot), kind=kLoop, calls=%fused_tanh
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %tanh)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%f1
  %c = f32[8]{0} fusion(%b), kind=kLoop, calls=%f2
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %c)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""


def test_kernel_count_of_hand_written_hlo():
    # Entry: 2 fusions; each of the 10 iterations: add, dot, fusion (body) and compare (condition) = 4.
    assert program_cost.kernel_launches(HLO) == (2 + 10 * 4, 10, 10)


def test_kernel_count_and_loop_cost_of_a_compiled_chain():
    steps, hidden = 16, 8
    args = (jax.ShapeDtypeStruct((hidden, hidden), jnp.float32), jax.ShapeDtypeStruct((hidden,), jnp.float32))
    once = program_cost.program_cost(exp_sequential.make_chain(steps), args, "tf32")
    cost = program_cost.program_cost(exp_sequential.make_chain(steps), args, "tf32", loop_is_all=True)
    assert cost.loop_trips == steps and cost.kernels >= steps  # at least one kernel per dependent step
    # XLA counts the loop body once; a chain is all loop, so its work is 16 bodies': >= 16 matrix-vector products.
    assert cost.flops == pytest.approx(steps * once.flops) and cost.flops >= steps * 2 * hidden**2


@pytest.mark.slow
def test_project_model_sets_measured_cpu_beside_projected_gpu(tmp_path, capsys):
    from experiments import project_model

    out = tmp_path / "p.json"
    argv = ["--model", "mlp", "--field", "hidden=[16]", "--batches", "4", "1", "--repeats", "1", "--json", str(out)]
    assert project_model.main(argv) == 0
    printed = capsys.readouterr().out
    assert "CPU measured on " in printed and "H200 projected, not measured" in printed
    assert "one batch-1 request: " in printed
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for what, key in (
        ("samples", "gpu_projected_wins_from_batch"),
        ("train_samples", "gpu_projected_trains_faster_from_batch"),
    ):
        rows = result["rows"]
        assert all(r[f"cpu_{what}_per_s"] > 0 and r[f"gpu_{what}_per_s_projected"] > 0 for r in rows)
        wins = [r[f"gpu_{what}_per_s_projected"] > r[f"cpu_{what}_per_s"] for r in rows]
        assert result[key] == next((r["batch"] for i, r in enumerate(rows) if all(wins[i:])), None)
    assert project_model.main(["--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err

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


# ------------------------------------------------------------------------------------------------ CNN programs
# REPORT.md's projected column compiles each program as lowered for a GPU (`experiments.projected.program_cost`):
# jaxnn's convolutions are XLA's there, whichever lowering (im2col or oneDNN) this CPU would take.


def _valid_taps(height: int, width: int, k: int = 3) -> int:
    """(output position, kernel tap) pairs of a stride-1 SAME convolution whose tap falls inside the image."""

    def along(n: int) -> int:
        return sum(1 for i in range(n) for d in range(k) if 0 <= i + d - k // 2 < n)

    return along(height) * along(width)


def _cnn_hand_count(batch: int, size: int, widths: tuple[int, ...], classes: int = 10) -> dict[str, float]:
    """FLOPs and bytes of `jaxnn.models.CNN` from its layer shapes: per width a 3x3 SAME convolution (2 FLOPs per
    multiply-add, taps on the zero padding left out, as XLA counts a convolution), bias and ReLU (1 each per
    output) and a 2x2 max pool (3 comparisons per output), then the Dense classifier. "train_products": the
    forward convolutions and product again for the weight gradients, and for the input gradients of all but the
    first layer. "forward_bytes": float32 arrays read and written by one kernel per convolution, bias+ReLU, pool,
    product and bias, as a GPU runs them (each activation written once and read once by the next kernel)."""
    h = w = size
    cin, forward, products, first = 3, 0.0, 0.0, 0.0
    nbytes = 4 * batch * h * w * cin  # the input, read by the first convolution
    for c in widths:
        conv = 2 * batch * _valid_taps(h, w) * cin * c
        first = first or conv
        products += conv
        forward += conv + 2 * batch * h * w * c
        out = 4 * batch * h * w * c
        nbytes += 4 * 9 * cin * c + out  # convolution: weights in, output out
        nbytes += out + 4 * c + out  # bias + ReLU
        h, w = -(-h // 2), -(-w // 2)
        forward += 3 * batch * h * w * c
        nbytes += out + 4 * batch * h * w * c  # pool: its input in, its output out (the next layer's input)
        cin = c
    dense = 2 * batch * h * w * cin * classes
    forward += dense + batch * classes
    logits = 4 * batch * classes
    nbytes += 4 * batch * h * w * cin + 4 * h * w * cin * classes + logits + logits + 4 * classes + logits
    return {"forward": forward, "train_products": 3 * (products + dense) - first, "forward_bytes": nbytes}


def test_projected_cnn_flops_are_the_hand_count_of_its_layers():
    from experiments import projected
    from jaxnn.layers.core import init_model
    from jaxnn.models import CNN, CNNConfig
    from jaxnn.train import make_predict

    batch, size, widths = 8, 32, (16, 32)
    model = CNN(CNNConfig(widths=widths))
    _, params, state = init_model(model, jax.random.key(0), (1, size, size, 3))
    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    hand = _cnn_hand_count(batch, size, widths)
    forward = projected.program_cost(make_predict(model), (params, state, x), "tf32")
    assert forward.flops == hand["forward"]
    # Within 5% (XLA's count of a library call's operands differs by a few arrays from batch to batch); a CPU
    # library fusion of the whole network counted a third of these bytes, im2col's patches 2.7 times as many.
    assert forward.nbytes == pytest.approx(hand["forward_bytes"], rel=0.05)
    assert forward.kernels == 3 * len(widths) + 2
    # The train step: its products, and the elementwise work of the backward pass and Adam on top (< 10%).
    step = projected.program_cost_of_train_step(model, (size, size, 3), batch)
    assert hand["train_products"] < step.flops < 1.1 * hand["train_products"]


def test_projected_cnn_costs_do_not_depend_on_this_cpus_convolution_lowering():
    from experiments import projected
    from jaxnn.kernels import onednn
    from jaxnn.layers.core import init_model
    from jaxnn.models import CNN, CNNConfig
    from jaxnn.profile.projection import ProgramCost
    from jaxnn.train import make_predict

    batch, size, widths = 4, 16, (8, 16)  # the second convolution has the 8 input channels oneDNN takes
    model = CNN(CNNConfig(widths=widths))
    _, params, state = init_model(model, jax.random.key(0), (1, size, size, 3))
    args = (params, state, jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32))
    settings = (False, True) if onednn.available() else (False,)
    costs: list[ProgramCost] = []
    for flag in settings:
        with onednn.use(flag):
            costs.append(projected.program_cost(make_predict(model), args, "tf32"))
            if not flag:
                cpu = program_cost.program_cost(make_predict(model), args, "tf32")  # this CPU's im2col
    assert all(c == costs[0] for c in costs)
    # im2col writes each convolution's 9 shifted copies of its input as one patch array and reads it back: bytes
    # a GPU's convolution never moves.
    patches = sum(4 * batch * (size >> i) ** 2 * 9 * cin for i, cin in enumerate((3, *widths[:-1])))
    assert cpu.nbytes >= costs[0].nbytes + 2 * patches


def test_a_gpu_measurement_is_set_against_the_projection_of_the_program_it_ran():
    from experiments.projected_report import Projection, batch_cells

    def program(size: str, flops: float) -> dict:
        return {
            "size": size,
            "global_batch": 16,
            "flops": flops,
            "nbytes": 1e3,
            "kind": "tf32",
            "kernels": 1,
            "loop_trips": 0,
            "h2d_bytes": 0.0,
            "d2h_bytes": 0.0,
        }

    costs = {"size": "quick", "programs": {"exp_parallel": [program("quick", 1e9), program("gpu", 1e11)]}}

    def cell(gpu_run_size: str | None) -> str:
        record = {"sweep": [{"global_batch": 16, "samples_per_s": 38_610.0}]}
        record |= {"size": gpu_run_size} if gpu_run_size else {}
        p = Projection(costs, [], ["gpu-x"], lambda tag, name: record if tag == "gpu-x" else None)
        return batch_cells(p, [16])["train samples/s, batch 16 (1 device)"]()

    # The CPU's program: 1e9 / 494.5e12 s + a 5 µs launch, under the 20 µs dispatch: 16 / 20 µs = 800,000/s.
    # The GPU run's: 1e11 / 494.5e12 s + 5 µs = 207.22 µs: 77,211/s, and 38,610 measured is 0.50x of it.
    assert cell("gpu") == "800,000; measured 38,610, projected 77,211 at the GPU run's sizes, measured/projected 0.50x"
    assert cell("quick") == cell(None) == "800,000; measured 38,610, measured/projected 0.05x"
    assert cell("full") == "800,000; measured 38,610 at the GPU run's sizes (not compiled here)"

"""The optional oneDNN kernels (jaxnn.kernels.onednn): convolutions and bf16 products computed by oneDNN through
XLA's FFI give what XLA's kernels give, forward and backward, under jit, vmap and shard_map; Conv and
precision.einsum take them only where asked or switched on, and only where the computation is lowered for the CPU.
Skipped where the kernels are not built (`make install` builds them with a C++ compiler and the onednn extra)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jaxnn import layers as L
from jaxnn import precision
from jaxnn.kernels import onednn
from jaxnn.layers.core import init_model, run
from jaxnn.parallel import make_mesh

pytestmark = pytest.mark.skipif(not onednn.available(), reason=onednn.unavailable_reason() or "")
REPO = pathlib.Path(__file__).resolve().parents[1]
# oneDNN 3.2 has bfloat16 kernels only for CPUs with AVX-512 (or AVX2-VNNI-2); elsewhere bf16 stays on XLA's.
needs_bf16 = pytest.mark.skipif(
    onednn.available() and not onednn.supports_bf16(), reason="oneDNN has no bfloat16 kernels for this CPU"
)
BF16 = pytest.param(jnp.bfloat16, marks=needs_bf16, id="bfloat16")

NUMBERS = {3: ("NWC", "WIO", "NWC"), 4: ("NHWC", "HWIO", "NHWC"), 5: ("NDHWC", "DHWIO", "NDHWC")}
# (x shape, w shape, strides, (low, high) pads, dilation): stride, dilation, uneven padding, 1-D and 3-D.
GEOMETRIES = [
    ((2, 7, 6, 3), (3, 3, 3, 4), (1, 1), [(1, 1), (1, 1)], (1, 1)),
    ((2, 9, 8, 5), (3, 2, 5, 6), (2, 1), [(1, 0), (0, 1)], (1, 2)),
    ((3, 10, 4), (4, 4, 2), (3,), [(2, 1)], (1,)),
    ((1, 4, 5, 6, 2), (2, 3, 2, 2, 3), (1, 2, 1), [(0, 1), (1, 1), (0, 0)], (1, 1, 2)),
]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def xla_conv(x, w, strides, pads, dilation):
    return lax.conv_general_dilated(
        x,
        w,
        strides,
        pads,
        rhs_dilation=dilation,
        dimension_numbers=NUMBERS[x.ndim],
        preferred_element_type=jnp.float32,
    )


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])


def conv_loss(conv_fn, cotangent):
    return lambda x, w: jnp.sum(conv_fn(x, w) * cotangent)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="float32"), BF16])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["3x3same", "strided-dilated", "1d", "3d"])
def test_conv_and_its_gradients_match_xla(geometry, dtype):
    x_shape, w_shape, strides, pads, dilation = geometry
    x, w = rand(x_shape, dtype, 1), rand(w_shape, dtype, 2)
    expected = xla_conv(x, w, strides, pads, dilation)
    actual = jax.jit(lambda x, w: onednn.conv(x, w, strides, pads, dilation))(x, w)
    assert actual.shape == expected.shape and actual.dtype == jnp.float32
    assert_close(actual, expected, dtype)
    ct = rand(expected.shape, jnp.float32, 3)
    grads = jax.jit(jax.grad(conv_loss(lambda x, w: onednn.conv(x, w, strides, pads, dilation), ct), (0, 1)))(x, w)
    # The reference: XLA's convolution differentiated in float32 (the bf16 kernels take a bf16 cotangent).
    ref = jax.grad(conv_loss(lambda x, w: xla_conv(x, w, strides, pads, dilation), ct.astype(dtype)), (0, 1))
    for got, want in zip(grads, ref(x.astype(jnp.float32), w.astype(jnp.float32))):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_conv_gradients_match_finite_differences():
    x, w = rand((2, 6, 5, 3), seed=4), rand((3, 3, 3, 2), seed=5)
    fn = jax.jit(lambda x, w: jnp.sum(jnp.sin(onednn.conv(x, w, (2, 1), [(1, 1), (1, 0)], (1, 1)))))
    check_grads(fn, (x, w), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_conv_and_its_gradient_under_vmap_are_those_of_each_element():
    x, w = rand((3, 2, 6, 6, 2), seed=6), rand((3, 3, 2, 4), seed=7)
    pads = [(1, 1), (1, 1)]
    batched = jax.jit(jax.vmap(lambda x: onednn.conv(x, w, (1, 1), pads, (1, 1))))(x)
    assert_close(batched, jnp.stack([xla_conv(e, w, (1, 1), pads, (1, 1)) for e in x]), jnp.float32)

    # Per-example weight gradients: the backward kernels under vmap too.
    def loss(conv_fn):
        return lambda w, x: jnp.sum(jnp.tanh(conv_fn(x, w, (1, 1), pads, (1, 1))))

    per_example = jax.jit(jax.vmap(jax.grad(loss(onednn.conv)), in_axes=(None, 0)))(w, x)
    assert_close(per_example, jnp.stack([jax.grad(loss(xla_conv))(w, e) for e in x]), jnp.float32)


def test_data_parallel_conv_gradient_under_shard_map_matches_xla():
    mesh = make_mesh(8)
    x, w = rand((16, 6, 6, 3), jnp.float32, 8), rand((3, 3, 3, 4), jnp.float32, 9)
    pads = [(1, 1), (1, 1)]

    def loss(conv_fn):
        return lambda w, x: jnp.mean(jnp.tanh(conv_fn(x, w, (1, 1), pads, (1, 1))))

    def sharded(conv_fn):
        # Replicated weights, sharded batch: the weight gradient of each shard's loss, summed over the shards.
        local = jax.grad(loss(conv_fn))
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(w, x)

    got = sharded(onednn.conv)
    assert_close(got, sharded(xla_conv), jnp.float32)
    assert_close(got / 8, jax.grad(loss(xla_conv))(w, x), jnp.float32)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="float32"), BF16])
@pytest.mark.parametrize(
    "spec,a_shape,b_shape",
    [
        ("mk,kn->mn", (8, 16), (16, 12)),
        ("mk,mn->kn", (8, 16), (8, 12)),  # a weight gradient: both operands read transposed
        ("bqhd,bkhd->bhqk", (2, 5, 3, 4), (2, 6, 3, 4)),  # attention scores: the operands transposed first
        ("bhqk,bkhd->bqhd", (2, 3, 5, 6), (2, 6, 3, 4)),
    ],
)
def test_einsum_and_its_gradients_match_xla(spec, a_shape, b_shape, dtype):
    a, b = rand(a_shape, dtype, 10), rand(b_shape, dtype, 11)
    with onednn.use(False):
        expected = jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
        ct = rand(expected.shape, jnp.float32, 12)
        ref = jax.jit(jax.grad(lambda a, b: jnp.sum(precision.einsum(spec, a, b) * ct), (0, 1)))(a, b)
        assert "jaxnn_onednn" not in jax.jit(lambda a, b: precision.einsum(spec, a, b)).lower(a, b).as_text()
    with onednn.use(True):
        fn = jax.jit(lambda a, b: precision.einsum(spec, a, b))
        assert "jaxnn_onednn_matmul" in fn.lower(a, b).as_text()
        assert_close(fn(a, b), expected, jnp.float32)
        loss = lambda a, b: jnp.sum(precision.einsum(spec, a, b) * ct)  # noqa: E731
        grad_hlo = jax.jit(jax.grad(loss, (0, 1))).lower(a, b).as_text()
        assert grad_hlo.count("jaxnn_onednn_matmul") == 2  # both gradients (the unused product is dropped)
        grads = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    for got, want in zip(grads, ref):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_float32_product_gradients_match_finite_differences():
    a, b = rand((3, 4), jnp.float32, 20), rand((4, 5), jnp.float32, 21)
    with onednn.use(True):
        check_grads(
            lambda a, b: precision.einsum("mk,kn->mn", a, b), (a, b), order=1, modes=["rev"], atol=1e-2, rtol=1e-2
        )


def test_default_is_this_machines_measured_choice_per_kind(monkeypatch):
    from jaxnn.kernels.onednn import choice

    monkeypatch.delenv("JAXNN_ONEDNN", raising=False)
    measured = {"conv_f32": True, "conv_bf16": False, "matmul_f32": False, "matmul_bf16": True}
    monkeypatch.setattr(choice, "default_choices", lambda *_: measured)
    assert onednn.enabled("conv", jnp.float32) and not onednn.enabled("matmul", jnp.float32)
    assert onednn.enabled("matmul", jnp.bfloat16) == onednn.supports_bf16() and not onednn.enabled("conv", jnp.bfloat16)
    assert not onednn.enabled("conv", jnp.float16)  # no kernels for it
    x, w = rand((2, 6, 6, 8), jnp.float32, 22), rand((3, 3, 8, 4), jnp.float32, 23)
    layer = L.Conv(4, 3)
    _, p, _ = init_model(layer, jax.random.key(0), x.shape)
    assert "jaxnn_onednn_conv" in jax.jit(lambda p, x: run(layer, p, x)[0]).lower(p, x).as_text()
    assert "jaxnn_onednn" not in jax.jit(precision.dense).lower(x[0, 0], w[0, 0]).as_text()
    monkeypatch.setenv("JAXNN_ONEDNN", "0")  # the switch overrides the measurement
    assert not onednn.enabled("conv", jnp.float32)
    with pytest.raises(ValueError, match="kind is 'conv' or 'matmul'"):
        onednn.enabled("attention")


@pytest.mark.slow
def test_the_measurement_is_made_once_per_machine_and_read_from_its_cache(tmp_path):
    # A child process with no switch measures (saying so on stderr) and caches; the next one reads the cache.
    code = (
        "import jax.numpy as jnp; from jaxnn.kernels import onednn; from jaxnn.kernels.onednn import choice; "
        "print(sorted(choice.default_choices(onednn.version()).items()), onednn.enabled('conv', jnp.float32))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAXNN_ONEDNN", "XLA_FLAGS")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)]
    runs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300))
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert "timing oneDNN's kernels against XLA's on this CPU, once" in runs[0].stderr
    assert "timing oneDNN" not in runs[1].stderr and runs[0].stdout == runs[1].stdout
    (cached,) = (tmp_path / "jaxnn" / "onednn").glob("choice-*.json")
    record = json.loads(cached.read_text())
    assert set(record["choices"]) == {"conv_f32", "conv_bf16", "matmul_f32", "matmul_bf16"}
    for kind, row in record["rows"].items():
        assert "skipped" in row or (row["xla_ms"] > 0 and row["onednn_ms"] > 0)
        assert record["choices"][kind] == ("ratio" in row and row["ratio"] < record["margin"])
    assert str(record["choices"]["conv_f32"]) in runs[0].stdout.split("]")[-1]


@pytest.mark.parametrize("module", ["jaxnn.profile.onednn_calibration", "jaxnn.kernels.onednn.calibrate"])
def test_the_measurement_runs_by_its_name_and_its_former_name(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: python -m jaxnn.profile.onednn_calibration" in done.stdout


@needs_bf16
def test_matmul_bf16_result_and_vmap():
    a, b = rand((4, 8, 16), jnp.bfloat16, 13), rand((4, 16, 8), jnp.bfloat16, 14)
    out = jax.jit(lambda a, b: onednn.matmul(a, b, dtype=jnp.bfloat16))(a, b)
    assert out.dtype == jnp.bfloat16
    assert_close(out, jnp.matmul(a, b, preferred_element_type=jnp.float32), jnp.bfloat16)
    c = rand((4, 8, 16), jnp.bfloat16, 15)
    mapped = jax.jit(jax.vmap(lambda a, c: onednn.einsum("mk,nk->mn", a, c)))(a, c)
    assert_close(mapped, jnp.einsum("bmk,bnk->bmn", a, c, preferred_element_type=jnp.float32), jnp.float32)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_conv_layer_onednn_lowering_matches_xla_and_auto_follows_the_switch(policy):
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    pol = precision.get_policy(policy)
    layers = {lw: L.Conv(4, 3, strides=2, lowering=lw) for lw in ("xla", "onednn", "auto")}

    def grad_fn(layer):
        return jax.jit(
            jax.value_and_grad(lambda p, x: jnp.sum(run(layer, p, x, policy=pol)[0].astype(jnp.float32) ** 2))
        )

    def takes_onednn(channels):
        x = rand((2, 9, 9, channels), dtype, 16)
        _, params, _ = init_model(layers["auto"], jax.random.key(0), x.shape)
        return "jaxnn_onednn_conv_fwd" in grad_fn(layers["auto"]).lower(params, x).as_text()

    x = rand((2, 9, 9, 8), dtype, 15)
    _, params, _ = init_model(layers["xla"], jax.random.key(0), x.shape)
    want, got = grad_fn(layers["xla"])(params, x), grad_fn(layers["onednn"])(params, x)
    assert_close(got[0], want[0], dtype)
    assert_close(got[1]["w"], want[1]["w"], dtype)
    for flag in (False, True):
        with onednn.use(flag):
            # bf16 stays on im2col where oneDNN has no bf16 kernels for this CPU (and "onednn" falls back too).
            assert takes_onednn(8) == (flag and (dtype == jnp.float32 or onednn.supports_bf16()))
            assert not takes_onednn(3)  # an image stem (fewer than 8 channels) keeps im2col under "auto"


def test_exports_for_cuda_and_from_jaxnn_export_have_no_onednn_call():
    layer = L.Conv(4, 3, lowering="onednn")
    _, params, _ = init_model(layer, jax.random.key(0), (2, 8, 8, 3))

    def fn(p, x):
        return run(layer, p, x)[0]

    x = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
    cuda = jax.export.export(jax.jit(fn), platforms=["cuda"])(params, x).mlir_module()
    assert "jaxnn_onednn" not in cuda and "stablehlo.convolution" in cuda
    assert "jaxnn_onednn_conv_fwd" in jax.jit(fn).lower(params, x).as_text()
    with onednn.use(False):  # what jaxnn.export does: its programs run without jaxnn
        assert "jaxnn_onednn" not in jax.jit(lambda p, x: run(L.Conv(4, 3), p, x)[0]).lower(params, x).as_text()


def test_onednn_conv_refuses_feature_groups_and_other_dtypes():
    with pytest.raises(ValueError, match="no feature groups"):
        L.Conv(4, 3, feature_group_count=2, lowering="onednn")
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        onednn.conv(rand((1, 4, 4, 2), jnp.float16), rand((3, 3, 2, 2), jnp.float16), (1, 1), [(1, 1)] * 2, (1, 1))


@pytest.mark.skipif(onednn.supports_bf16(), reason="oneDNN has bfloat16 kernels for this CPU")
def test_without_bf16_kernels_bf16_stays_on_xla_and_direct_calls_say_why():
    a = rand((8, 16), jnp.bfloat16)
    with onednn.use(True):
        assert "jaxnn_onednn" not in jax.jit(lambda a: precision.einsum("mk,nk->mn", a, a)).lower(a).as_text()
    with pytest.raises(RuntimeError, match="no bfloat16 kernels for this CPU"):
        onednn.matmul(a, a, trans_b=True)
    x, w = rand((1, 4, 4, 8), jnp.bfloat16), rand((3, 3, 8, 2), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="onednn conv: .* no bfloat16 kernels for this CPU"):
        onednn.conv(x, w, (1, 1), [(1, 1)] * 2, (1, 1))


def test_switch_reads_the_environment_and_use_overrides_it(monkeypatch):
    monkeypatch.setenv("JAXNN_ONEDNN", "1")
    assert onednn.enabled()
    monkeypatch.setenv("JAXNN_ONEDNN", "0")
    assert not onednn.enabled()
    with onednn.use(True):
        assert onednn.enabled()
    assert onednn.version() and onednn.version().startswith("3.")


@pytest.mark.system
def test_without_the_library_everything_runs_on_xla_and_onednn_lowering_says_why(tmp_path):
    code = (
        "import jax, jax.numpy as jnp, jaxnn.layers as L; from jaxnn.kernels import onednn; "
        "from jaxnn.layers.core import init_model, run; "
        "layer = L.Conv(2, 3); _, p, _ = init_model(layer, jax.random.key(0), (1, 4, 4, 1)); "
        "print(run(layer, p, jnp.ones((1, 4, 4, 1)))[0].shape, onednn.available()); L.Conv(2, 3, lowering='onednn')"
    )
    env = {**os.environ, "JAXNN_ONEDNN_LIBRARY": str(tmp_path / "missing.so"), "JAXNN_ONEDNN": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "(1, 4, 4, 2) False" in done.stdout, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Conv: lowering='onednn' is not available") and "make install" in last


@pytest.mark.system
def test_bench_peers_runs_jaxnn_with_the_kernels(tmp_path):
    # `make bench-onednn` times jaxnn with and without the kernels through benchmarks.peers; the smallest run of it.
    out = tmp_path / "peers.json"
    prec = "bf16" if onednn.supports_bf16() else "fp32"
    cmd = ["-m", "benchmarks.peers", "--peers", "jaxnn", "jaxnn_onednn", "--models", "tiny", "--precisions", prec]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, *cmd, "--repeats", "2", "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    medians = {row["library"]: row["step_ms"] for row in json.loads(out.read_text())["median_ms"]}
    assert set(medians) == {"jaxnn", "jaxnn_onednn"} and all(ms and ms > 0 for ms in medians.values())


def test_a_raw_jax_export_of_the_kernels_is_refused_naming_them_and_works_with_them_off():
    # docs/checkpoints.md tells users of jax.export to trace with the kernels off; jaxnn.export does it for them.
    layer = L.Conv(8, 3)
    _, p, _ = init_model(layer, jax.random.key(0), (1, 6, 6, 8))
    x = jnp.ones((1, 6, 6, 8))

    def forward():  # a new function each time: jit reuses a trace, and the switch is read when tracing
        return jax.jit(lambda p, x: run(layer, p, x)[0])

    with onednn.use(True), pytest.raises(ValueError, match="jaxnn_onednn_conv_fwd"):
        jax.export.export(forward())(p, x)
    with onednn.use(False):
        assert jax.export.export(forward())(p, x).out_avals[0].shape == (1, 6, 6, 8)

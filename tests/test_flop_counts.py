"""FLOP counts (`jaxnn.profile.timing.cost_counts`, what the layer table, `jaxnn profile`, the benchmarks and the
projections read) say what a model computes, not which kernel runs it: with the oneDNN kernels on and off a
convolution, a dense layer, the CNN and the GPT count alike, and a convolution counts the textbook 2 FLOPs per
multiply-add. The "on" cases are skipped where the kernels are not built."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxnn import layers as L
from jaxnn import train
from jaxnn._src import kernel_cost
from jaxnn.kernels import onednn
from jaxnn.kernels.onednn.library import TARGETS
from jaxnn.layers.core import init_model, run
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig
from jaxnn.profile.timing import cost_counts

ON = pytest.param(True, id="onednn", marks=pytest.mark.skipif(not onednn.available(), reason="no oneDNN kernels"))
ON_AND_OFF = [pytest.param(False, id="xla"), ON]


def counted(fn, *args, onednn_on: bool) -> tuple[float, str]:
    """(FLOPs, HLO text) of `fn(*args)` traced with the oneDNN kernels on or off. A new function each time: jax
    caches traces per function, and the switch is read when tracing."""
    with onednn.use(onednn_on):
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    flops = cost_counts(compiled)[0]
    assert flops is not None
    return flops, compiled.as_text()


def layer_fn(layer, in_shape):
    _, params, _ = init_model(layer, jax.random.key(0), in_shape)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(in_shape), jnp.float32)
    return lambda params, x: run(layer, params, x)[0], (params, x)


@pytest.mark.parametrize("onednn_on", ON_AND_OFF)
@pytest.mark.parametrize("kernel_size", [1, 3])
def test_a_same_convolution_counts_the_textbook_flops_forward_and_backward(onednn_on, kernel_size):
    n, h, w, c_in, c_out = 4, 12, 12, 8, 16
    fn, args = layer_fn(L.Conv(c_out, kernel_size, padding="SAME", use_bias=False), (n, h, w, c_in))
    textbook = 2 * n * h * w * kernel_size**2 * c_in * c_out
    forward, text = counted(fn, *args, onednn_on=onednn_on)
    assert ("jaxnn_onednn_conv_fwd" in text) == onednn_on
    assert forward == pytest.approx(textbook, rel=1e-6)

    grads = jax.grad(lambda params, x: jnp.sum(fn(params, x)), argnums=(0, 1))
    backward, _ = counted(grads, *args, onednn_on=onednn_on)
    # Both gradients, the textbook count each; im2col's input gradient also adds its taps' parts back up.
    assert backward == pytest.approx(2 * textbook, rel=0.07)


@pytest.mark.parametrize(
    "make, in_shape",
    [
        (lambda: L.Conv(16, 3, padding="SAME"), (4, 12, 12, 8)),
        # Wider: im2col's input gradient adds up its taps' parts, ~1/Cout of the products' FLOPs that oneDNN's
        # kernel adds within the products.
        (lambda: L.Conv(64, 3, strides=2, padding="VALID"), (4, 13, 13, 16)),
        (lambda: L.Dense(256), (64, 512)),
    ],
    ids=["conv", "strided-conv", "dense"],
)
@pytest.mark.parametrize("with_grad", [False, True], ids=["forward", "gradient"])
def test_a_layer_counts_alike_on_onednn_and_on_xla(make, in_shape, with_grad):
    if not onednn.available():
        pytest.skip("no oneDNN kernels")
    fn, args = layer_fn(make(), in_shape)
    if with_grad:
        fn = jax.grad(lambda params, x, f=fn: jnp.sum(f(params, x)), argnums=(0, 1))
    on, text = counted(fn, *args, onednn_on=True)
    off, _ = counted(fn, *args, onednn_on=False)
    assert "jaxnn_onednn" in text
    assert on == pytest.approx(off, rel=0.02)


def test_a_dense_layer_counts_the_textbook_flops():
    fn, args = layer_fn(L.Dense(256), (64, 512))
    flops, _ = counted(fn, *args, onednn_on=onednn.available())
    assert flops == pytest.approx(2 * 64 * 512 * 256, rel=0.02)


@pytest.mark.parametrize(
    "model, in_shape, loss",
    [
        (CNN(CNNConfig().small()), (8, 16, 16, 1), train.classification_loss),
        # The GPT's attention and layer products count the same way as the CNN's dense layers: make test-all.
        pytest.param(GPT(GPTConfig().small()), (4, 32), train.language_model_loss, marks=pytest.mark.slow),
    ],
    ids=["cnn", "gpt"],
)
def test_a_training_step_counts_alike_on_onednn_and_on_xla(model, in_shape, loss):
    if not onednn.available():
        pytest.skip("no oneDNN kernels")
    tx = optax.sgd(0.1)
    if len(in_shape) == 2:
        batch = {"x": jnp.zeros(in_shape, jnp.int32), "y": jnp.zeros(in_shape, jnp.int32)}
    else:
        batch = {"x": jnp.zeros(in_shape, jnp.float32), "y": jnp.zeros(in_shape[:1], jnp.int32)}
    counts = {}
    for on in (True, False):
        with onednn.use(on):
            state = train.create_train_state(model, tx, jax.random.key(0), in_shape, "fp32")
            compiled = train.make_train_step(model, loss, tx, "fp32").lower(state, batch).compile()
        counts[on] = cost_counts(compiled)[0]
        assert ("jaxnn_onednn" in compiled.as_text()) == on
    assert counts[True] == pytest.approx(counts[False], rel=0.02)


# A compiled program's custom calls as XLA prints them (names with %) and a lowered one's (names without).
COMPILED = """
  %g = f32[2,8,8,16]{3,2,1,0} parameter(0)
  %w.1 = f32[3,3,4,16]{3,2,1,0} parameter(1)
  %x.1 = f32[2,8,8,4]{3,2,1,0} parameter(2)
  %ffi_call.2 = f32[2,8,8,4]{3,2,1,0} custom-call(%g, %w.1), custom_call_target="jaxnn_onednn_conv_bwd_data", \
backend_config={dilation = dense<1> : tensor<2xi64>, pad_hi = dense<1> : tensor<2xi64>}
  ROOT %ffi_call.3 = f32[3,3,4,16]{3,2,1,0} custom-call(%x.1, %g), custom_call_target="jaxnn_onednn_conv_bwd_weights"
"""
LOWERED = """
  a.1 = bf16[4,5,8]{2,1,0} parameter(0)
  b.1 = bf16[4,5,7]{2,1,0} parameter(1)
  ROOT ffi_call.1 = f32[4,8,7]{2,1,0} custom-call(a.1, b.1), custom_call_target="jaxnn_onednn_matmul", \
backend_config={trans_a = 1 : i64, trans_b = 0 : i64}
  other = f32[4]{0} custom-call(a.1), custom_call_target="somebody_elses_kernel"
"""


def test_kernel_costs_reads_the_kernels_from_their_shapes():
    conv_flops = 2 * (2 * 8 * 8 * 16) * (3 * 3 * 4)
    conv_bytes = 4 * (2 * 8 * 8 * 4 + 3 * 3 * 4 * 16 + 2 * 8 * 8 * 16)
    assert kernel_cost.kernel_costs(COMPILED) == (2 * conv_flops, 2 * conv_bytes, 2)
    matmul_bytes = 2 * (4 * 5 * 8 + 4 * 5 * 7) + 4 * (4 * 8 * 7)
    assert kernel_cost.kernel_costs(LOWERED) == (2 * 4 * 8 * 7 * 5, matmul_bytes, 1)
    assert kernel_cost.kernel_costs("") == (0.0, 0.0, 0)


def test_kernel_costs_knows_every_kernel_target():
    assert {target: kernel for kernel, target in TARGETS.items()} == kernel_cost.KERNELS


def test_the_counts_keep_their_public_names():
    # Counted in jaxnn._src (below the layers' summary); the profiler's modules keep the names users imported.
    from jaxnn._src import xla_cost
    from jaxnn.profile import kernel_cost as public_kernel_cost
    from jaxnn.profile import timing

    assert (timing.cost_counts, timing.flops_of, timing.compiled_flops) == (
        xla_cost.cost_counts,
        xla_cost.flops_of,
        xla_cost.compiled_flops,
    )
    assert (
        public_kernel_cost.kernel_costs is kernel_cost.kernel_costs
        and public_kernel_cost.KERNELS is kernel_cost.KERNELS
    )

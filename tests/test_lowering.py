"""The "auto" lowerings (Conv im2col, MaxPool reshape, attention cuDNN/f32acc) follow the platform a computation is
lowered for, not the process's default backend: a model traced on this CPU and exported for CUDA carries XLA's
convolution and reduce_window, the same model exported for the CPU carries im2col and the reshape-and-max pool, and
`jax.jit` on the CPU computes bit for bit what the explicit CPU lowerings compute."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn import train
from jaxnn.layers import attention_kernels
from jaxnn.layers.core import init_model, run
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig
from jaxnn.precision import BF16, FP32

CNN_CFG = CNNConfig().small()
CNN_SHAPE = (2, 8, 8, 1)
GPT_CFG = GPTConfig().small()
GPT_SHAPE = (2, 16)

# A product's operand and result element types, from its one-line StableHLO form.
PRODUCT = re.compile(
    r"stablehlo\.(dot_general|convolution).*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>"
)
# A reduce_window and the first op of its body (the reducer).
REDUCE_WINDOW = re.compile(r'"stablehlo\.reduce_window".*\n.*\^bb0.*\n\s*%\S+ = stablehlo\.(\w+)')
# The reshape-and-max pool: a max over the window axes (2, 4) of the tiled (N, H/2, 2, W/2, 2, C) input.
TILE_MAX = re.compile(r"stablehlo\.reduce\(.*applies stablehlo\.maximum across dimensions = \[2, 4\]")


def ops(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))


def products(text: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(PRODUCT.search, text.splitlines()) if m]


def im2col_patch_types() -> list[str]:
    """The (N * H * W, 9 * C_in) bf16 patch matrix each 3x3 SAME Conv of the small CNN contracts under im2col."""
    types, size, channels = [], CNN_SHAPE[1], CNN_SHAPE[-1]
    for width in CNN_CFG.widths:
        types.append(f"tensor<{CNN_SHAPE[0] * size * size}x{9 * channels}xbf16>")
        size, channels = -(-size // 2), width  # MaxPool(2, SAME) halves, rounding up
    return types


def random_params(model, shape):
    """Random parameters of the model's structure, drawn by numpy: jax's init would compile every random op
    (eagerly) or an init program (jitted), seconds on this CPU."""
    shapes = jax.eval_shape(lambda k: init_model(model, k, shape)[1], jax.random.key(0))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype), shapes)


def exported_module(model, shape, dtype, platform, policy="bf16"):
    # Exporting needs only shapes and dtypes: no parameters are initialised (eager init costs seconds here).
    params, state = jax.eval_shape(lambda k: init_model(model, k, shape)[1:], jax.random.key(0))
    x = jax.ShapeDtypeStruct(shape, dtype)
    exported = jax.export.export(train.make_predict(model, policy), platforms=[platform])(params, state, x)
    return exported.mlir_module()


@pytest.fixture(scope="module")
def cnn_modules():
    model = CNN(CNN_CFG)
    return {p: exported_module(model, CNN_SHAPE, jnp.float32, p) for p in ("cuda", "cpu")}


def test_cnn_exported_for_cuda_has_xla_convolutions_and_reduce_window(cnn_modules):
    text, n = cnn_modules["cuda"], len(CNN_CFG.widths)
    counts = ops(text)
    assert counts["convolution"] == n, counts  # one XLA convolution per Conv
    assert REDUCE_WINDOW.findall(text) == ["maximum"] * n  # one max reduce_window per MaxPool
    # No im2col: no tap concatenate, no dot_general over a patch matrix; no reshape pool.
    assert counts["concatenate"] == 0, counts
    assert not any(t in text for t in im2col_patch_types())
    assert not TILE_MAX.search(text)
    # bf16 operands everywhere: the dot (the classifier's Dense) with an f32 result, the convolutions with a bf16
    # one (a wider result would make XLA's GPU compiler upcast their operands; cuDNN accumulates in f32 inside).
    types = products(text)
    assert collections.Counter(t[0] for t in types) == {"convolution": n, "dot_general": 1}, types
    assert {t[1:] for t in types if t[0] == "dot_general"} == {("bf16", "bf16", "f32")}, types
    assert {t[1:] for t in types if t[0] == "convolution"} == {("bf16", "bf16", "bf16")}, types


def test_cnn_exported_for_cpu_has_im2col_and_reshape_pool(cnn_modules):
    # The same model, the same process: only the platform differs, so the choice follows it.
    text, n = cnn_modules["cpu"], len(CNN_CFG.widths)
    counts = ops(text)
    assert counts["convolution"] == 0 and counts["reduce_window"] == 0, counts
    assert counts["concatenate"] == n, counts
    for patches in im2col_patch_types():
        assert re.search(rf"stablehlo\.dot_general .*: \({re.escape(patches)}, ", text), patches
    assert len(TILE_MAX.findall(text)) == n
    assert {t[1:] for t in products(text)} == {("bf16", "bf16", "f32")}


def test_gpt_exported_for_cuda_has_mixed_precision_products():
    text = exported_module(GPT(GPT_CFG), GPT_SHAPE, jnp.int32, "cuda")
    types = products(text)
    assert types and set(types) == {("dot_general", "bf16", "bf16", "f32")}, types
    q = jnp.ones((GPT_SHAPE[0], GPT_SHAPE[1], GPT_CFG.num_heads, GPT_CFG.d_model // GPT_CFG.num_heads), jnp.bfloat16)
    # jax traces cuDNN attention only where its CUDA plugin finds cuDNN; then "auto" takes it for CUDA, otherwise
    # (this CPU-only jax) the CUDA lowering gets the f32-accumulating path.
    has_cudnn = "__cudnn$fmha" in text
    assert has_cudnn == attention_kernels._cudnn_traces(q, q, q, None, True)


def test_attention_auto_follows_the_lowering_platform(monkeypatch, key):
    """Stand jax's XLA attention in for cuDNN (which a CPU-only jax cannot trace): exported for CUDA, "auto" takes the
    CUDA branch (probs @ values in bf16, as jax's XLA path computes it); for the CPU, the f32acc path (f32 result)."""
    real = attention_kernels._attention
    monkeypatch.setattr(attention_kernels, "_cudnn_traces", lambda *_: True)
    monkeypatch.setattr(attention_kernels, "_attention", lambda impl, *a: real("xla" if impl == "cudnn" else impl, *a))
    layer = L.MultiHeadAttention(2, causal=True)
    params = jax.eval_shape(lambda k: layer.init(k, (2, 6, 8))[1], key)

    def fn(p, x):
        return layer.apply(BF16.cast_to_compute(p), x.astype(jnp.bfloat16), policy=BF16)

    x = jax.ShapeDtypeStruct((2, 6, 8), jnp.float32)
    results = {}
    for platform in ("cuda", "cpu"):
        text = jax.export.export(jax.jit(fn), platforms=[platform])(params, x).mlir_module()
        results[platform] = collections.Counter(t[3] for t in products(text))
    assert results["cuda"]["bf16"] == 1, results  # jax's XLA attention: probs @ values bf16 x bf16 -> bf16
    assert set(results["cpu"]) == {"f32"}, results  # f32acc: every product bf16 x bf16 -> f32


def test_multi_platform_export_runs_on_the_cpu():
    """Exported for both platforms, the program carries both branches behind a platform check; on the CPU it runs
    the CPU branch."""
    model = L.serial(L.Conv(4, 3), L.MaxPool(2))
    params = random_params(model, (1, 4, 4, 2))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 4, 2)), jnp.float32)
    exported = jax.export.export(jax.jit(model.apply), platforms=["cpu", "cuda"])(params, x)
    text = exported.mlir_module()
    assert "stablehlo.convolution" in text and "stablehlo.concatenate" in text  # both Conv branches are there
    np.testing.assert_allclose(exported.call(params, x), model.apply(params, x), rtol=1e-6, atol=1e-6)


def explicit_cpu_cnn() -> L.Layer:
    """models.CNN with the CPU lowerings named: what "auto" computed on the CPU before it followed the platform."""
    stages = [
        layer
        for width in CNN_CFG.widths
        for layer in (
            L.Conv(width, 3, padding="SAME", lowering="im2col"),
            L.Relu,
            L.MaxPool(2, padding="SAME", lowering="reshape"),
        )
    ]
    return L.serial(*stages, L.Flatten(), L.Dense(CNN_CFG.num_classes, name="logits"), name="cnn")


@pytest.mark.parametrize("policy", [FP32, BF16], ids=["fp32", "bf16"])
def test_cpu_jit_of_auto_is_bitwise_the_explicit_cpu_lowering(policy):
    auto, explicit = CNN(CNN_CFG), explicit_cpu_cnn()
    params = random_params(auto, CNN_SHAPE)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(CNN_SHAPE), jnp.float32)

    def value_and_grad(model):
        def fn(p, x):
            y, _ = run(model, policy.cast_to_compute(p), policy.cast_to_compute(x), policy=policy)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.value_and_grad(fn, argnums=(0, 1))

    # Two programs, as before and after: the forward value and both gradients must agree bit for bit.
    compiled = jax.jit(value_and_grad(auto)).lower(params, x).compile()
    got_auto, got_explicit = compiled(params, x), jax.jit(value_and_grad(explicit))(params, x)
    for a, b in zip(jax.tree.leaves(got_auto), jax.tree.leaves(got_explicit), strict=True):
        np.testing.assert_array_equal(a, b)
    # platform_dependent stages out a conditional on a constant platform index holding only the lowering platform's
    # branch; XLA folds it away, so the compiled CPU program (forward and gradients) has no conditional left.
    assert not re.search(r"\bconditional\(", compiled.as_text())


@pytest.mark.parametrize("dtype, cpu_impl", [(jnp.float32, "blocked"), (jnp.bfloat16, "f32acc")])
def test_cpu_jit_of_auto_attention_is_bitwise_the_explicit_one(dtype, cpu_impl):
    auto, explicit = (L.MultiHeadAttention(2, causal=True, implementation=i) for i in ("auto", cpu_impl))
    params = jax.tree.map(lambda p: p.astype(dtype), random_params(auto, (2, 6, 8)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 8)), dtype)
    policy = BF16 if dtype == jnp.bfloat16 else FP32
    y_auto = jax.jit(lambda p, x: auto.apply(p, x, policy=policy))(params, x)
    y_explicit = jax.jit(lambda p, x: explicit.apply(p, x, policy=policy))(params, x)
    np.testing.assert_array_equal(y_auto, y_explicit)


# ------------------------------------------------------------------------------------ whole steps lowered for CUDA
# What a GPU run would compile, checked on this CPU: the bf16 train steps lowered for CUDA
# (`jit(...).trace(...).lower(lowering_platforms=("cuda",))`) and read as StableHLO.


@pytest.fixture
def cudnn_present(monkeypatch):
    """jax checks for cuDNN (through its CUDA plugin) and the GPU's compute capability when it traces cuDNN
    attention; stand in an H200's answers (cuDNN 9.10, Hopper), so the CUDA lowering can take the fused kernel."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda capability: False)


def cuda_train_step_module(model, in_shape, in_dtype, loss) -> str:
    tx = train.make_optimizer(1e-3, total_steps=10)
    state = jax.eval_shape(lambda k: train.create_train_state(model, tx, k, in_shape, "bf16"), jax.random.key(0))
    batch = {
        "x": jax.ShapeDtypeStruct(in_shape, in_dtype),
        "y": jax.ShapeDtypeStruct(in_shape[:2] if in_dtype == jnp.int32 else in_shape[:1], jnp.int32),
    }
    step = train.make_train_step(model, loss, tx, "bf16")
    return step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()


def assert_no_cpu_only_lowering(text: str) -> None:
    assert "optimization_barrier" not in text  # the CPU's bf16-dot workaround would serialise GPU transposes
    assert not TILE_MAX.search(text)  # the CPU's reshape-and-max pool


def test_bf16_gpt_train_step_lowered_for_cuda(cudnn_present):
    text = cuda_train_step_module(GPT(GPT_CFG), GPT_SHAPE, jnp.int32, train.language_model_loss)
    types = collections.Counter(products(text))
    # Forward and both backward products of every projection: bf16 operands, f32 result (tensor cores).
    assert set(types) == {("dot_general", "bf16", "bf16", "f32")}, types
    assert types[("dot_general", "bf16", "bf16", "f32")] >= 3 * 4 * GPT_CFG.num_layers, types
    # Attention is cuDNN's fused kernel, forward and backward, on bf16 operands.
    calls = re.findall(r"stablehlo\.custom_call @(__cudnn\$fmha\w+)\((.*)", text)
    assert collections.Counter(name for name, _ in calls) == {
        "__cudnn$fmhaSoftmax": GPT_CFG.num_layers,
        "__cudnn$fmhaSoftmaxBackward": GPT_CFG.num_layers,
    }, calls
    forward = [rest for name, rest in calls if name == "__cudnn$fmhaSoftmax"]
    assert all(re.search(r": \(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>, tensor<[^>]*xbf16>", r) for r in forward)
    assert_no_cpu_only_lowering(text)


def test_a_packed_bf16_gpt_step_keeps_cudnns_fused_attention_for_cuda(cudnn_present):
    """Packed batches (`segment_ids`) keep attention on cuDNN's fused kernel, the documents' boundaries passed to it
    as a (B, 1, T, T) bias; whether that costs MFU is gpu-check's packed row (benchmarks.train_steps.gpu_mfu)."""
    model, tx, shape = GPT(GPT_CFG), train.make_optimizer(1e-3, total_steps=10), GPT_SHAPE
    state = jax.eval_shape(lambda k: train.create_train_state(model, tx, k, shape, "bf16"), jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("x", "y", "segment_ids", "positions")}
    step = train.make_train_step(model, train.language_model_loss, tx, "bf16")
    text = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(__cudnn\$fmha\w+)\((.*)", text)
    assert collections.Counter(name for name, _ in calls) == {
        "__cudnn$fmhaScaleBiasSoftmax": GPT_CFG.num_layers,
        "__cudnn$fmhaScaleBiasSoftmaxBackward": GPT_CFG.num_layers,
    }, calls
    T = shape[1]
    forward = [rest for name, rest in calls if name == "__cudnn$fmhaScaleBiasSoftmax"]
    assert all(f"tensor<{shape[0]}x1x{T}x{T}xbf16>) ->" in rest for rest in forward), forward[0][-300:]
    assert set(products(text)) == {("dot_general", "bf16", "bf16", "f32")}, products(text)
    assert_no_cpu_only_lowering(text)


def test_bf16_cnn_train_step_lowered_for_cuda():
    text = cuda_train_step_module(CNN(CNN_CFG), CNN_SHAPE, jnp.float32, train.classification_loss)
    types = collections.Counter(products(text))
    n = len(CNN_CFG.widths)
    # Each Conv: the forward and its two backward convolutions (the first layer's input gradient is not needed),
    # all bf16 x bf16 -> bf16: a wider result would make XLA's GPU compiler upcast the operands to f32.
    assert types[("convolution", "bf16", "bf16", "bf16")] == 3 * n - 1, types
    assert {t for t in types if t[0] == "convolution"} == {("convolution", "bf16", "bf16", "bf16")}, types
    # The only dots are the classifier's forward and two backward products: no im2col patch matrix is contracted
    # (its residuals appear only as the zero placeholders platform_dependent gives the branch not taken).
    assert types[("dot_general", "bf16", "bf16", "f32")] == 3 and sum(types.values()) == 3 * n - 1 + 3, types
    # XLA's convolution and reduce_window, not the CPU's im2col taps and reshape pool.
    assert ops(text)["concatenate"] == 0
    assert REDUCE_WINDOW.findall(text).count("maximum") == n
    assert_no_cpu_only_lowering(text)


def test_bf16_attention_lowered_for_cuda_takes_cudnn(cudnn_present, key):
    layer = L.MultiHeadAttention(2, causal=True)
    params = jax.eval_shape(lambda k: layer.init(k, (2, 16, 32))[1], key)

    def loss(p, x):
        y = layer.apply(BF16.cast_to_compute(p), x.astype(jnp.bfloat16), policy=BF16)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    text = jax.jit(jax.grad(loss)).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
    assert set(products(text)) == {("dot_general", "bf16", "bf16", "f32")}, products(text)
    assert_no_cpu_only_lowering(text)


SCATTER_OPERAND = re.compile(r'"stablehlo\.scatter"\(.*?\}\) : \(tensor<([^>]+)>', re.S)


def test_a_half_precision_embedding_gradient_is_summed_in_f32_where_lowered_for_gpus():
    """GPUs add bf16 to memory with compare-and-swap loops that serialise on frequent ids; the embedding lookup
    upcasts its table where the step is lowered for CUDA, so its gradient's scatter-add is an f32 one."""
    import optax

    model, tx, shape = GPT(GPT_CFG), optax.adam(1e-3), (2, GPT_CFG.seq_len)
    state = jax.eval_shape(lambda k: train.create_train_state(model, tx, k, shape, "bf16"), jax.random.key(0))
    batch = {"x": jax.ShapeDtypeStruct(shape, jnp.int32), "y": jax.ShapeDtypeStruct(shape, jnp.int32)}
    step = train.make_train_step(model, train.language_model_loss, tx, "bf16")
    table = f"{GPT_CFG.vocab_size}x{GPT_CFG.d_model}x"
    for platform, dtype in (("cuda", "f32"), ("cpu", "bf16")):
        text = step.trace(state, batch).lower(lowering_platforms=(platform,)).as_text()
        assert [t for t in SCATTER_OPERAND.findall(text) if t.startswith(table)] == [table + dtype], platform


def test_the_f32_accumulating_lookup_reads_the_same_rows_and_sums_repeats_more_exactly():
    from jaxnn.layers import linear

    table = jax.random.normal(jax.random.key(0), (16, 8), jnp.bfloat16)
    ids = jnp.array([[0, 3, 3, 3, 3, 3, 15, 2, 16]])  # 16: past the end, a NaN row in both
    cotangent = jax.random.normal(jax.random.key(1), (1, ids.shape[1], 8), jnp.float32)
    # bf16-representable, as the cotangent of a bf16 lookup is: the f32 sum of a few of them is then exact.
    cotangent = cotangent.at[:, -1].set(0.0).astype(jnp.bfloat16).astype(jnp.float32)
    plain, f32 = linear._take(table, ids), linear._take_accumulating_in_f32(table, ids)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(f32, np.float32))
    grads = {
        name: jax.grad(lambda t, fn=fn: jnp.sum(jnp.nan_to_num(fn(t, ids).astype(jnp.float32)) * cotangent))(table)
        for name, fn in (("plain", linear._take), ("f32", linear._take_accumulating_in_f32))
    }
    exact = np.zeros((16, 8))
    np.add.at(exact, np.asarray(ids[0, :-1]), np.asarray(cotangent[0, :-1], np.float64))
    assert grads["f32"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grads["f32"], np.float32), exact.astype(jnp.bfloat16).astype(np.float32))
    # The bf16 scatter rounds after every repeated id: never closer to the exact sum than one rounding at the end.
    assert (
        np.abs(np.asarray(grads["plain"], np.float64) - exact).max()
        >= np.abs(np.asarray(grads["f32"], np.float64) - exact).max()
    )

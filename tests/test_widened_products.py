"""bf16 products widened to float32 on CPUs without bf16 instructions (`jaxnn._src.widened_products`): the same
values as the bf16 form, float32 dots in the program lowered for the CPU, the bf16 form everywhere else."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn import precision
from jaxnn._src import cpu, widened_products


def _operands(shape_a=(48, 40), shape_b=(40, 24)):
    keys = jax.random.split(jax.random.key(3), 2)
    return tuple(jax.random.normal(k, s).astype(jnp.bfloat16) for k, s in zip(keys, (shape_a, shape_b)))


def _dot_operand_types(text: str) -> list[str]:
    """The element types of each dot_general's operands in a StableHLO text."""
    return re.findall(r"stablehlo\.dot_general.*?: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", text)


def test_only_bf16_is_widened_and_only_without_bf16_instructions(monkeypatch):
    assert not widened_products.applies(jnp.bfloat16)  # conftest: the bf16 form
    monkeypatch.setattr(widened_products, "host_bf16_products", lambda: False)
    assert widened_products.applies(jnp.bfloat16)
    assert not widened_products.applies(jnp.float16) and not widened_products.applies(jnp.float32)


def test_the_widened_product_gives_the_bf16_products_values():
    a, b = _operands()
    bf16_form = jnp.einsum("mk,kn->mn", a, b, preferred_element_type=jnp.float32)
    widened = widened_products.einsum("mk,kn->mn", a, b)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)  # every bf16 value is exact in float32
    assert widened.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(widened), exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(widened), np.asarray(bf16_form), rtol=1e-5, atol=1e-5)


def test_a_bf16_einsum_and_its_gradients_widen_for_the_cpu_and_keep_bf16_for_cuda(monkeypatch):
    monkeypatch.setattr(widened_products, "host_bf16_products", lambda: False)
    a, b = _operands()

    def loss(a, b):
        return jnp.sum(jnp.sin(precision.einsum("mk,kn->mn", a, b)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    cpu_text = grad.trace(a, b).lower(lowering_platforms=("cpu",)).as_text()
    cuda_text = grad.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    cpu_dots, cuda_dots = _dot_operand_types(cpu_text), _dot_operand_types(cuda_text)
    assert len(cpu_dots) == len(cuda_dots) == 3  # the forward product and both gradient products
    assert set(cpu_dots) == {("f32", "f32")}
    assert set(cuda_dots) == {("bf16", "bf16")}
    # and the gradients are the bf16 form's, to float32 rounding
    widened = grad(a, b)
    monkeypatch.setattr(widened_products, "host_bf16_products", lambda: True)
    bf16_form = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    for w, f in zip(widened, bf16_form):
        assert w.dtype == f.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(f, np.float32), rtol=2e-2, atol=2e-2)


def test_a_cap_below_avx512_bf16_counts_as_no_bf16_instructions():
    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert cpu.bf16_products(flags, xla_flags="")
    assert not cpu.bf16_products(flags, xla_flags="--xla_cpu_max_isa=AVX2")
    assert not cpu.bf16_products(flags, xla_flags="--xla_cpu_max_isa=avx512")  # XLA reads it in any case
    assert cpu.bf16_products(flags, xla_flags="--xla_cpu_max_isa=AVX2 --xla_cpu_max_isa=AVX512_BF16")  # the last
    assert cpu.bf16_products(frozenset({"amx_bf16"}), xla_flags="--xla_cpu_max_isa=AMX")
    assert not cpu.bf16_products(frozenset({"avx2", "fma"}), xla_flags="")
    assert cpu.xla_isa_cap("--xla_cpu_max_isa=avx2 --xla_backend_optimization_level=1") == "AVX2"
    assert cpu.xla_isa_cap("") is None

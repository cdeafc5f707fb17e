"""Preference tuning: DPO against a reference policy, and SimPO without one, on pairs of responses to one prompt.

A preference batch's `x` is (B, 2, T+1) token ids: row 0 the prompt with the chosen response, row 1 with the
rejected one (padded), and `loss_mask` (B, 2, T) weighs the targets `x[..., 1:]` that belong to the response.
`preference_model(model, objective, reference)` runs the language model on both rows at once and returns each
target's log-probability, (B, 1 or 2, 2, T): the policy's, then (DPO) the reference's; the losses sum them over the
response and compare.

    model = preference_model(gpt, "dpo")                 # under LoRA: the reference is the base, adapters off
    loss = preference_loss("dpo", beta=0.1)              # -log sigmoid(beta * ((pc - rc) - (pr - rr)))

The reference under LoRA is the same params with the adapters taken out (under a stop-gradient): no second copy of
the weights, and the reference pass multiplies by the frozen weights alone. For full fine-tuning it is a frozen copy
of the starting params, held as the preference model's state (`reference=`). SimPO (Meng et al., 2024) is the
reference-free objective: the length-normalised log-probability as the reward, with a target margin `gamma`; it was
chosen over ORPO because it is DPO's loss with the reference pass dropped (half the forward work, no frozen copy)
and needs no second, supervised term whose weight must be tuned beside beta.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxnn.layers.core import Layer, run
from jaxnn.train.losses import integer_label_cross_entropy
from jaxnn.train.state import Batch, LossFn, Metrics

OBJECTIVES = ("dpo", "simpo")
# Adapter arrays (jaxnn.lora's names): without them, Dense computes the base's product alone.
_ADAPTER_KEYS = ("lora_a", "lora_b", "lora_scale")


def adapters_off(params: Any) -> Any:
    """`params` without any LoRA adapter arrays, under a stop-gradient: the base model, sharing the weights'
    buffers (nothing is copied), and no gradient flows back through it."""
    if isinstance(params, dict):
        return {k: adapters_off(v) for k, v in params.items() if k not in _ADAPTER_KEYS}
    if isinstance(params, (list, tuple)):
        return type(params)(adapters_off(v) for v in params)
    return jax.lax.stop_gradient(params)


def _has_adapters(params: Any) -> bool:
    return any(
        getattr(k, "key", None) == "lora_a" for path, _ in jax.tree_util.tree_leaves_with_path(params) for k in path
    )


def token_log_probs(model: Layer, params: Any, ids: jax.Array, **kwargs: Any) -> jax.Array:
    """log p(ids[..., t+1] | ids[..., :t+1]) under `model`, for ids (B, 2, T+1): (B, 2, T), float32."""
    b, pair, length = ids.shape
    logits, _ = run(model, params, ids[..., :-1].reshape(b * pair, length - 1), **kwargs)
    targets = ids[..., 1:].reshape(b * pair, length - 1)
    return -integer_label_cross_entropy(logits, targets).reshape(b, pair, length - 1)


def preference_model(model: Layer, objective: str, reference: Any = None) -> Layer:
    """`model` (a language model: ids (N, T) -> logits (N, T, V)) made into a preference model: x (B, 2, T+1) ->
    the targets' log-probabilities (B, k, 2, T), k = 1 (the policy) or 2 (then the reference's, for DPO). The
    reference is `reference` (a frozen copy of the starting params, for full fine-tuning) or, when it is None, the
    params with their LoRA adapters off. Its params are `model`'s; a `reference` is its model state (so the step
    takes it as an argument, as it takes the params, rather than baking it into the program as a constant, and
    checkpoints keep it)."""
    check_objective(objective)
    if model.stateful:
        raise ValueError(f"{objective}: the model keeps a state (BatchNorm?); preference tuning takes a language model")

    def init(key, in_shape):
        b, pair, length = in_shape
        _, params = model.init(key, (b * pair, length - 1))
        return (b, 2 if objective == "dpo" else 1, pair, length - 1), params

    def log_probs(params, x, frozen, key, train, policy, side):
        policy_lp = token_log_probs(model, params, x, key=key, train=train, policy=policy, **side)
        if objective != "dpo":
            return policy_lp[:, None]
        if frozen is None and not _has_adapters(params):
            raise ValueError(
                "dpo: the params hold no LoRA adapters and no frozen reference was given (preference_model's "
                "reference=): the reference policy would be the policy itself"
            )
        frozen = adapters_off(params) if frozen is None else jax.lax.stop_gradient(frozen)
        if policy is not None:
            frozen = policy.cast_to_compute(frozen)
        reference_lp = jax.lax.stop_gradient(token_log_probs(model, frozen, x, policy=policy, **side))
        return jnp.stack([policy_lp, reference_lp], axis=1)

    name, side_inputs = f"{objective}({model.name})", model.side_inputs
    if reference is None or objective != "dpo":

        def apply(params, x, *, key=None, train=False, policy=None, **side):
            return log_probs(params, x, None, key, train, policy, side)

        return Layer(init, apply, name, side_inputs=side_inputs)

    def apply_with_reference(params, x, *, key=None, train=False, state=None, policy=None, **side):
        return log_probs(params, x, state["reference"], key, train, policy, side), state

    return Layer(init, apply_with_reference, name, init_state=lambda in_shape: {"reference": reference},
                 side_inputs=side_inputs)  # fmt: skip


def check_objective(objective: str) -> None:
    """A ValueError naming the objectives unless `objective` is one."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")


def sequence_log_probs(token_lp: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """The responses' summed log-probabilities: (B, k, 2, T) per-token, (B, 2, T) mask -> (B, k, 2)."""
    return jnp.sum(token_lp * loss_mask[:, None].astype(jnp.float32), axis=-1)


def dpo_losses(pc: jax.Array, pr: jax.Array, rc: jax.Array, rr: jax.Array, beta: float) -> tuple[jax.Array, jax.Array]:
    """Per-example DPO loss and reward margin from the policy's (pc, pr) and the reference's (rc, rr) summed
    log-probabilities of the chosen and rejected responses: -log sigmoid(beta * ((pc - rc) - (pr - rr)))."""
    margin = beta * ((pc - rc) - (pr - rr))
    return -jax.nn.log_sigmoid(margin), margin


def simpo_losses(
    pc: jax.Array, pr: jax.Array, nc: jax.Array, nr: jax.Array, beta: float, gamma: float
) -> tuple[jax.Array, jax.Array]:
    """Per-example SimPO loss and reward margin: rewards are beta times the mean log-probability per response token
    (nc, nr tokens); loss = -log sigmoid(beta * (pc / nc - pr / nr) - gamma)."""
    margin = beta * (pc / jnp.maximum(nc, 1.0) - pr / jnp.maximum(nr, 1.0))
    return -jax.nn.log_sigmoid(margin - gamma), margin


def _preference_loss(
    token_lp: jax.Array, batch: Batch, *, objective: str, beta: float, gamma: float
) -> tuple[jax.Array, Metrics]:
    mask = batch["loss_mask"].astype(jnp.float32)
    seq = sequence_log_probs(token_lp.astype(jnp.float32), mask)
    pc, pr = seq[:, 0, 0], seq[:, 0, 1]
    if objective == "dpo":
        per_example, margin = dpo_losses(pc, pr, seq[:, 1, 0], seq[:, 1, 1], beta)
    else:
        per_example, margin = simpo_losses(pc, pr, mask[:, 0].sum(-1), mask[:, 1].sum(-1), beta, gamma)
    rows = batch.get("mask")  # evaluation's padding rows count for nothing
    rows = jnp.ones_like(per_example) if rows is None else rows.astype(jnp.float32)
    count = jnp.maximum(rows.sum(), 1.0)

    def mean(v: jax.Array) -> jax.Array:
        return jnp.sum(v * rows) / count

    metrics = {
        "reward_margin": mean(margin),
        "preference_accuracy": mean((margin > 0).astype(jnp.float32)),
        "chosen_logps": mean(pc),
        "rejected_logps": mean(pr),
        "count": rows.sum(),
    }
    return mean(per_example), metrics


def preference_loss(objective: str, beta: float = 0.1, gamma: float = 0.5) -> LossFn:
    """The loss of a `preference_model`'s output: the mean per-example DPO (or SimPO, with margin `gamma`) loss, with
    the reward margin, the preference accuracy (the share of pairs whose margin is positive) and the policy's mean
    summed log-probabilities of the chosen and rejected responses as metrics."""
    check_objective(objective)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"{objective}: beta must be a positive number, got {beta!r}")
    return functools.partial(_preference_loss, objective=objective, beta=float(beta), gamma=float(gamma))


__all__ = [
    "OBJECTIVES",
    "adapters_off",
    "check_objective",
    "dpo_losses",
    "preference_loss",
    "preference_model",
    "sequence_log_probs",
    "simpo_losses",
    "token_log_probs",
]

"""fit's `objective`: a language model and its loss made into a preference-tuning pair (`jaxnn.train.preference`),
with the reference DPO compares against. Internal to `jaxnn.loop`."""

from __future__ import annotations

from typing import Any

from jaxnn.config import ConfigError
from jaxnn.data.sources import as_arrays
from jaxnn.layers.core import Layer
from jaxnn.train.preference import check_objective, preference_loss, preference_model


def _check_pairs(data: Any, objective: str, role: str) -> None:
    arrays = (as_arrays(data, role) if isinstance(data, dict) else None) or {}
    x = arrays.get("x")
    if x is None or x.ndim != 3 or x.shape[1] != 2 or "loss_mask" not in arrays:
        raise ConfigError(
            f"fit: objective={objective!r} trains on preference pairs ({role} as jaxnn.data.preference."
            "load_preference_records gives them: x (N, 2, T+1) and loss_mask (N, 2, T)); this "
            f"{role} holds none"
        )


def _frozen_reference(inputs: Any) -> Any:
    """Full fine-tuning's reference: the starting params (given, or `init_from`'s), a frozen copy."""
    if inputs.params is not None:
        return inputs.params
    if inputs.init_from is not None:
        from jaxnn.checkpoint import load_params
        from jaxnn.lora import merge

        return merge(load_params(inputs.init_from).params)
    raise ConfigError(
        "fit: objective='dpo' compares against the model it starts from: give params= or init_from= (or lora=, "
        "whose base with the adapters off is the reference)"
    )


def preference_start(model: Layer, data: Any, objective: str, beta: float, gamma: float, inputs: Any) -> tuple:
    """(model, inputs) for preference tuning: the model returning the targets' log-probabilities (with the
    reference's for DPO), the objective's loss, and the objective's settings in the run's record."""
    try:
        check_objective(objective)
        loss = preference_loss(objective, beta, gamma)
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    _check_pairs(data, objective, "data")
    if inputs.eval_data is not None:
        _check_pairs(inputs.eval_data, objective, "eval_data")
    reference = _frozen_reference(inputs) if objective == "dpo" and inputs.lora is None else None
    settings = {"objective": objective, "beta": beta, **({"gamma": gamma} if objective == "simpo" else {})}
    config = {**(inputs.config or {}), "preference": settings}
    return preference_model(model, objective, reference), inputs._replace(loss=loss, config=config)

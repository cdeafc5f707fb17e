"""Where a run starts: the given params/state checked against the model (`starting_point`), LoRA adapters on
the starting params (`lora_start`), the initial train state, or another run's whole state (`state_from`). Internal
to `jaxnn.loop`."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxnn.checkpoint import load_train_state, state_digest
from jaxnn.config import ConfigError, FitConfig, config_differences, first_differences
from jaxnn.layers.core import Layer
from jaxnn.train import create_train_state
from jaxnn.train.state import params_for

log = logging.getLogger("jaxnn.loop")


def starting_point(model: Layer, in_shape: Any, params: Any, model_state: Any) -> dict:
    """Checks given starting params/state against the model's own (LoRA adapters given with the params aside:
    the model has none of its own); their digest for the run's record."""
    if params is None and model_state is None:
        return {}
    from jaxnn._src.pytree import shapes
    from jaxnn.fp8 import HISTORY_KEY
    from jaxnn.layers.core import init_model
    from jaxnn.lora import ADAPTER_KEYS

    _, init_params, init_state = jax.eval_shape(lambda k: init_model(model, k, in_shape), jax.random.key(0))
    record = {}
    for part, given, own in (("params", params, init_params), ("model_state", model_state, init_state)):
        if given is None:
            continue
        theirs, ours = shapes(given), shapes(own)
        if part == "params":  # adapters and fp8 amax histories are not the model's own
            theirs = {k: v for k, v in theirs.items() if k.rsplit(".", 1)[-1] not in (*ADAPTER_KEYS, HISTORY_KEY)}
        diffs = config_differences(theirs, ours, saved_as="given", now_as="model")
        if diffs:
            raise ConfigError(
                f"fit: the {part} given do not fit the model ({len(diffs)} differ: {first_differences(diffs)})"
            )
        record[f"initial_{part}"] = state_digest(given)[:16]
    return record


def lora_start(model: Layer, tx: Any, cfg: FitConfig, inputs: Any, x_spec: Any) -> tuple[Layer, Any, Any, dict]:
    """fit's `lora`: the starting params (given, `init_from`'s, or the model's initialisation) with adapters
    added, an optimizer that trains them alone, the model with adapter dropout, and the record's entries.
    Adapters that the model would never read (a pattern matching a convolution's or a custom layer's weight)
    are refused, naming them."""
    from jaxnn import lora as lora_lib
    from jaxnn.checkpoint import load_params
    from jaxnn.layers.core import init_model, run

    settings = inputs.lora  # a LoRA, typed at the edge (jaxnn.loop.fit)
    params, model_state, record = inputs.params, inputs.model_state, {"lora": settings.record()}
    if inputs.init_from is not None:  # another run's parameters: the base, under new adapters and a new optimizer
        loaded = load_params(inputs.init_from)  # a LoRA run's adapters are folded in: the new ones start afresh
        params, model_state = lora_lib.merge(loaded.params), loaded.model_state or None
        record.update(starting_point(model, x_spec.shape, params, model_state))
        record["init_from"] = record.pop("initial_params")
    if params is None or (model.stateful and model_state is None):
        _, fresh, fresh_state = init_model(model, jax.random.key(cfg.seed), x_spec.shape)
        params = fresh if params is None else params
        model_state = fresh_state if model_state is None else model_state
    try:
        if lora_lib.has_adapters(params):  # given with their adapters (a PEFT folder, saved adapters): trained on
            _check_given_adapters(params, settings)
        else:
            params = lora_lib.add_adapters(params, settings, jax.random.fold_in(jax.random.key(cfg.seed), 0x10AA))
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    unused = lora_lib.unused_adapters(lambda p, x: run(model, p, x, state=model_state)[0], params, x_spec)
    if unused:
        raise ConfigError(
            f"fit: LoRA targets {unused[0]}{f' and {len(unused) - 1} more' if len(unused) > 1 else ''}, which no "
            "Dense layer multiplies (a convolution's or a custom layer's weight): its adapters would never train; "
            "narrow the targets"
        )
    model = lora_lib.lora_model(model, settings)
    sizes = {name: int(np.size(leaf)) for name, leaf in lora_lib.adapters(params).items()}
    trained = sum(n for name, n in sizes.items() if not name.endswith("lora_scale"))
    total = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params)) - sum(sizes.values())
    try:
        params = lora_lib.quantize_base(params, settings)  # counted above as weights, stored from here as codes
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    log.info("fit: LoRA r=%d on %d weights: %s trainable parameters beside %s frozen (%.2f%%)", settings.rank,
             len(sizes) // 3, f"{trained:,}", f"{total:,}", 100 * trained / max(total, 1))  # fmt: skip
    inputs = inputs._replace(params=params, model_state=model_state, init_from=None)
    return model, lora_lib.train_adapters_only(tx), inputs, record


def initial_state(model: Layer, tx: Any, cfg: FitConfig, in_shape: Any, params: Any, model_state: Any) -> Any:
    state = create_train_state(model, tx, jax.random.key(cfg.seed), in_shape, cfg.precision)
    if params is not None:
        params = params_for(cfg.precision, params)
        state = state._replace(params=params, opt_state=tx.init(params))
    if model_state is not None:
        state = state._replace(model_state=model_state)
    return state


def state_from(path, state) -> tuple[Any, dict]:
    """Another run's whole train state as this run's starting point, at step 0 with this run's key."""
    restored, step = load_train_state(path, state)
    restored = restored._replace(step=restored.step - restored.step, key=state.key)
    digest = state_digest((restored.params, restored.model_state, restored.opt_state))[:16]
    log.info("fit: starting from the state of %s (its step %d)", path, step)
    return restored, {"init_from": digest}


def _check_given_adapters(params: Any, settings: Any) -> None:
    """Adapters already in the starting params train on as they are: their rank must be the settings' (the
    adapters' own settings, as `jaxnn.lora.load_adapters` and `jaxnn.interop.peft.load_peft` return them)."""
    from jaxnn import lora as lora_lib

    ranks = {int(np.shape(a)[-1]) for name, a in lora_lib.adapters(params).items() if name.endswith("lora_a")}
    if ranks != {settings.rank}:
        raise ValueError(
            f"the params given hold adapters of rank {sorted(ranks)}, the LoRA settings say r={settings.rank}; "
            "give the adapters' own settings (as load_adapters or load_peft return them)"
        )

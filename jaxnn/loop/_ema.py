"""fit's `ema`: an exponential moving average of the weights, kept in the optimizer state (so checkpoints hold it,
a resume continues it bitwise and the sharding rules place it as they place the moments), evaluated in place of
the trained weights and returned as the final state's params. Internal to `jaxnn.loop`.

    ema_0 = the starting params;  ema_t = decay * ema_(t-1) + (1 - decay) * params_t  (after step t's update)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax


class EmaState(NamedTuple):
    inner: Any  # the wrapped optimizer's state
    ema: Any  # the average, a tree like the params the optimizer sees (masked leaves where LoRA freezes the base)


def with_ema(tx: optax.GradientTransformation, decay: float | None) -> optax.GradientTransformation:
    """`tx`, also keeping the weights' moving average with this `decay` in its state; `tx` itself without one."""
    if decay is None:
        return tx

    def init(params):
        return EmaState(tx.init(params), jax.tree.map(lambda p: p, params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("fit's ema needs the params in the optimizer's update")
        new_updates, inner = tx.update(updates, state.inner, params, **extra)
        new = optax.apply_updates(params, new_updates)
        ema = jax.tree.map(lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), state.ema, new)
        return new_updates, EmaState(inner, ema)

    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return optax.GradientTransformationExtraArgs(init, update)
    return optax.GradientTransformation(init, lambda u, s, p=None: update(u, s, p))


def _is_masked(leaf: Any) -> bool:
    return type(leaf).__name__ == "MaskedNode"


def ema_params(state: Any) -> Any:
    """The train state's params with the moving average in place of every averaged leaf (all of them, or a LoRA
    run's adapters); the params themselves when the optimizer keeps no average."""
    found = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, EmaState))
    averages = [s.ema for s in found if isinstance(s, EmaState)]
    if not averages:
        return state.params
    return jax.tree.map(
        lambda p, e: p if _is_masked(e) else e.astype(p.dtype), state.params, averages[0], is_leaf=_is_masked
    )


def with_ema_params(state: Any) -> Any:
    """`state` with `ema_params` as its params."""
    return state._replace(params=ema_params(state))

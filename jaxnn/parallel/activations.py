"""Sharding constraints on activations inside the built-in blocks, by logical axis: the batch over the mesh's batch
axes, a block's hidden width (the MLP's 4 x D) over `tensor`.

Parameters get their layout from the rule tables (`jaxnn.parallel.rules`); XLA propagates it to the activations, and
where propagation has a choice (a batch-split input meeting a column-split weight) it may pick one that moves a
whole activation or weight. A constraint pins the Megatron layout at the points where it matters. Active only
while a mesh is set (`jax.set_mesh`, which the sharded training step does); one device, the data-parallel
`shard_map`/`pmap` forms and evaluation trace without one and are left exactly as they were.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxnn.parallel.rules import DATA, FSDP, TENSOR

BATCH, HIDDEN = "batch", "hidden"
LOGICAL_AXES = {BATCH: (DATA, FSDP), HIDDEN: (TENSOR,)}


def constrain(x: Any, logical: tuple[str | None, ...]) -> Any:
    """`x` constrained to the mesh axes its dimensions' logical names map to; a dimension without a name, or one
    the axes do not divide, is left to XLA. Without a mesh in context (or inside shard_map) `x` is returned as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return x
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec: list[Any] = []
    for size, name in zip(x.shape, logical):
        axes = tuple(a for a in LOGICAL_AXES.get(name or "", ()) if sizes.get(a, 1) > 1)
        fits = axes and size % math.prod(sizes[a] for a in axes) == 0
        spec.append((axes[0] if len(axes) == 1 else axes) if fits else P.UNCONSTRAINED)
    if all(s is P.UNCONSTRAINED for s in spec):
        return x
    return jax.lax.with_sharding_constraint(x, P(*spec))

"""The names jaxmp's signatures use for what a parameter takes, where no JAX or optax type says it.

Elsewhere the signatures use JAX's ``jax.typing.DTypeLike`` (a dtype or its name),
``jax.typing.ArrayLike`` and ``jax.Array``, ``jax.Device``, ``jax.sharding.Mesh``, and optax's
``Params``, ``Updates``, ``OptState`` and ``GradientTransformation``.
"""

# One definition serves every signature: the modules import the alias they need from here. The
# objects the unions name (Policy, Recipe, LossScale) are imported for type checkers only: the modules
# that define them import this one, so importing them back at run time would be a cycle. The aliases
# hold forward references instead; nothing in jaxmp evaluates them (griffe reads them as written).

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Union

# The forward references name their modules in full: importing them here, even for type
# checkers only, would make this bottom-layer module import the layers that use it. So mypy cannot
# resolve them and reads each as Any; the ignores below say so per name (the ratchet holds
# name-defined at 0, so an undefined name anywhere else fails it).

PyTree = Any
"""A JAX pytree: arrays (or scalars) nested in lists, tuples, dicts, dataclasses or any registered node.

A pytree has no checkable type, so this alias is ``Any`` to a type checker; it is named here so a
signature says "a pytree" rather than "anything"."""

PolicyLike = Union["jaxmp._precision._policy.Policy", "jaxmp._precision._presets.Recipe", "jmp.Policy", str]  # type: ignore[name-defined]  # noqa: F821
"""A precision policy: a [`Policy`][jaxmp.Policy], a [`Recipe`][jaxmp.Recipe], a ``jmp.Policy``, or a
string (a preset such as ``"O1"`` or ``"O2-bf16"``, a dtype name, or jmp's ``"p=f32,c=bf16,o=f32"``
grammar). [`jaxmp.as_policy`][jaxmp.as_policy] turns any of them into a `Policy`."""

LossScaleLike = Union["jaxmp._scaling._loss_scale.LossScale", str, float, None]  # type: ignore[name-defined]  # noqa: F821
"""A loss scale or its description: a loss-scale object (returned as is), ``"dynamic"``, ``"torch"``,
``"none"``/``None``, a positive number or ``"static:1024"``. See
[`jaxmp.make_loss_scale`][jaxmp.make_loss_scale]."""

AxisName = Union[Hashable, Sequence[Hashable]]
"""The name of a mapped axis (``pmap``/``shard_map``/``vmap``), usually a str, or a tuple or list of
names for several axes at once."""

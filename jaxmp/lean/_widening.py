"""What jaxmp.lean's two param recipes share, and the interface between them and what they wrap.

``bf16_params`` and ``param_remainders`` run their inner transformation on float32 widenings of
the grads and the params. An inner transformation of class `WidensItself` (``quantized_moments``')
declares that it takes them as the wrapper holds them instead, with how to widen each leaf (a
`Widening`, passed as its ``update``'s keyword ``widening``): it updates large leaves a slice at a
time and widens each slice, never a whole leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._dtypes import is_floating_array
from jaxmp.lean import _chunked


class Widening(NamedTuple):
    """A lean wrapper's float32 grads and params as it holds them: leaf-by-leaf functions of
    its own (bfloat16) trees (see `jaxmp.lean._chunked.Inputs`)."""

    grads: _chunked.Inputs
    params: _chunked.Inputs


class WidensItself(optax.GradientTransformationExtraArgs):
    """An optax transformation whose ``update`` also takes keyword ``widening`` (a `Widening`, or
    None: the grads and params it is given are what it reads).

    jaxmp.lean's param recipes hand such an inner transformation their grads and params unwidened
    (`update_inner`); any other gets them widened to float32.
    """


def leaf_f32(x: Any) -> Any:
    """A floating leaf as float32; any other leaf as it is."""
    return jnp.asarray(x).astype(jnp.float32) if is_floating_array(x) else x


def to_f32(tree: Any) -> Any:
    """``tree`` with its floating leaves as float32."""
    return jax.tree_util.tree_map(leaf_f32, tree)


def check_param_dtypes(params: Any, what: str, allowed: tuple, fix: str) -> None:
    """Raises TypeError naming the first floating param leaf whose dtype is not in ``allowed``."""
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if is_floating_array(p) and jnp.asarray(p).dtype not in allowed:
            raise TypeError(f"{what}: param leaf at {jax.tree_util.keystr(path)} is {jnp.asarray(p).dtype}; {fix}")


def need_params(params: Any, what: str) -> None:
    """Raises ValueError when an update that moves the params themselves got none."""
    if params is None:
        raise ValueError(f"{what} updates the params themselves and needs them: call tx.update(grads, state, params)")


def update_inner(inner: optax.GradientTransformation, grads: Any, state: Any, params: Any, *, wide_params: Any,
                 widening: Widening, extra_args: dict) -> tuple:
    """``inner.update`` on the float32 widening of ``grads`` and ``params`` (``wide_params``), or, for a
    `WidensItself`, on ``grads`` and ``params`` as they are with ``widening`` saying how to widen a leaf."""
    if isinstance(inner, WidensItself):
        return inner.update(grads, state, params, widening=widening, **extra_args)
    return inner.update(to_f32(grads), state, wide_params, **extra_args)

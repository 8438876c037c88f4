"""The engine's public entry points: [`autocast`][jaxmp.autocast] and `jaxmp.engine._autocast_fn.engine_function`.

Both build an engine function (`jaxmp.engine._build`); the first one built on a JAX newer than every
tested one runs the canary of `jaxmp.engine._contract`. See docs/autocast.md#tracing-and-caching.
"""

from __future__ import annotations

from typing import Callable

from jaxmp.engine import _config
from jaxmp._typing import PolicyLike
from jaxmp.engine import _contract as contract
from jaxmp.engine._build import _Autocast, build
from jaxmp.engine._rules import AutocastRules


def engine_function(fn: Callable, config: _config.AutocastConfig, *, cast_outputs: bool = True,
                    cache: bool = True) -> Callable:
    """``fn`` re-evaluated by the engine under a resolved `AutocastConfig`.

    The entry the Flax front door (`jaxmp.flax.mixed_precision`) uses: it resolves its
    own config (`jaxmp.engine._config.flax_config`) and casts module inputs and params itself.

    Args:
      fn: the function.
      config: the engine settings.
      cast_outputs: cast floating outputs to ``config.output_dtype``.
      cache: trace once per input signature (False: trace every call, as ``module.apply`` does,
        so trace-time Python effects such as Flax interceptors behave as without jaxmp).

    Returns:
      The engine function (``fn``'s signature).
    """
    contract.run_canary_once()
    return _Autocast(fn, config, cast_outputs, cache)


def autocast(fn: Callable, policy: PolicyLike = "O1", *, rules: AutocastRules | None = None) -> Callable:
    """Op-level mixed precision for any JAX function, like ``torch.autocast``.

    Each primitive of ``fn`` runs in the dtype its rule gives: the half list (matmuls,
    convolutions) in the compute dtype, the float32 list (transcendentals, reductions) in
    float32, the rest follows its inputs. Traced once per input signature, like ``jax.jit``;
    composes with ``jit``, ``grad`` and ``vmap``. See docs/autocast.md#what-you-can-rely-on.

    Args:
      fn: the function.
      policy: ``"O0"`` (identity), ``"O1"``, ``"O2"``, ``"O3"`` (optionally ``-bf16``/``-fp16``;
        without it the platform's half dtype), ``"mixed_bfloat16"``, a jmp policy string, a
        [`jaxmp.Policy`][jaxmp.Policy] or ``jmp.Policy``.
      rules: [`jaxmp.AutocastRules`][jaxmp.AutocastRules] to use instead of the preset's.

    Returns:
      The autocast function.

    Raises:
      TypeError: ``fn`` is not callable, or ``rules`` is not an [`AutocastRules`][jaxmp.AutocastRules].
      ValueError: an unknown preset or malformed policy string.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(x @ params["w1"])
      ...     return jax.nn.log_softmax(h @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 3))}
      >>> out = jaxmp.autocast(mlp, "O1-bf16")(params, jnp.ones((2, 4)))
      >>> out.dtype  # matmuls ran in bfloat16, log_softmax in float32
      dtype('float32')
    """
    contract.run_canary_once()
    return build(fn, policy, rules=rules)

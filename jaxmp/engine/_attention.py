"""``jax.nn.dot_product_attention`` inside autocast: the fused kernel in half, or a safe fallback.

Calls through ``jax.nn.dot_product_attention`` get half query, key and value: cuDNN where it takes
them, else JAX's XLA attention (float32 logits and softmax).
See docs/autocast.md#half-only-kernels-and-attention.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp

from jaxmp import _effects
from jaxmp.engine import _config
from jaxmp.engine._rules import marker
from jaxmp._dtypes import cast_floating, float32_backward

_log = logging.getLogger("jaxmp.autocast")
_ORIGINAL = _effects.original(jax.nn, "dot_product_attention")
_LOGGED: set[str] = set()

#: The implementation the last routed call chose (``"cudnn"`` or ``"xla"``), for tests and reports.
last_choice: dict[str, str] = {}


def _note(choice: str, why: str) -> None:
    last_choice["implementation"] = choice
    if choice not in _LOGGED:
        _LOGGED.add(choice)
        _log.info("jaxmp.autocast: dot_product_attention runs the %s implementation (%s)", choice, why)


def routed_attention(query, key, value, bias=None, mask=None, *args, implementation=None, **kwargs):
    """``jax.nn.dot_product_attention`` with half inputs: cuDNN where it can, XLA otherwise.

    Args:
      query: ``[B, T, N, H]``.
      key: ``[B, S, K, H]``.
      value: ``[B, S, K, H]``.
      bias: optional bias, as for ``jax.nn.dot_product_attention``.
      mask: optional boolean mask.
      *args: further positional arguments of ``jax.nn.dot_product_attention``.
      implementation: None (choose), ``"cudnn"`` or ``"xla"``: an explicit choice is kept.
      **kwargs: further keyword arguments (``is_causal``, ``scale`` ...).

    Returns:
      The attention output in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> jaxmp.autocast(lambda q: jax.nn.dot_product_attention(q, q, q), "O1-bf16")(q).shape
      (1, 4, 2, 8)
    """
    cfg = _config.current()
    if cfg is None:
        return _ORIGINAL(query, key, value, bias, mask, *args, implementation=implementation, **kwargs)
    query, key, value, bias = cast_floating((query, key, value, bias), cfg.compute_dtype)
    call = functools.partial(_ORIGINAL, query, key, value, bias, mask, *args, **kwargs)

    # The mask and any array among the other arguments (sequence lengths) are passed to the
    # custom-vjp function explicitly: a closure over them would hand the backward pass tracers
    # of a trace that has ended (a leaked tracer under jit(grad)).
    rest, rest_tree = jax.tree_util.tree_flatten((mask, args, kwargs))
    is_array = [isinstance(x, jax.Array) for x in rest]  # tracers too
    static = [None if a else x for x, a in zip(rest, is_array)]

    def xla(q, k, v, b, *arrays):
        # XLA's attention accumulates the half logits in float32; its transpose would multiply a
        # float32 cotangent with a half operand, which strict promotion refuses when lowered.
        # Traced again when differentiated, so the promotion setting is set here too.
        it = iter(arrays)
        m, a, kw = jax.tree_util.tree_unflatten(rest_tree, [next(it) if arr else x for x, arr in zip(static, is_array)])
        with jax.numpy_dtype_promotion("standard"):
            return _ORIGINAL(q, k, v, b, m, *a, implementation="xla", **kw)

    arrays = [x for x, a in zip(rest, is_array) if a]

    # JAX's attention promotes with jnp.promote_types, which a caller's strict promotion forbids.
    with _config.TRACING(None), jax.numpy_dtype_promotion("standard"), \
            jax.named_scope(marker("keep", "dot_product_attention")):
        if implementation is not None:
            _note(implementation, "chosen by the caller")
            return call(implementation=implementation) if implementation != "xla" else \
                float32_backward(xla)(query, key, value, bias, *arrays)
        if jax.default_backend() == "gpu":
            try:
                out = call(implementation="cudnn")
                _note("cudnn", "fused kernel")
                return out
            except Exception as e:  # cuDNN missing, or it refuses these shapes/dtypes/masks
                _note("xla", f"cuDNN refused: {type(e).__name__}: {str(e)[:120]}")
        else:
            _note("xla", f"no cuDNN on {jax.default_backend()}")
        if jax.default_backend() == "cpu" and query.dtype == jnp.float16:
            # XLA:CPU has no float16 x float16 -> float32 dot (F16_F16_F32), which the float32
            # logits need: compute in float32 (a CPU gains nothing from half) and hand back half.
            args32 = cast_floating((query, key, value, bias), jnp.float32)
            out = _ORIGINAL(*args32, mask, *args, implementation="xla", **kwargs)
            return out.astype(jnp.float16)
        return float32_backward(xla)(query, key, value, bias, *arrays)


@contextlib.contextmanager
def route_attention():
    """While active, calls through ``jax.nn.dot_product_attention`` go to `jaxmp.engine._attention.routed_attention`.

    The first call installs the router on ``jax.nn`` through `jaxmp._effects` (effect 1 there),
    where it stays: outside an autocast trace (``jaxmp.engine._config.current()`` is None, a
    per-thread JAX context) it calls JAX's own function unchanged.
    """
    _effects.patch(jax.nn, "dot_product_attention", lambda _: routed_attention)
    yield

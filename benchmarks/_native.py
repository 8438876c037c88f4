"""The "native" baseline: the same Flax module code with Flax's own ``dtype=`` on every layer.

``experiments.models`` are plain float32 modules (jaxmp runs them under a policy). To measure
what the policy machinery costs, the benchmark runs the *same* module code the way a Flax user
writes mixed precision by hand: every ``Dense``, ``DenseGeneral``, ``Conv``, ``BatchNorm``,
``LayerNorm`` and ``MultiHeadDotProductAttention`` built while :func:`native_dtype` is active
gets ``dtype=bfloat16`` (computation) and keeps ``param_dtype=float32`` (parameters), as in the
Flax ImageNet example. Flax's norms compute their statistics in float32 whatever ``dtype`` is.

With ``attention="cudnn"`` the attention layers call ``jax.nn.dot_product_attention`` with the
cuDNN fused kernel on a GPU (XLA's implementation elsewhere).

Example::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class M(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, train=False):
    ...         return nn.Dense(3)(x)
    >>> model = NativeModel(M(), jnp.bfloat16)
    >>> v = model.init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    >>> model.apply(v, jnp.ones((2, 4))).dtype, v["params"]["Dense_0"]["kernel"].dtype
    (dtype(bfloat16), dtype('float32'))
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

LAYERS = ("Dense", "DenseGeneral", "Conv", "BatchNorm", "LayerNorm", "MultiHeadDotProductAttention")


def fused_attention_fn(implementation: str | None):
    """A Flax ``attention_fn`` that calls ``jax.nn.dot_product_attention``.

    Args:
      implementation: ``"cudnn"``, ``"xla"``, or ``"auto"`` (no implementation named: JAX's
        choice, or under :func:`jaxmp.autocast` the engine's).

    Returns:
      A function with Flax's ``attention_fn`` signature (no dropout: the suite uses none).
    """
    import jax

    def attention(query, key, value, bias=None, mask=None, dropout_rate=0.0, deterministic=True, **_):
        if dropout_rate and not deterministic:
            raise ValueError("the fused attention baseline has no attention dropout")
        return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                            implementation=None if implementation == "auto" else implementation)

    return attention


@contextlib.contextmanager
def native_dtype(dtype, attention: str | None = None, softmax_fp32: bool = False):
    """Within the block, Flax layers default to ``dtype`` (parameters stay float32).

    Args:
      dtype: the computation dtype (``jnp.bfloat16``), or None (Flax's default: the inputs').
      attention: None (Flax's attention), or ``"cudnn"`` / ``"xla"`` / ``"auto"`` to route
        ``MultiHeadDotProductAttention`` through ``jax.nn.dot_product_attention``.
      softmax_fp32: Flax attention's softmax in float32 (``force_fp32_for_softmax``).

    Yields:
      Nothing; ``flax.linen``'s layer classes are restored on exit.
    """
    import flax.linen as nn

    saved = {name: getattr(nn, name) for name in LAYERS}
    try:
        for name, base in saved.items():
            ns: dict[str, Any] = {"__annotations__": {"dtype": Any}, "dtype": dtype, "__module__": base.__module__,
                                  "__qualname__": base.__qualname__}
            if name == "MultiHeadDotProductAttention" and softmax_fp32:
                ns["__annotations__"]["force_fp32_for_softmax"] = bool
                ns["force_fp32_for_softmax"] = True
            if name == "MultiHeadDotProductAttention" and attention:
                ns["__annotations__"]["attention_fn"] = Any
                ns["attention_fn"] = staticmethod(fused_attention_fn(attention))
            # Same class name: Flax's automatic names (Dense_0, ...) and the param tree match.
            setattr(nn, name, type(name, (base,), ns))
        yield
    finally:
        for name, base in saved.items():
            setattr(nn, name, base)


class NativeModel:
    """A module whose ``init`` / ``apply`` trace under :func:`native_dtype`.

    Args:
      module: the plain Flax Linen module.
      dtype: computation dtype.
      attention, softmax_fp32: as in :func:`native_dtype`.
    """

    def __init__(self, module, dtype, attention: str | None = None, softmax_fp32: bool = False):
        self.module, self.dtype, self.attention, self.softmax_fp32 = module, dtype, attention, softmax_fp32

    def _call(self, method, *args, **kwargs):
        with native_dtype(self.dtype, self.attention, self.softmax_fp32):
            return getattr(self.module, method)(*args, **kwargs)

    init = functools.partialmethod(_call, "init")
    apply = functools.partialmethod(_call, "apply")

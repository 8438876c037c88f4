"""The lean presets: one table of records, and `preset`, which composes a recipe from a record.

Each `Preset` says how its recipe stores the moments (`MOMENTS`) and the params (`PARAMS`), what
that costs per parameter and whether it draws random bits; ``jaxmp.lean.PRESETS`` and `preset`
read the table (``tests/lean/test_presets.py`` holds the docstring's table, the figures and the
compositions to it).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._dtypes import is_floating_array
from jaxmp._keys import IMPL as _IMPL, key_data as _key_data
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp._precision._presets import did_you_mean
from jaxmp._scaling._transform import check_inner
from jaxmp._scaling._transform import master_weights as _master_weights
from jaxmp.lean._bf16 import bf16_moments, bf16_params
from jaxmp.lean._quantized import quantized_moments, unused_key_warning as _unused_key_warning
from jaxmp.lean._remainders import param_remainders


class Part(NamedTuple):
    """One half of a preset: how it stores the moments or the params."""

    #: How `preset`'s docstring writes it, ``{}`` standing for what it wraps.
    code: str
    #: ``(inner, base) -> transformation``; ``base``: the preset's key (a ``jax.random.key``; None
    #: when the preset draws no bits, and then only a part that draws none is given it).
    wrap: Callable[[optax.GradientTransformation, Any], optax.GradientTransformation]
    #: Whether it rounds stochastically (needs the key).
    draws_random_bits: bool


#: How the inner optimizer's moments are stored.
MOMENTS: dict[str, Part] = {
    "float32": Part("{}", lambda inner, base: inner, False),
    "bf16": Part("bf16_moments({})", lambda inner, base: bf16_moments(inner, jax.random.fold_in(base, 2)), True),
    "8bit": Part("quantized_moments({}, bits=8)", lambda inner, base: quantized_moments(inner, bits=8), False),
    "4bit": Part("quantized_moments({}, bits=4)", lambda inner, base: quantized_moments(inner, bits=4), False),
}

#: How the params are kept: with a float32 master, as remainders, or in bfloat16 alone.
PARAMS: dict[str, Part] = {
    "masters": Part("master_weights({})", lambda inner, base: _master_weights(inner), False),
    "remainders": Part("param_remainders({})", lambda inner, base: param_remainders(inner), False),
    "bf16": Part("bf16_params({})", lambda inner, base: bf16_params(inner, jax.random.fold_in(base, 1)), True),
}


class Preset(NamedTuple):
    """A lean preset: a key of `MOMENTS` and one of `PARAMS`, and what the pair costs and trades."""

    name: str
    #: A key of `MOMENTS`.
    moments: str
    #: A key of `PARAMS`.
    params: str
    #: Bytes per parameter with AdamW on bfloat16 params: params plus optimizer state, O(1) scalars
    #: aside, the 8-bit and 4-bit moments' float32 block scales included.
    bytes: float
    #: The same on float32 params (plain float32 AdamW: 12): the params cost 4, a float32 master
    #: duplicates them, and a remainder is empty; what the presets save comes from bfloat16 params.
    float32_bytes: int
    #: Whether it rounds stochastically: it needs ``key=``.
    draws_random_bits: bool
    #: What the recipe trades.
    doc: str

    @property
    def composition(self) -> str:
        """The recipe as `preset` builds it, e.g. ``"bf16_params(bf16_moments(inner))"``."""
        return PARAMS[self.params].code.format(MOMENTS[self.moments].code.format("inner"))


#: Every preset, in the order of ``jaxmp.lean.PRESETS``. tests/lean/test_lean.py and
#: tests/cross/test_safe_defaults.py measure the bytes of each.
TABLE: tuple[Preset, ...] = (
    Preset("fp32-masters", "float32", "masters", 14, 16, False,
           "O2-bf16 with float32 masters and float32 moments: the reference"),
    Preset("remainders", "float32", "remainders", 12, 12, False,
           "bf16 params + int16 remainders: bitwise the float32-master run, 2 bytes less"),
    Preset("masters-bf16-moments", "bf16", "masters", 10, 12, True,
           "float32 masters, SR bf16 moments (DeepSeek-V3's recipe)"),
    Preset("sr-params", "float32", "bf16", 10, 12, True, "SR bf16 params, no master, float32 moments"),
    Preset("remainders-bf16-moments", "bf16", "remainders", 8, 8, True,
           "exact masters via remainders, SR bf16 moments"),
    Preset("bf16-sr", "bf16", "bf16", 6, 8, True, "SR bf16 params and SR bf16 moments: unbiased but noisier"),
    Preset("remainders-8bit", "8bit", "remainders", 6.03125, 6, False,
           "exact masters via remainders, 8-bit blockwise moments (block 256)"),
    Preset("remainders-4bit", "4bit", "remainders", 5.0625, 5, False,
           "exact masters via remainders, 4-bit blockwise moments (block 128)"),
    Preset("bf16-sr-8bit", "8bit", "bf16", 4.03125, 6, True,
           "SR bf16 params, 8-bit blockwise moments: a third of float32 AdamW"),
    Preset("bf16-sr-4bit", "4bit", "bf16", 3.0625, 5, True, "SR bf16 params, 4-bit blockwise moments: the leanest"),
)

BY_NAME = {p.name: p for p in TABLE}

PRESETS: dict[str, tuple[float, str]] = {p.name: (p.bytes, p.doc) for p in TABLE}
"""The names [`preset`][jaxmp.lean.preset] takes: name -> (bytes per parameter with AdamW, params plus optimizer
state, O(1) scalars aside, the 8-bit and 4-bit moments' float32 block scales included; what the
recipe trades). The quantized presets keep moment leaves under 4096 elements in float32 (a model's
biases and norms: a fraction of a percent of its parameters)."""

_PLAIN_FLOAT32_BYTES = 12


def _warn_on_float32_params(record: Preset, tx: optax.GradientTransformationExtraArgs
                            ) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` warns when no floating param is bfloat16 (the preset then saves little or nothing)."""
    name = record.name

    def init_fn(params):
        dtypes = {jnp.asarray(p).dtype for p in jax.tree_util.tree_leaves(params) if is_floating_array(p)}
        if dtypes and jnp.dtype(jnp.bfloat16) not in dtypes:
            spent = record.float32_bytes
            saved = "saves nothing" if spent >= _PLAIN_FLOAT32_BYTES else "saves only what its narrow moments save"
            warnings.warn(
                f"jaxmp.lean.preset({name!r}) got no bfloat16 params ({', '.join(sorted(map(str, dtypes)))} only): "
                f"its {record.bytes} bytes per parameter assume bfloat16 params; on these it spends {spent} "
                f"(plain float32 AdamW: {_PLAIN_FLOAT32_BYTES}), so it {saved}. Store the params in bfloat16 first: "
                "jaxmp.cast_floating(params, jnp.bfloat16), or a Flax model under an O2-bf16 policy.",
                MixedPrecisionWarning, stacklevel=_user_stacklevel())
        return tx.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, tx.update)


def preset(name: str, inner: optax.GradientTransformation, *, key: jax.Array | int | None = None,
           accumulate_steps: int = 1) -> optax.GradientTransformationExtraArgs:
    """A memory-lean recipe by name, to wrap in [`jaxmp.loss_scaling`][jaxmp.loss_scaling] (with bfloat16 params).

    | name | bytes/param with AdamW | composition |
    |---|---|---|
    | ``"fp32-masters"`` | 14 | ``master_weights(inner)`` |
    | ``"remainders"`` | 12 | ``param_remainders(inner)`` |
    | ``"masters-bf16-moments"`` | 10 | ``master_weights(bf16_moments(inner))`` |
    | ``"sr-params"`` | 10 | ``bf16_params(inner)`` |
    | ``"remainders-bf16-moments"`` | 8 | ``param_remainders(bf16_moments(inner))`` |
    | ``"bf16-sr"`` | 6 | ``bf16_params(bf16_moments(inner))`` |
    | ``"remainders-8bit"`` | 6.03 | ``param_remainders(quantized_moments(inner, bits=8))`` |
    | ``"remainders-4bit"`` | 5.06 | ``param_remainders(quantized_moments(inner, bits=4))`` |
    | ``"bf16-sr-8bit"`` | 4.03 | ``bf16_params(quantized_moments(inner, bits=8))`` |
    | ``"bf16-sr-4bit"`` | 3.06 | ``bf16_params(quantized_moments(inner, bits=4))`` |

    The quantized moments round to nearest (see docs/lean-recipes.md#8-bit-and-4-bit-moments).

    Args:
      name: a key of `PRESETS`.
      inner: the optax optimizer (e.g. ``optax.adamw(1e-3)``).
      key: an int seed or threefry2x32 key; required by the presets that round stochastically
        (``"masters-bf16-moments"``, ``"sr-params"``, ``"remainders-bf16-moments"`` and the
        ``"bf16-sr"`` ones), unused by the others (a ``MixedPrecisionWarning`` says so).
      accumulate_steps: gradient accumulation over this many steps (``optax.MultiSteps``, placed
        as docs/lean-recipes.md#gradient-accumulation says).

    Returns:
      An optax transformation; wrap it: ``jaxmp.loss_scaling(preset(...), "none")``.

    Raises:
      ValueError: unknown name (with the closest names), or ``accumulate_steps`` < 1.
      TypeError: a stochastic preset without a key.

    Warns:
      MixedPrecisionWarning: at ``init``, when no floating param is bfloat16 (the presets then save little);
        at the call, a ``key`` for a preset that rounds to nearest (unused).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> from jaxmp.lean import preset
      >>> tx = jaxmp.loss_scaling(preset("bf16-sr", optax.adamw(1e-3), key=0), "none")
      >>> type(tx.init({"w": jnp.ones((4, 4), jnp.bfloat16)})).__name__
      'LossScalingState'
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown lean preset {name!r}{did_you_mean(name, PRESETS)}; the presets are "
                         f"{', '.join(PRESETS)}")
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, (int, np.integer)) \
            or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be an int >= 1, got {accumulate_steps!r}")
    record = BY_NAME[name]
    if not record.draws_random_bits:
        _unused_key_warning(f"jaxmp.lean.preset({name!r})", key, "it rounds every value to nearest (its moments "
                            "too)", f"Drop key=; the presets that round stochastically: {', '.join(_stochastic())}")
    base = jax.random.wrap_key_data(_key_data(key, f"preset {name!r}"), impl=_IMPL) if record.draws_random_bits \
        else None
    inner = MOMENTS[record.moments].wrap(check_inner(inner), base)
    if accumulate_steps > 1:
        inner = optax.MultiSteps(inner, accumulate_steps).gradient_transformation()
    return _warn_on_float32_params(record, PARAMS[record.params].wrap(inner, base))


def _stochastic() -> list[str]:
    return [p.name for p in TABLE if p.draws_random_bits]


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jaxmp and optax (the user's ``init`` call):
    wrappers (``loss_scaling``, ``optax.masked``) add frames between it and the warning.

    Frames are compared with the installed packages' own directories, never with a path
    fragment: a user's code under a folder named ``jaxmp`` (the README's clone) is the user's.
    """
    import sys

    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# The directories of jaxmp's and optax's own source files (``os.sep``-terminated so that a
# sibling such as ``jaxmp_examples/`` is not mistaken for the package).
# This file is jaxmp/lean/_presets.py: jaxmp's directory is two levels up.
_LIBRARY_DIRS = tuple(os.path.join(os.path.dirname(os.path.abspath(path)), "")
                      for path in (os.path.dirname(os.path.abspath(__file__)), optax.__file__))


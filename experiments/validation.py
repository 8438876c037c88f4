"""Config validation: every user mistake becomes one clear `UserError` before any work starts.

`check_fields` checks the values of a config (ranges, finiteness, known names that need
no JAX); it is cheap and runs while the command line is parsed, so a bad
``--config.<field>`` is a usage error before JAX is imported. `validate_config` adds the
checks that need JAX (policy names, devices) and derives the run's `Plan`: the config is
read here once, and the rest of the run sees only the plan.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

from absl import app

ENGINES = ("flax", "autocast")
# Config fields that do not change what a run computes: how often it logs, evaluates and saves,
# how it shows progress, where TFDS data is cached, what compare.py does around it. ``policy`` and
# ``seed`` are recorded as the run used them (compare.py overrides both), ``num_epochs`` and
# ``num_train_steps`` as the number of steps they come to. Every other field is recorded with
# each checkpoint, and a resume under another value is refused (experiments.train.run_settings).
FREE_FIELDS = ("compare_policies", "num_seeds", "log_every_steps", "eval_every_steps", "checkpoint_every_steps",
               "keep_checkpoints", "progress_bar", "data_dir", "cache_data", "eval_batch_size")
NOT_RESULT_FIELDS = ("policy", "seed", "num_epochs", "num_train_steps") + FREE_FIELDS


def flat_fields(d: dict, prefix: str = "") -> dict:
    """A nested config dict as ``{"a.b": value}``: the names ``--config.a.b`` takes.

    Args:
      d: a (nested) dict, e.g. ``config.to_dict()``.
      prefix: prepended to every name.

    Returns:
      A flat dict.

    Example:
      >>> from experiments.validation import flat_fields
      >>> flat_fields({"a": 1, "m": {"f": [2]}})
      {'a': 1, 'm.f': [2]}
    """
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_fields(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


class UserError(ValueError, app.UsageError):
    """A problem with the user's input; its message says what is wrong and what is valid.

    It is a ``ValueError`` for library callers and an absl ``UsageError`` for the command lines.
    """

    exitcode = 2  # what absl's usage handler and `experiments.cli.run` exit with


class RunFailedError(RuntimeError):
    """A run that could not go on for a reason outside the user's input (a full disk, a failed write).

    The message says what failed, where, and how to go on; the command lines exit with status 1.
    """

    exitcode = 1


class Plan(NamedTuple):
    """Everything a run derives from its config (all explicit, all logged)."""

    policy: str
    engine: str
    seed: int
    num_devices: int
    per_device_batch_size: int
    global_batch_size: int
    eval_batch_size: int
    learning_rate: float
    steps_per_epoch: int
    num_train_steps: int
    warmup_steps: int
    loss_scale: str           # the loss-scale spec used ("dynamic", "none", "static:1024"...)
    dynamic_scale_init: float  # 0 = jaxmp's default
    dynamic_scale_period: int  # 0 = jaxmp's default
    master_weights: bool
    lean_recipe: str          # "" or one of lean_recipes() (then master_weights is False: the recipe keeps the state)
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    keep_checkpoints: int
    max_consecutive_skips: int
    progress_bar: bool


# field -> (predicate, what is valid). Integers must be whole numbers (bool is not one).
def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


_RULES = {
    "per_device_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (examples per device per step)"),
    "num_devices": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "eval_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "base_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "base_learning_rate": (lambda v: _is_real(v) and v > 0, "a finite number > 0"),
    "warmup_epochs": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "num_epochs": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "num_train_steps": (lambda v: _is_int(v), "an integer (> 0 overrides num_epochs, <= 0 uses num_epochs)"),
    "weight_decay": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "momentum": (lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "grad_clip_norm": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0 (0 = no clipping)"),
    "label_smoothing": (lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "seed": (lambda v: _is_int(v) and 0 <= v < 2**31 - 1, "an integer in [0, 2**31 - 1)"),
    "num_seeds": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "log_every_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "eval_every_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "checkpoint_every_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "keep_checkpoints": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (a resume needs one checkpoint)"),
    "max_consecutive_skips": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "mnist1d_num_samples": (lambda v: _is_int(v) and v >= 10, "an integer >= 10"),
    "fake_num_examples": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "num_classes": (lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
    "image_size": (lambda v: _is_int(v) and v >= 8, "an integer >= 8"),
    "dynamic_scale_init": (lambda v: _is_real(v) and (v == 0 or 1 <= v <= 2.0**24),
                           "0 (jaxmp's default) or a number in [1, 2**24]"),
    "dynamic_scale_period": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = jaxmp's default)"),
}
_CHOICES = {"engine": ENGINES, "optimizer": OPTIMIZERS, "lr_schedule": SCHEDULES}


def check_fields(config) -> None:
    """Checks every field's value; needs no JAX.

    Args:
      config: the experiment ``ConfigDict``.

    Raises:
      UserError: naming the first bad field, its value and what is valid.

    Example:
      >>> from experiments import configs
      >>> c = configs.get_config("cpu"); c.keep_checkpoints = 0
      >>> check_fields(c)
      Traceback (most recent call last):
      ...
      experiments.validation.UserError: --config.keep_checkpoints=0 is invalid: use an integer >= 1 ...
    """
    for field, choices in _CHOICES.items():
        if field in config and config[field] not in choices:
            raise UserError(f"--config.{field}={config[field]!r} is invalid: choose one of {', '.join(choices)}.")
    for field, (ok, valid) in _RULES.items():
        if field in config and not ok(config[field]):
            raise UserError(f"--config.{field}={config[field]!r} is invalid: use {valid}.")
    lr = config.get("learning_rate")
    if lr is not None and not (_is_real(lr) and lr > 0):
        raise UserError(f"--config.learning_rate={lr!r} is invalid: use a finite number > 0 (it follows "
                        "base_learning_rate x global_batch_size / base_batch_size unless set directly).")
    gb = config.get("global_batch_size")
    if gb is not None and not (_is_int(gb) and gb >= 1):
        raise UserError(f"--config.global_batch_size={gb!r} is invalid: set --config.per_device_batch_size "
                        "to an integer >= 1 (the global batch is per-device x num_devices).")
    _check_model_kwargs(config.get("model_kwargs"))


def _check_model_kwargs(kwargs) -> None:
    """The model attributes (``model_kwargs``) as the models take them: sizes are integers >= 1
    (``features=(32, 32)``, ``width=64``), rates numbers in [0, 1), switches booleans.

    Without this a size of 0 fails as a ZeroDivisionError inside the model, and a string becomes a
    shape of characters inside JAX.
    """
    if kwargs is None:
        return
    items = kwargs.items() if hasattr(kwargs, "items") else None
    if items is None:
        raise UserError(f"--config.model_kwargs={kwargs!r} is invalid: it holds the model's attributes, e.g. "
                        "model_kwargs = ml_collections.ConfigDict(dict(features=(32, 32)))")
    for name, v in items:
        flag = f"--config.model_kwargs.{name}={v!r}"
        if isinstance(v, bool):
            continue
        if name.endswith("_rate"):
            if not (_is_real(v) and 0 <= v < 1):
                raise UserError(f"{flag} is invalid: use a number in [0, 1).")
        elif _is_real(v) and not _is_int(v):
            if v <= 0:
                raise UserError(f"{flag} is invalid: use a finite number > 0.")
        elif isinstance(v, (tuple, list)):
            if not v or not all(_is_int(x) and x >= 1 for x in v):
                raise UserError(f"{flag} is invalid: use a non-empty tuple of integers >= 1, e.g. "
                                f"--config.model_kwargs.{name}=(32,32).")
        elif not (_is_int(v) and v >= 1):
            raise UserError(f"{flag} is invalid: model sizes are integers >= 1 (or tuples of them, e.g. "
                            f"features=(32,32)); rates (*_rate) numbers in [0, 1); switches True or False.")


LEAN_NEAREST = "bf16-nearest"
"""The ``lean_recipe`` of plain bf16 params rounded to nearest with no master (the failure mode)."""


#: Study variants of the SR + quantized-moment presets: ``-all`` quantizes every leaf
#: (``min_size=0``: the MNIST-1D CNN has no leaf of 4096 elements, so the presets quantize nothing
#: there), ``-all-sr`` rounds the moments stochastically too. ``name: (bits, stochastic moments)``.
LEAN_QUANTIZED_STUDY = {f"bf16-sr-{bits}bit{tail}": (bits, tail == "-all-sr")
                        for bits in (8, 4) for tail in ("-all", "-all-sr")}


def lean_recipes() -> tuple[str, ...]:
    """The values ``--config.lean_recipe`` takes: "" (the policy's own state), the ``jaxmp.lean``
    presets, `LEAN_NEAREST` and `LEAN_QUANTIZED_STUDY`."""
    from jaxmp import lean

    return ("",) + tuple(lean.PRESETS) + (LEAN_NEAREST,) + tuple(LEAN_QUANTIZED_STUDY)


def _check_lean(config, policy: str, recipe) -> bool:
    """``--config.lean_recipe`` against the policy; returns the plan's ``master_weights``."""
    import jax.numpy as jnp

    name = config.get("lean_recipe", "")
    choices = lean_recipes()
    if name not in choices:
        raise UserError(f"--config.lean_recipe={name!r} is invalid: choose one of "
                        f"{', '.join(repr(c) for c in choices)}.")
    if not name:
        return bool(recipe.master_weights)
    if jnp.dtype(recipe.policy.param_dtype) != jnp.dtype(jnp.bfloat16):
        raise UserError(f"--config.lean_recipe={name!r} keeps bfloat16 params, but policy {policy} stores "
                        f"{jnp.dtype(recipe.policy.param_dtype).name} params: use a bf16-param policy "
                        "(O2-bf16, O3-bf16) or --config.lean_recipe=''.")
    return False


def _check_names(config, policy: str) -> tuple[str, bool]:
    """Policy, compare policies, model, dataset, loss scale and lean recipe; returns (loss-scale spec,
    master weights)."""
    import jaxmp
    from experiments import data as data_lib
    from experiments import models as models_lib

    try:
        recipe = jaxmp.get_recipe(policy)
    except (ValueError, TypeError) as e:
        raise UserError(f"{e} (--config.policy / --config.compare_policies)") from None
    for p in config.compare_policies:
        try:
            jaxmp.get_recipe(p)
        except (ValueError, TypeError) as e:
            raise UserError(f"in --config.compare_policies: {e}") from None
    for field, choices in (("model", tuple(models_lib.MODELS)), ("dataset", data_lib.DATASETS)):
        if config[field] not in choices:
            raise UserError(f"unknown {field} {config[field]!r}: choose one of {', '.join(choices)} "
                            f"(--config.{field}=...).")
    spec = config.loss_scale or recipe.loss_scale
    try:
        jaxmp.make_loss_scale(spec)
    except (ValueError, TypeError) as e:
        raise UserError(f"--config.loss_scale={config.loss_scale!r}: {e}") from None
    custom = config.dynamic_scale_init or config.dynamic_scale_period
    if custom and str(spec).strip().lower() != "dynamic":
        raise UserError(f"--config.dynamic_scale_init / dynamic_scale_period apply to a dynamic loss scale, but "
                        f"policy {policy} uses loss scale {spec!r}: set --config.loss_scale=dynamic or drop them.")
    if custom:  # the checkpoint records the scale's settings: resuming under others is refused
        init = config.dynamic_scale_init
        init = f"2**{int(math.log2(init))}" if init and math.log2(init).is_integer() else f"{init:g}"
        spec = f"{spec}(init={init},period={config.dynamic_scale_period or 'default'})"
    return str(spec), _check_lean(config, policy, recipe)


def _check_devices(config) -> int:
    import jax

    n, available = int(config.num_devices), jax.device_count()
    if n > available:
        raise UserError(
            f"this config wants {n} devices but only {available} {jax.devices()[0].platform} device(s) "
            f"are visible. Use a config for this machine (e.g. --config=experiments/configs/cpu.py) or "
            f"--config.num_devices={available} (the global batch becomes {available} x per_device_batch_size).")
    return n


def _batches(config, n: int) -> tuple[int, int, int]:
    """(per-device, global, eval) batch sizes, checked against ``n`` devices."""
    from absl import logging

    global_batch = int(config.global_batch_size)
    if global_batch % n:
        raise UserError(
            f"the global batch {global_batch} does not divide over {n} devices: set "
            f"--config.per_device_batch_size (global = per-device x {n}) or a global_batch_size that is a "
            f"multiple of {n}.")
    per_device = global_batch // n
    if per_device != int(config.per_device_batch_size):
        logging.warning("global_batch_size %d was set directly: per-device batch is %d, not per_device_batch_size %d",
                        global_batch, per_device, config.per_device_batch_size)
    eval_batch = int(config.eval_batch_size)
    if eval_batch % n:
        raise UserError(f"--config.eval_batch_size={eval_batch} is invalid: use a positive multiple of "
                        f"num_devices {n}.")
    return per_device, global_batch, eval_batch


def validate_config(config, *, policy: str | None = None, seed: int | None = None,
                    num_train_examples: int | None = None) -> Plan:
    """Checks a config and derives the run's numbers.

    Args:
      config: the experiment config.
      policy: overrides ``config.policy`` (compare.py).
      seed: overrides ``config.seed``.
      num_train_examples: the training split's size (to turn epochs into steps).

    Returns:
      The `Plan`.

    Raises:
      UserError: a bad value, an unknown name, a batch that does not divide the devices, more
        devices than are available, or nothing to train.
    """
    check_fields(config)
    policy = config.policy if policy is None else policy
    seed = int(config.seed if seed is None else seed)
    if not 0 <= seed < 2**31 - 1:
        raise UserError(f"seed {seed} is invalid: use an integer in [0, 2**31 - 1).")
    loss_scale, master_weights = _check_names(config, policy)
    n = _check_devices(config)
    per_device, global_batch, eval_batch = _batches(config, n)
    if num_train_examples is not None and global_batch > num_train_examples:
        more = (" or raise --config.mnist1d_num_samples (80% of it is the training split)"
                if config.get("dataset") == "mnist1d" else "")
        raise UserError(f"the global batch {global_batch} ({n} device(s) x per_device_batch_size {per_device}) is "
                        f"larger than the {num_train_examples} training examples of {config.get('dataset')}: lower "
                        f"--config.per_device_batch_size{more}.")
    spe = max(1, num_train_examples // global_batch) if num_train_examples else 1
    steps = int(config.num_train_steps) if config.num_train_steps > 0 else int(math.ceil(config.num_epochs * spe))
    if steps < 1:
        raise UserError("nothing to train: set --config.num_epochs > 0 or --config.num_train_steps > 0.")
    return Plan(
        policy=policy, engine=config.engine, seed=seed, num_devices=n, per_device_batch_size=per_device,
        global_batch_size=global_batch, eval_batch_size=eval_batch, learning_rate=float(config.learning_rate),
        steps_per_epoch=spe, num_train_steps=steps, warmup_steps=min(int(round(config.warmup_epochs * spe)), steps),
        loss_scale=loss_scale, dynamic_scale_init=float(config.dynamic_scale_init),
        dynamic_scale_period=int(config.dynamic_scale_period), master_weights=master_weights,
        lean_recipe=str(config.get("lean_recipe", "")), log_every_steps=int(config.log_every_steps),
        eval_every_steps=int(config.eval_every_steps), checkpoint_every_steps=int(config.checkpoint_every_steps),
        keep_checkpoints=int(config.keep_checkpoints), max_consecutive_skips=int(config.max_consecutive_skips),
        progress_bar=bool(config.progress_bar))

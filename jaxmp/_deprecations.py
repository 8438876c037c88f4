"""The table of moved names: every name that left a public namespace, and where it is now.

Each row is ``(old place, new place, status)``, read by one ``__getattr__`` per namespace
(`module_getattr`): ``MOVED`` and ``INTERNAL`` warn for one release, ``REMOVED`` raises an
``AttributeError`` naming the new place. CHANGELOG.md lists every row (tests/cross/test_api_surface.py
checks it).

`MODULES` lists the implementation modules that became private (``jaxmp.transform`` ->
``jaxmp._transform``): importing an old module path still works for one release through a
meta-path finder that warns and hands back the private module itself. A module path whose name
its package also uses for a public function (``jaxmp.diagnostics.precision_report``) has no alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

MOVED = "moved"
INTERNAL = "internal"
REMOVED = "removed"

#: The release after which ``MOVED`` and ``INTERNAL`` rows become ``REMOVED``.
REMOVAL = "0.2.0"

_P = "jaxmp.parallel"

# Old module path -> the private module it is now: one release of warning aliases (kept in sync
# with the package by the maintainers' privatize script; edit by hand only to drop rows at removal).
# --- modules: begin ---
MODULES: tuple[tuple[str, str], ...] = (
    ("jaxmp.collectives", "jaxmp._collectives"),
    ("jaxmp.diagnostics.autocast_ops", "jaxmp.diagnostics._autocast_ops"),
    ("jaxmp.diagnostics.input_pipeline", "jaxmp.diagnostics._input_pipeline"),
    ("jaxmp.diagnostics.jaxpr_walk", "jaxmp.diagnostics._jaxpr_walk"),
    ("jaxmp.dtypes", "jaxmp._dtypes"),
    ("jaxmp.engine.api", "jaxmp.engine._api"),
    ("jaxmp.engine.attention", "jaxmp.engine._attention"),
    ("jaxmp.engine.config", "jaxmp.engine._config"),
    ("jaxmp.engine.contract", "jaxmp.engine._contract"),
    ("jaxmp.engine.control_flow", "jaxmp.engine._control_flow"),
    ("jaxmp.engine.entry", "jaxmp.engine._entry"),
    ("jaxmp.engine.internals", "jaxmp.engine._internals"),
    ("jaxmp.engine.interpreter", "jaxmp.engine._interpreter"),
    ("jaxmp.engine.modules", "jaxmp.engine._modules"),
    ("jaxmp.engine.regions", "jaxmp.engine._regions"),
    ("jaxmp.engine.rules", "jaxmp.engine._rules"),
    ("jaxmp.engine.tested", "jaxmp.engine._tested"),
    ("jaxmp.engine.unscaled", "jaxmp.engine._unscaled"),
    ("jaxmp.engine.values", "jaxmp.engine._values"),
    ("jaxmp.flax.attention", "jaxmp.flax._attention"),
    ("jaxmp.flax.casting", "jaxmp.flax._casting"),
    ("jaxmp.flax.losses", "jaxmp.flax._losses"),
    ("jaxmp.flax.overrides", "jaxmp.flax._overrides"),
    ("jaxmp.flax.steps", "jaxmp.flax._steps"),
    ("jaxmp.flax.train_state", "jaxmp.flax._train_state"),
    ("jaxmp.fold", "jaxmp._fold"),
    ("jaxmp.fp8.formats", "jaxmp.fp8._formats"),
    ("jaxmp.fp8.hardware", "jaxmp.fp8._hardware"),
    ("jaxmp.fp8.ops", "jaxmp.fp8._ops"),
    ("jaxmp.fp8.recipes", "jaxmp.fp8._recipes"),
    ("jaxmp.fp8.scaling", "jaxmp.fp8._scaling"),
    ("jaxmp.fp8.state", "jaxmp.fp8._state"),
    ("jaxmp.grad", "jaxmp._grad"),
    ("jaxmp.loss_scale", "jaxmp._loss_scale"),
    ("jaxmp.opt_state", "jaxmp._opt_state"),
    ("jaxmp.parallel.batching", "jaxmp.parallel._batching"),
    ("jaxmp.parallel.distributed", "jaxmp.parallel._distributed"),
    ("jaxmp.parallel.layouts", "jaxmp.parallel._layouts"),
    ("jaxmp.parallel.per_layer", "jaxmp.parallel._per_layer"),
    ("jaxmp.parallel.pmap", "jaxmp.parallel._pmap"),
    ("jaxmp.parallel.replication", "jaxmp.parallel._replication"),
    ("jaxmp.parallel.sharding", "jaxmp.parallel._sharding"),
    ("jaxmp.platform", "jaxmp._platform"),
    ("jaxmp.policy", "jaxmp._policy"),
    ("jaxmp.presets", "jaxmp._presets"),
    ("jaxmp.skip", "jaxmp._skip"),
    ("jaxmp.step", "jaxmp._step"),
    ("jaxmp.transform", "jaxmp._transform"),
    ("jaxmp.traps", "jaxmp._traps"),
)
# --- modules: end ---

TABLE: tuple[tuple[str, str, str], ...] = (
    # --- jaxmp: names with a home in a subpackage --------------------------------------------
    ("jaxmp.PrecisionOverrides", "jaxmp.flax._overrides.PrecisionOverrides", INTERNAL),
    ("jaxmp.TrainState", "jaxmp.flax.TrainState", MOVED),
    ("jaxmp.mixed_precision", "jaxmp.flax.mixed_precision", MOVED),
    ("jaxmp.GradientStats", "jaxmp.diagnostics.GradientStats", MOVED),
    ("jaxmp.GroupStats", "jaxmp.diagnostics.GroupStats", MOVED),
    ("jaxmp.MatmulOp", "jaxmp.diagnostics.MatmulOp", MOVED),
    ("jaxmp.PipelineOverhead", "jaxmp.diagnostics.PipelineOverhead", MOVED),
    ("jaxmp.RiskyOp", "jaxmp.diagnostics.RiskyOp", MOVED),
    # --- jaxmp: helpers no guide uses (loss_scaling and get_recipe cover them) ---------------
    ("jaxmp.FP32_CATEGORIES", "jaxmp._presets.FLOAT32_CATEGORIES", INTERNAL),
    ("jaxmp.Recommendation", "jaxmp._platform.Recommendation", INTERNAL),
    ("jaxmp.parse_dtype", "jaxmp._dtypes.parse_dtype", INTERNAL),
    ("jaxmp.resolve_policy", "jaxmp._presets.resolve_policy", INTERNAL),
    ("jaxmp.keep_if_finite", "jaxmp._skip.keep_if_finite", INTERNAL),
    ("jaxmp.master_weights", "jaxmp._transform.master_weights", INTERNAL),
    ("jaxmp.unscale_and_skip", "jaxmp._transform.unscale_and_skip", INTERNAL),
    ("jaxmp.MasterWeightsState", "jaxmp._transform.MasterWeightsState", INTERNAL),
    ("jaxmp.find_loss_scaling_state", "jaxmp._opt_state.find_loss_scaling_state", INTERNAL),
    ("jaxmp.first_non_finite", "jaxmp._opt_state.first_non_finite", INTERNAL),
    # --- jaxmp.engine: the autocast names are top-level; the rest are the engine's seams -----
    ("jaxmp.engine.autocast", "jaxmp.autocast", MOVED),
    ("jaxmp.engine.AutocastRules", "jaxmp.AutocastRules", MOVED),
    ("jaxmp.engine.accumulate", "jaxmp.accumulate", MOVED),
    ("jaxmp.engine.float32_region", "jaxmp.float32_region", MOVED),
    ("jaxmp.engine.half_inputs", "jaxmp.half_inputs", MOVED),
    ("jaxmp.engine.region", "jaxmp.autocast_region", MOVED),
    ("jaxmp.engine.PURE_HALF_RULES", "jaxmp.engine._rules.PURE_HALF_RULES", INTERNAL),
    ("jaxmp.engine.AutocastConfig", "jaxmp.engine._config.AutocastConfig", INTERNAL),
    ("jaxmp.engine.flax_config", "jaxmp.engine._config.flax_config", INTERNAL),
    ("jaxmp.engine.resolve_config", "jaxmp.engine._config.resolve_config", INTERNAL),
    ("jaxmp.engine.engine_function", "jaxmp.engine._entry.engine_function", INTERNAL),
    ("jaxmp.engine.explain_enabled", "jaxmp.engine._api.explain_enabled", INTERNAL),
    ("jaxmp.engine.routed_attention", "jaxmp.engine._attention.routed_attention", INTERNAL),
    # --- jaxmp.parallel ------------------------------------------------------------------------
    (f"{_P}.LAYOUTS", f"{_P}._layouts.LAYOUTS", INTERNAL),
    (f"{_P}.leaf_spec", f"{_P}._layouts.leaf_spec", INTERNAL),
    (f"{_P}.batch_sharding", f"{_P}._sharding.batch_sharding", INTERNAL),
    (f"{_P}.is_replicated", f"{_P}._replication.is_replicated", INTERNAL),
    (f"{_P}.prefetch_to_mesh", f"{_P}._sharding.prefetch_to_mesh", INTERNAL),
    (f"{_P}.per_device_batch_size", f"{_P}._batching.per_device_batch_size", INTERNAL),
    (f"{_P}.unshard_batch", f"{_P}._batching.unshard_batch", INTERNAL),
    # --- jaxmp.fp8: the scaling arithmetic and the per-layer state stay in their modules ------
    ("jaxmp.fp8.E4M3", "jaxmp.fp8._formats.E4M3", INTERNAL),
    ("jaxmp.fp8.E5M2", "jaxmp.fp8._formats.E5M2", INTERNAL),
    ("jaxmp.fp8.FP8_DTYPES", "jaxmp.fp8._formats.FP8_DTYPES", INTERNAL),
    ("jaxmp.fp8.fp8_max", "jaxmp.fp8._formats.fp8_max", INTERNAL),
    ("jaxmp.fp8.REDUCTIONS", "jaxmp.fp8._recipes.REDUCTIONS", INTERNAL),
    ("jaxmp.fp8.describe", "jaxmp.fp8._recipes.describe", INTERNAL),
    ("jaxmp.fp8.amax", "jaxmp.fp8._scaling.amax", INTERNAL),
    ("jaxmp.fp8.compute_scale", "jaxmp.fp8._scaling.compute_scale", INTERNAL),
    ("jaxmp.fp8.dequantize", "jaxmp.fp8._scaling.dequantize", INTERNAL),
    ("jaxmp.fp8.qdq", "jaxmp.fp8._scaling.qdq", INTERNAL),
    ("jaxmp.fp8.quantize", "jaxmp.fp8._scaling.quantize", INTERNAL),
    ("jaxmp.fp8.update_meta", "jaxmp.fp8._scaling.update_meta", INTERNAL),
    ("jaxmp.fp8.FP8_COLLECTION", "jaxmp.fp8._state.FP8_COLLECTION", INTERNAL),
    ("jaxmp.fp8.LAYER_TENSORS", "jaxmp.fp8._state.LAYER_TENSORS", INTERNAL),
    ("jaxmp.fp8.Fp8Scales", "jaxmp.fp8._state.Fp8Scales", INTERNAL),
    ("jaxmp.fp8.init_layer_state", "jaxmp.fp8._state.init_layer_state", INTERNAL),
    ("jaxmp.fp8.layer_scales", "jaxmp.fp8._state.layer_scales", INTERNAL),
    ("jaxmp.fp8.native_fp8", "jaxmp.fp8._hardware.native_fp8", INTERNAL),
    # --- jaxmp.flax -----------------------------------------------------------------------------
    # One rule vocabulary: the Flax door takes jaxmp.AutocastRules (jaxmp.flax.default_rules);
    # PrecisionOverrides is kept one release, its methods warning with their AutocastRules spelling.
    ("jaxmp.flax.PrecisionOverrides", "jaxmp.flax._overrides.PrecisionOverrides", INTERNAL),
    ("jaxmp.flax.fp32_softmax_attention", "jaxmp.flax.float32_softmax_attention", MOVED),
    ("jaxmp.flax.ModuleRule", "jaxmp.engine._rules.ModuleRule", INTERNAL),
    ("jaxmp.flax.DEFAULT_HALF_MODULES", "jaxmp.flax._overrides.DEFAULT_HALF_MODULES", INTERNAL),
    ("jaxmp.flax.DEFAULT_NORM_MODULES", "jaxmp.flax._overrides.DEFAULT_NORM_MODULES", INTERNAL),
    # --- jaxmp.diagnostics ---------------------------------------------------------------------
    ("jaxmp.diagnostics.amdahl", "jaxmp.diagnostics._precision_report.amdahl", INTERNAL),
    ("jaxmp.diagnostics.analyze_jaxpr", "jaxmp.diagnostics._precision_report.analyze_jaxpr", INTERNAL),
    ("jaxmp.diagnostics.suggest_loss_scale", "jaxmp.diagnostics._gradient_stats.suggest_loss_scale", INTERNAL),
    # --- removed before 0.1.0: the old places raise an AttributeError naming the new one -----
    *((f"jaxmp.{name}", f"{_P}.{name}", REMOVED) for name in (
        "all_reduce_gradients", "check_replicated", "distributed_info", "initialize_distributed",
        "make_data_mesh", "make_global_batch", "make_pmap_train_step", "make_sharded_train_step",
        "prefetch_to_device", "process_batch_slice", "process_dataset_range",
        "replicate", "replicate_on_mesh", "replicated_sharding", "shard_batch", "unreplicate",
        "DistributedInfo")),
    ("jaxmp.batch_sharding", f"{_P}._sharding.batch_sharding", REMOVED),
    ("jaxmp.prefetch_to_mesh", f"{_P}._sharding.prefetch_to_mesh", REMOVED),
    ("jaxmp.is_replicated", f"{_P}._replication.is_replicated", REMOVED),
    ("jaxmp.per_device_batch_size", f"{_P}._batching.per_device_batch_size", REMOVED),
    ("jaxmp.unshard_batch", f"{_P}._batching.unshard_batch", REMOVED),
    ("jaxmp.policy.half_dtype", "jaxmp.half_dtype", REMOVED),
    ("jaxmp.policy.parse_dtype", "jaxmp._dtypes.parse_dtype", REMOVED),
    ("jaxmp.policy.canonical_float_dtype", "jaxmp._dtypes.canonical_float_dtype", REMOVED),
    ("jaxmp.policy.is_floating_array", "jaxmp._dtypes.is_floating_array", REMOVED),
    ("jaxmp.policy.cast_floating", "jaxmp.cast_floating", REMOVED),
    ("jaxmp.policy.cast_to_full", "jaxmp.cast_to_full", REMOVED),
    ("jaxmp.policy.cast_to_half", "jaxmp.cast_to_half", REMOVED),
    ("jaxmp.policy.FP32_CATEGORIES", "jaxmp._presets.FLOAT32_CATEGORIES", REMOVED),
    ("jaxmp.policy.Recipe", "jaxmp.Recipe", REMOVED),
    ("jaxmp.policy.preset_half_dtype", "jaxmp._presets.preset_half_dtype", REMOVED),
    ("jaxmp.policy.get_recipe", "jaxmp.get_recipe", REMOVED),
    ("jaxmp.policy.get_policy", "jaxmp.get_policy", REMOVED),
    ("jaxmp.policy.as_policy", "jaxmp.as_policy", REMOVED),
    ("jaxmp.policy.Recommendation", "jaxmp._platform.Recommendation", REMOVED),
    ("jaxmp.policy.recommended_policy", "jaxmp.recommended_policy", REMOVED),
    ("jaxmp.transform.TrainingDivergedError", "jaxmp.TrainingDivergedError", REMOVED),
    ("jaxmp.transform.apply_updates", "jaxmp.apply_updates", REMOVED),
    ("jaxmp.transform.check_health", "jaxmp.check_health", REMOVED),
    ("jaxmp.transform.get_loss_scale", "jaxmp.get_loss_scale", REMOVED),
    ("jaxmp.transform.last_step_finite", "jaxmp.last_step_finite", REMOVED),
    ("jaxmp.transform.master_params", "jaxmp.master_params", REMOVED),
    ("jaxmp.transform.scaling_stats", "jaxmp.scaling_stats", REMOVED),
    ("jaxmp.transform.skipped_steps", "jaxmp.skipped_steps", REMOVED),
    ("jaxmp.transform.find_loss_scaling_state", "jaxmp._opt_state.find_loss_scaling_state", REMOVED),
    # --- implementation modules that became private (MODULES above) -------------------------
    *((old, new, INTERNAL) for old, new in MODULES),
)


def _split(path: str) -> tuple[str, str]:
    module, _, name = path.rpartition(".")
    return module, name


def old_names(module: str) -> tuple[str, ...]:
    """``module`` and the old paths it had before it became private (`MODULES`)."""
    return (module, *(old for old, new in MODULES if new == module))


def rows_for(module: str) -> dict[str, tuple[str, str, str]]:
    """``{name: (old module, new place, status)}`` for the names that left ``module`` (under its
    present path or an old one)."""
    names = old_names(module)
    out = {}
    for old, new, status in TABLE:
        old_module, name = _split(old)
        if old_module in names:
            out[name] = (old_module, new, status)
    return out


def resolve(path: str) -> Any:
    """The object at a dotted ``path`` (``jaxmp.flax.TrainState``, ``jaxmp.fp8.scaling.qdq``).

    The longest importable module prefix wins, so a module shadowed by a function of the same
    name in its package (``jaxmp.diagnostics.precision_report``) is still reached.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot resolve {path!r}")


def message(old: str, new: str, status: str) -> str:
    """What the old place says: where the name is now, as an import line."""
    module, name = _split(new)
    how = f"`from {module} import {name}`" if _split(new)[1] == _split(old)[1] else f"`{new}`"
    if status == MOVED:
        return f"{old} moved to {new} ({how}); the old name will be removed in jaxmp {REMOVAL}"
    if status == INTERNAL:
        return (f"{old} is no longer public API; it lives at {new} ({how}), an implementation module "
                f"that may change without notice; the old name will be removed in jaxmp {REMOVAL}")
    return f"{old} was removed; it is {new} now ({how})"


def module_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves ``module``'s rows of `TABLE`.

    ``MOVED``/``INTERNAL`` names warn and return the object at their new place; ``REMOVED`` names
    and unknown names raise ``AttributeError`` (naming the new place where there is one).
    """
    rows = rows_for(module)

    def __getattr__(name: str, stacklevel: int = 2) -> Any:
        # stacklevel: the warning names the line that read the attribute (3 when called through
        # another __getattr__, as jaxmp's own).
        if name in rows:
            old_module, new, status = rows[name]
            text = message(f"{old_module}.{name}", new, status)
            if status == REMOVED:
                raise AttributeError(f"module {module!r} has no attribute {name!r}: {text}")
            warnings.warn(text, DeprecationWarning, stacklevel=stacklevel)
            return resolve(new)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the old paths of `MODULES`: ``import jaxmp.transform`` warns and binds the private
    module itself under the old name, so every object is the same as at its new place."""

    def find_spec(self, fullname, path=None, target=None):
        new = dict(MODULES).get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = dict(MODULES)[spec.name]
        # stacklevel: past importlib's frames to the user's import line.
        warnings.warn(message(spec.name, new, INTERNAL), DeprecationWarning, stacklevel=_import_stacklevel())
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the private module is already executed


def _import_stacklevel() -> int:
    """The stacklevel of the first frame outside importlib and this module (the import line);
    ``warnings`` itself skips importlib's bootstrap frames when it counts, so they are not counted."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib"))
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
        filename = frame.f_code.co_filename if frame is not None else ""
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
    return level


# First on the path: an old module path is an alias even where another finder (an editable install
# of an older checkout) could still find a file under that name.
if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())

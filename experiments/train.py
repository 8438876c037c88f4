"""Training and evaluation loop, built on jaxmp's public API only.

One call, :func:`train_and_evaluate`, trains a config under one precision policy:

* the model is a plain Linen module run under the policy by ``jaxmp.flax.mixed_precision``
  (half matmuls/convs, fp32 norms, fp32 logits);
* the optimizer is ``jaxmp.loss_scaling(inner, loss_scale, master_weights=...)`` with the
  recipe's loss scale and master weights, the gradient comes from ``jaxmp.value_and_grad``
  and the new params from ``jaxmp.apply_updates``;
* data parallelism is sharded ``jit`` over ``jaxmp.parallel.make_data_mesh`` (the batch is
  split over the devices, the state replicated, XLA inserts the gradient all-reduce);
* the whole state is checkpointed with orbax; a run started again in the same workdir
  resumes exactly (same batches, same RNG, same loss-scale counters).

It returns (and writes to ``<workdir>/results.json``) the numbers of seed 000's table:
wall time, steps/s, examples/s, peak memory, final validation accuracy, skipped
steps and final loss scale, plus the history the plots are drawn from.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

import jaxmp
import jaxmp.flax
import jaxmp.parallel as mpp
from experiments import data as data_lib
from experiments import models as models_lib
from experiments.checkpoint import Checkpointer
from experiments.cli import UserError

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


# ----------------------------------------------------------------------------------------------
# Config validation: every user mistake becomes one clear UserError before any work starts.


class Plan(NamedTuple):
    """The numbers a run derives from its config (all explicit, all logged)."""

    policy: str
    seed: int
    num_devices: int
    per_device_batch_size: int
    global_batch_size: int
    eval_batch_size: int
    learning_rate: float
    steps_per_epoch: int
    num_train_steps: int
    warmup_steps: int


def say(message: str) -> None:
    """Progress messages on stderr (absl's INFO level would also show orbax's chatter)."""
    if not _QUIET:
        print(message, file=sys.stderr, flush=True)


_QUIET = False


def _check_choice(value: str, choices, field: str) -> None:
    if value not in choices:
        raise UserError(f"unknown {field} {value!r}: choose one of {', '.join(choices)} (--config.{field}=...).")


def validate_config(config, *, policy: str | None = None, seed: int | None = None,
                    num_train_examples: int | None = None) -> Plan:
    """Checks a config and derives the run's numbers.

    Args:
      config: the experiment config.
      policy: overrides ``config.policy`` (compare.py).
      seed: overrides ``config.seed``.
      num_train_examples: the training split's size (to turn epochs into steps).

    Returns:
      The :class:`Plan`.

    Raises:
      UserError: an unknown name, a batch that does not divide the devices, more devices
        than are available, or a non-positive length.
    """
    policy = config.policy if policy is None else policy
    try:
        jaxmp.get_recipe(policy)
    except (ValueError, TypeError) as e:
        raise UserError(f"{e} (--config.policy / --config.compare_policies)") from None
    for p in config.compare_policies:
        try:
            jaxmp.get_recipe(p)
        except (ValueError, TypeError) as e:
            raise UserError(f"in compare_policies: {e}") from None
    _check_choice(config.model, tuple(models_lib.MODELS), "model")
    _check_choice(config.dataset, data_lib.DATASETS, "dataset")
    _check_choice(config.optimizer, OPTIMIZERS, "optimizer")
    _check_choice(config.lr_schedule, SCHEDULES, "lr_schedule")
    if config.loss_scale:
        try:
            jaxmp.make_loss_scale(config.loss_scale)
        except ValueError as e:
            raise UserError(f"--config.loss_scale: {e}") from None

    n, available = int(config.num_devices), jax.device_count()
    if n < 1:
        raise UserError(f"num_devices must be >= 1, got {n}")
    if n > available:
        raise UserError(
            f"this config wants {n} devices but only {available} {jax.devices()[0].platform} device(s) "
            f"are visible. Use a config for this machine (e.g. --config=experiments/configs/cpu.py) or "
            f"--config.num_devices={available} (the global batch becomes {available} x per_device_batch_size).")
    global_batch = int(config.global_batch_size)
    if global_batch < 1:
        raise UserError(f"global_batch_size must be >= 1, got {global_batch}")
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
    if eval_batch < 1 or eval_batch % n:
        raise UserError(f"eval_batch_size {eval_batch} must be a positive multiple of num_devices {n}.")

    spe = data_lib.steps_per_epoch(num_train_examples, global_batch) if num_train_examples else 1
    steps = int(config.num_train_steps) if config.num_train_steps > 0 else int(math.ceil(config.num_epochs * spe))
    if steps < 1:
        raise UserError("nothing to train: set num_epochs > 0 or num_train_steps > 0")
    warmup = min(int(round(config.warmup_epochs * spe)), steps)
    return Plan(policy=policy, seed=int(config.seed if seed is None else seed), num_devices=n,
                per_device_batch_size=per_device, global_batch_size=global_batch, eval_batch_size=eval_batch,
                learning_rate=float(config.learning_rate), steps_per_epoch=spe, num_train_steps=steps,
                warmup_steps=warmup)


# ----------------------------------------------------------------------------------------------
# Model, optimizer, state.


def _model_kwargs(config) -> dict:
    """``config.model_kwargs`` as plain, hashable Python values (lists -> tuples)."""
    def fix(v):
        return tuple(fix(x) for x in v) if isinstance(v, (list, tuple)) else v
    return {k: fix(v) for k, v in config.model_kwargs.to_dict().items()}


def make_schedule(config, plan: Plan) -> optax.Schedule:
    """Linear warm-up to ``learning_rate``, then cosine / linear decay to 0, or constant."""
    lr, warmup, total = plan.learning_rate, plan.warmup_steps, plan.num_train_steps
    if config.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), 0.0)
    ramp = optax.linear_schedule(0.0, lr, max(warmup, 1))
    after = (optax.linear_schedule(lr, 0.0, max(total - warmup, 1)) if config.lr_schedule == "linear"
             else optax.constant_schedule(lr))
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(config, plan: Plan, recipe) -> optax.GradientTransformation:
    """The inner optax chain wrapped in ``jaxmp.loss_scaling`` with the recipe's settings.

    Clipping sits *inside* the wrapper, so it sees unscaled gradients (seed 004's pitfall).
    Weight decay applies to kernels only (ndim > 1), not to biases and norm scales.
    """
    schedule = make_schedule(config, plan)
    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    parts = []
    if config.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip_norm))
    if config.optimizer == "adamw":
        parts.append(optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask))
    else:
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=decay_mask))
        parts.append(optax.sgd(schedule, momentum=config.momentum, nesterov=config.nesterov))
    loss_scale = config.loss_scale or recipe.loss_scale
    return jaxmp.loss_scaling(optax.chain(*parts), loss_scale, master_weights=recipe.master_weights)


def make_loss_fn(num_classes: int, label_smoothing: float = 0.0):
    """``loss_fn(logits, labels) -> scalar`` for ``jaxmp.flax.make_train_step``, in float32.

    Without smoothing this is jaxmp's own fp32 cross-entropy.
    """
    if not label_smoothing:
        return jaxmp.flax.softmax_cross_entropy

    def loss_fn(logits, labels):
        onehot = optax.smooth_labels(jax.nn.one_hot(labels, num_classes, dtype=jnp.float32), label_smoothing)
        return jaxmp.flax.softmax_cross_entropy(logits.astype(jnp.float32), onehot)

    return loss_fn


def make_steps(config, num_classes: int, input_key: str):
    """Returns ``(train_step, eval_step)`` (not yet jitted).

    ``train_step(state, batch, rng) -> (state, metrics)`` is ``jaxmp.flax.make_train_step``
    (scaled loss, unscale/check/skip in the optimizer, BatchNorm statistics kept on skipped
    steps) plus the skip counters for logging. ``eval_step(state, batch)`` returns sums of
    correct predictions, loss and examples over the unmasked part of a padded batch.
    """
    base_step = jaxmp.flax.make_train_step(loss_fn=make_loss_fn(num_classes, config.label_smoothing),
                                           model_kwargs={"train": True})

    def train_step(state, batch, rng):
        state, metrics = base_step(state, batch, rng)
        stats = jaxmp.scaling_stats(state.opt_state)
        metrics.update(total_skips=stats["total_skips"], consecutive_skips=stats["consecutive_skips"],
                       next_loss_scale=stats["loss_scale"])
        return state, metrics

    def eval_step(state, batch):
        logits = state.model.apply(state.variables, batch[input_key], train=False).astype(jnp.float32)
        labels, mask = batch["label"], batch["mask"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return {"correct": jnp.sum(correct * mask), "loss": jnp.sum(loss * mask), "count": jnp.sum(mask)}

    return train_step, eval_step


class Program(NamedTuple):
    """What a run compiles: the model under its policy, the optimizer and the jitted functions."""

    model: Any
    tx: Any
    mesh: Any
    init: Any          # jit: (key, sample input) -> jaxmp.flax.TrainState
    train_step: Any    # jit: (state, batch, rng) -> (state, metrics), state donated
    eval_step: Any     # jit: (state, padded batch) -> sums
    compiled: dict     # the AOT-compiled train step, once lowered


_PROGRAMS: dict[str, Program] = {}
# Config fields that never change what is compiled (bookkeeping, or only read on the host).
_NOT_COMPILED = ("seed", "num_seeds", "policy", "compare_policies", "log_every_steps", "eval_every_steps",
                 "checkpoint_every_steps", "keep_checkpoints", "progress_bar", "max_consecutive_skips",
                 "data_dir", "cache_data")


def _program(config, plan: Plan, recipe, module, num_classes: int, source) -> Program:
    """Builds (or reuses) the run's :class:`Program`.

    Runs that differ only in the seed -- the seeds of one comparison -- share one, so the
    train step is compiled once per policy rather than once per run: the seed enters only
    through the initial state, the data order and the dropout key, all runtime values.
    """
    cfg = config.to_dict()
    for field in _NOT_COMPILED:
        cfg.pop(field, None)
    key = json.dumps([cfg, plan._replace(seed=0), num_classes, source.input_key, list(source.input_shape)],
                     sort_keys=True, default=str)
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    model = jaxmp.flax.mixed_precision(module, plan.policy)
    tx = make_optimizer(config, plan, recipe)
    mesh = mpp.make_data_mesh(jax.devices()[:plan.num_devices])
    replicated = mpp.replicated_sharding(mesh)
    train_step, eval_step = make_steps(config, num_classes, source.input_key)

    def create(key, x):
        return jaxmp.flax.TrainState.create(model, model.init(key, x, train=False), tx)

    def init(key, x):
        # One jitted init instead of eager op-by-op execution (hundreds of tiny compiles). It runs
        # once, so on CPU it is compiled without LLVM optimisation: the random initialisers
        # (threefry per parameter) otherwise take 3-5x longer to compile than to run.
        lowered = jax.jit(create).lower(key, x)
        fast = {"xla_backend_optimization_level": 0} if jax.devices()[0].platform == "cpu" else None
        return lowered.compile(compiler_options=fast)(key, x)

    prog = Program(model, tx, mesh, init,
                   jax.jit(train_step, out_shardings=(replicated, replicated), donate_argnums=0),
                   jax.jit(eval_step), {})
    if len(_PROGRAMS) >= 8:  # a comparison holds one per policy; drop the oldest beyond that
        _PROGRAMS.pop(next(iter(_PROGRAMS)))
    _PROGRAMS[key] = prog
    return prog


# ----------------------------------------------------------------------------------------------
# Measurements.


def compiled_memory(compiled) -> int | None:
    """Bytes the compiled step needs per device: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def device_peak_memory() -> int | None:
    """Peak bytes in use on the first device, where the backend reports it (GPU, TPU; not CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _history_path(workdir: str) -> str:
    return os.path.join(workdir, "history.jsonl")


def _write_history(workdir: str, history: list[dict]) -> None:
    tmp = _history_path(workdir) + ".tmp"
    with open(tmp, "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, _history_path(workdir))


def _progress(total: int, initial: int, desc: str, enabled: bool):
    """A tqdm bar on stderr (or a no-op object when disabled)."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=1.0,
                    file=sys.stderr, leave=False)

    class _Null:
        def update(self, n=1): pass
        def set_postfix(self, *a, **k): pass
        def close(self): pass

    return _Null()


# ----------------------------------------------------------------------------------------------
# The loop.


def to_device(batch: dict, mesh) -> dict:
    """Host batch (the same global batch on every process) -> global arrays sharded over the mesh.

    Each process keeps only its own rows (``jaxmp.parallel.process_batch_slice``); with one
    process that is the whole batch.
    """
    rows = mpp.process_batch_slice(len(batch["label"]))
    return mpp.make_global_batch({k: v[rows] for k, v in batch.items()}, mesh)


def evaluate(eval_step, state, source, eval_batch_size: int, mesh) -> dict:
    """Accuracy and mean loss over the whole evaluation split (padding masked out)."""
    totals = {"correct": 0.0, "loss": 0.0, "count": 0.0}
    for batch in source.eval_batches(eval_batch_size):
        out = jax.device_get(eval_step(state, to_device(batch, mesh)))
        for k in totals:
            totals[k] += float(out[k])
    n = max(totals["count"], 1.0)
    return {"val_accuracy": totals["correct"] / n, "val_loss": totals["loss"] / n}


def train_and_evaluate(config, workdir: str, *, policy: str | None = None, seed: int | None = None,
                       report: bool = False, desc: str | None = None) -> dict:
    """Trains ``config`` under one policy in ``workdir`` (resuming if it holds a checkpoint).

    Args:
      config: the experiment config.
      workdir: checkpoints, ``history.jsonl`` and ``results.json`` go here.
      policy: overrides ``config.policy``.
      seed: overrides ``config.seed``.
      report: also run jaxmp's diagnostics and write ``report.txt``.
      desc: progress-bar label.

    Returns:
      The results dict (also written to ``<workdir>/results.json``).
    """
    t_start = time.perf_counter()
    validate_config(config, policy=policy, seed=seed)  # names and devices, before loading data
    try:
        train_src, eval_src = data_lib.get_datasets(config)
    except ValueError as e:
        raise UserError(str(e)) from None
    plan = validate_config(config, policy=policy, seed=seed, num_train_examples=train_src.num_examples)
    os.makedirs(workdir, exist_ok=True)
    recipe = jaxmp.get_recipe(plan.policy)
    num_classes = train_src.num_classes
    try:
        module = models_lib.get_model(config.model, num_classes, **_model_kwargs(config))
    except ValueError as e:
        raise UserError(str(e)) from None
    prog = _program(config, plan, recipe, module, num_classes, train_src)
    say(f"{plan.policy} ({recipe.policy}, loss scale {config.loss_scale or recipe.loss_scale}, master weights "
        f"{recipe.master_weights}), seed {plan.seed}: {plan.num_devices} device(s) x {plan.per_device_batch_size} "
        f"= global batch {plan.global_batch_size}, lr {plan.learning_rate:.4g}, warm-up {plan.warmup_steps} "
        f"of {plan.num_train_steps} steps")

    mesh = prog.mesh
    sample = np.zeros((1, *train_src.input_shape), np.float32)
    state = mpp.replicate_on_mesh(prog.init(jax.random.key(plan.seed), sample), mesh)

    ckpt = Checkpointer(workdir, max_to_keep=config.keep_checkpoints)
    meta = {"policy": plan.policy, "seed": plan.seed, "model": config.model, "dataset": config.dataset,
            "global_batch_size": plan.global_batch_size, "num_train_steps": plan.num_train_steps}
    start, history = 0, []
    if ckpt.latest_step() is not None:
        state, saved = ckpt.restore(state, meta)
        start = int(saved["data_position"])
        # The history travels inside the checkpoint, so it is exactly as of the restored step.
        history = [r for r in saved.get("history", []) if r["step"] <= start]
        say(f"resumed from {ckpt.directory} at step {start}")
        done = os.path.join(workdir, "results.json")
        if start >= plan.num_train_steps and os.path.exists(done):
            # Finished before: report what that run measured instead of a 0-step "run".
            ckpt.close()
            with open(done) as f:
                return {**json.load(f), "reused": True}

    # Dropout keys: a function of (seed, step) only, so a resumed run draws the same ones.
    rng = jax.random.key(plan.seed + 1)
    batches = train_src.train_batches(plan.global_batch_size, seed=plan.seed, start=start)
    eval_jit, step_fn = prog.eval_step, prog.train_step

    # Compile ahead of time: the compile is timed on its own and the executable's memory
    # analysis is the memory figure where the backend has no allocator statistics (CPU).
    t0 = time.perf_counter()
    first = to_device(next(batches), mesh)
    compiled = prog.compiled.get("train")
    if compiled is None:  # the other seeds of a comparison reuse the first one's executable
        compiled = prog.compiled["train"] = step_fn.lower(state, first, rng).compile()
    compile_time = time.perf_counter() - t0
    mem_compiled = compiled_memory(compiled)

    result: dict[str, Any] = {"diverged": False}
    bar = _progress(plan.num_train_steps, start, desc or f"{plan.policy} seed {plan.seed}", config.progress_bar)
    train_time, pending, step = 0.0, [], start
    batch = first
    t_loop = time.perf_counter()
    try:
        while step < plan.num_train_steps:
            state, metrics = compiled(state, batch, rng)
            pending.append(metrics)
            step += 1
            bar.update(1)
            if step < plan.num_train_steps:
                batch = to_device(next(batches), mesh)
            is_last = step == plan.num_train_steps
            do_log = step % config.log_every_steps == 0 or is_last
            do_eval = step % config.eval_every_steps == 0 or is_last
            do_ckpt = step % config.checkpoint_every_steps == 0 or is_last
            if not (do_log or do_eval or do_ckpt):
                continue
            # Everything below is bookkeeping: stop the training clock while it runs.
            jax.block_until_ready(state)
            train_time += time.perf_counter() - t_loop
            row = {"step": step}
            if pending:
                ms = jax.device_get(pending)
                pending = []
                row.update(train_loss=float(np.mean([m["loss"] for m in ms])),
                           train_accuracy=float(np.mean([m["accuracy"] for m in ms])),
                           loss_scale=float(ms[-1]["next_loss_scale"]), total_skips=int(ms[-1]["total_skips"]))
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", scale=f"{row['loss_scale']:g}",
                                skips=row["total_skips"], refresh=False)
                if int(ms[-1]["consecutive_skips"]) > config.max_consecutive_skips:
                    logging.error("%s: %d steps in a row had non-finite gradients; stopping (not converged).",
                                  plan.policy, int(ms[-1]["consecutive_skips"]))
                    result["diverged"] = True
            if do_eval or result["diverged"]:
                row.update(evaluate(eval_jit, state, eval_src, plan.eval_batch_size, mesh))
            history.append(row)
            if do_ckpt or result["diverged"]:
                ckpt.save(step, state, {**meta, "data_position": step, "history": history})
                _write_history(workdir, history)
            if result["diverged"]:
                break
            t_loop = time.perf_counter()
        else:
            train_time += time.perf_counter() - t_loop
    finally:
        bar.close()
        ckpt.close()
    if result["diverged"] and "val_accuracy" not in history[-1]:
        history[-1].update(evaluate(eval_jit, state, eval_src, plan.eval_batch_size, mesh))

    steps_run = step - start
    final = history[-1] if history else {}
    stats = jax.device_get(jaxmp.scaling_stats(state.opt_state))
    mem_device = device_peak_memory()
    result.update({
        "policy": plan.policy,
        "seed": plan.seed,
        "dtypes": str(recipe.policy),
        "num_classes": num_classes,
        "loss_scaling": str(config.loss_scale or recipe.loss_scale),
        "master_weights": recipe.master_weights,
        "config": {"model": config.model, "dataset": config.dataset, **plan._asdict()},
        "device": f"{plan.num_devices} x {jax.devices()[0].device_kind}",
        "steps": int(step),
        "steps_this_run": int(steps_run),
        "resumed_from": int(start),
        "wall_time_s": time.perf_counter() - t_start,
        "compile_time_s": compile_time,
        "train_time_s": train_time,
        "steps_per_s": steps_run / train_time if train_time > 0 else float("nan"),
        "examples_per_s": steps_run * plan.global_batch_size / train_time if train_time > 0 else float("nan"),
        "peak_memory_bytes": mem_device if mem_device is not None else mem_compiled,
        "memory_source": ("device.memory_stats() peak_bytes_in_use" if mem_device is not None
                          else "compiled train step, memory_analysis() (args + outputs + temps)"),
        "compiled_step_memory_bytes": mem_compiled,
        "val_accuracy": final.get("val_accuracy"),
        "val_loss": final.get("val_loss"),
        "train_loss": final.get("train_loss"),
        "skipped_steps": int(stats["total_skips"]),
        "final_loss_scale": float(stats["loss_scale"]),
        "history": history,
    })
    if report:
        result["report"] = run_report(prog, compiled, state, batches, rng, plan.policy, workdir)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def summary_line(r: dict) -> str:
    """One line per run for the console."""
    acc = "n/a" if r["val_accuracy"] is None else f"{100 * r['val_accuracy']:.2f}%"
    return (f"{r['policy']} seed {r['seed']}: val accuracy {acc}, {r['steps']} steps, "
            f"{r['steps_per_s']:.1f} steps/s, {r['examples_per_s']:.0f} examples/s, wall {r['wall_time_s']:.1f} s, "
            f"skipped {r['skipped_steps']}, loss scale {r['final_loss_scale']:g}"
            + (" (DIVERGED)" if r.get("diverged") else ""))


# ----------------------------------------------------------------------------------------------
# --report: jaxmp's diagnostics, when they are there.


def run_report(prog: Program, compiled, state, batches, rng, policy: str, workdir: str,
               pipeline_steps: int = 20) -> dict:
    """Runs jaxmp's diagnostics on the trained state; writes ``report.txt`` (+ a gradient PNG).

    * ``jaxmp.precision_report`` of the train step: dtype, FLOPs and Tensor-Core eligibility
      of every matmul/conv, risky half-precision reductions, missed half ops;
    * ``jaxmp.gradient_stats`` of one batch's (unscaled) gradients: what fp16 would flush to
      zero or overflow at the current loss scale, and a suggested static scale;
    * ``jaxmp.input_pipeline_overhead``: how much of a step waits for data (seed 000's
      two-vCPU bottleneck).

    A diagnostic that fails is reported as failed; it never fails the run. The state is
    consumed (the timed steps donate it), so call this last.
    """
    lines, out = [], {}
    mesh = prog.mesh

    def section(name, fn):
        try:
            value = fn()
            out[name] = value if isinstance(value, (str, float, int)) else str(value)
            lines.append(f"== {name} ==\n{value}")
        except Exception as e:  # noqa: BLE001 - a diagnostic must never fail the run
            lines.append(f"== {name} == failed: {type(e).__name__}: {e}")

    batch = to_device(next(batches), mesh)
    # Traced without the dropout key: PRNG-key values in the jaxpr trip the report's dtype checks,
    # and the matmul/conv precision it reports does not depend on dropout.
    section("precision_report", lambda: jaxmp.precision_report(
        jax.jit(lambda s, b: prog.train_step(s, b, None)), state, batch, policy=policy).summary())

    def grads():
        x, y = jaxmp.flax.losses.split_batch(batch)

        def loss_fn(params):
            logits = state.model.apply({"params": params, **state.model_state}, x, train=False)
            return jaxmp.flax.softmax_cross_entropy(logits, y)

        scale = jaxmp.get_loss_scale(state.opt_state)
        _, g = jax.jit(jaxmp.value_and_grad(loss_fn, scale))(state.params)
        g = scale.unscale(g)  # what the optimizer sees
        stats = jaxmp.gradient_stats(g, loss_scale=scale)
        stats.plot(os.path.join(workdir, "gradient_stats.png"))
        return stats.summary()

    section("gradient_stats", grads)
    global_batches = (to_device(b, mesh) for b in batches)
    section("input_pipeline_overhead", lambda: jaxmp.input_pipeline_overhead(
        lambda s, b: compiled(s, b, rng), state, global_batches, num_steps=pipeline_steps, has_aux=True,
        device_put=False).summary())
    with open(os.path.join(workdir, "report.txt"), "w") as fh:
        fh.write("\n\n".join(lines) + "\n")
    say("\n\n".join(lines))
    return out


if __name__ == "__main__":  # pragma: no cover - used by compare.py --isolate
    import pickle

    with open(sys.argv[1], "rb") as fh:
        job = pickle.load(fh)
    res = train_and_evaluate(job["config"], job["workdir"], policy=job["policy"], seed=job["seed"],
                             report=job.get("report", False), desc=job.get("desc"))
    print(summary_line(res))

"""Precision reports of the experiments' real train steps: ResNet-9 and the Transformer encoder.

For each model and policy this builds the train step exactly as ``experiments.train`` does
(``jaxmp.flax.mixed_precision`` model, ``jaxmp.loss_scaling`` optimizer, the jitted
``make_train_step``) and prints ``jaxmp.precision_report``'s summary line and top ops. It only
traces: the state and batch are ``jax.ShapeDtypeStruct`` placeholders, nothing is compiled,
run or downloaded, so it needs no GPU and takes seconds.

    python -m experiments.precision_reports
    python -m experiments.precision_reports --batch_size=256 --policies=O0,O1-fp16,O2-fp16 --models=resnet9
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_collections

import jaxmp
import jaxmp.flax
from experiments import configs as configs_lib
from experiments import models as models_lib
from experiments import program as program_lib
from experiments.validation import UserError, validate_config
from jaxmp.diagnostics import _format as jaxmp_fmt

# name -> (config file the run starts from, overrides).
SETUPS = {
    # DavidNet on CIFAR-10 shapes (the TPU config, on one device here).
    "resnet9": ("tpu_v3_8", {"model": "resnet9", "dataset": "fake", "fake_input_shape": (32, 32, 3),
                             "model_kwargs": {"width": 64}}),
    # A small encoder on length-128 sequences (one scalar feature per token), dims multiples of 8.
    "transformer": ("cpu", {"model": "transformer", "dataset": "fake", "fake_input_shape": (128,),
                            "model_kwargs": {"num_layers": 4, "model_dim": 256, "num_heads": 4, "mlp_dim": 1024}}),
}
DEFAULT_POLICIES = ("O0", "O2-fp16", "O2-bf16")


def make_config(model: str, batch_size: int, input_shape=None, **model_kwargs) -> ml_collections.ConfigDict:
    """The experiment config of ``model`` on one device, with ``batch_size`` examples per step.

    Args:
      model: a key of `SETUPS`.
      batch_size: the global (= per-device) batch.
      input_shape: one example's shape (default: the setup's).
      **model_kwargs: module attributes overriding the setup's (e.g. a tiny width for tests).
    """
    if model not in SETUPS:
        raise UserError(f"unknown model {model!r}: choose one of {', '.join(SETUPS)}")
    name, overrides = SETUPS[model]
    config = configs_lib.get_config(name)
    config.num_devices = 1
    config.per_device_batch_size = int(batch_size)  # global batch and learning rate follow
    for key, value in overrides.items():
        if key == "model_kwargs":
            config.model_kwargs = ml_collections.ConfigDict({**value, **model_kwargs})
        else:
            config[key] = value
    if input_shape is not None:
        config.fake_input_shape = tuple(input_shape)
    return config


def build(model: str, policy: str, batch_size: int = 128, input_shape=None, **model_kwargs):
    """The experiments' train step of ``model`` under ``policy`` and placeholders to trace it with.

    The model, optimizer and jitted step are ``experiments.train``'s own ``Program`` (what a
    training run compiles); the state is ``jax.eval_shape`` of the run's ``TrainState.create``,
    so nothing is initialised, compiled or run.

    Args:
      model: ``"resnet9"`` or ``"transformer"``.
      policy: a jaxmp recipe name (``"O0"``, ``"O2-fp16"``...).
      batch_size: examples per step.
      input_shape: one example's shape (default: CIFAR 32x32x3 / 128 tokens).
      **model_kwargs: module attributes overriding the default size.

    Returns:
      ``(train_step, (state, batch, rng), policy)``: ``train_step(state, batch, rng)``.
    """
    config = make_config(model, batch_size, input_shape, **model_kwargs)
    plan = validate_config(config, policy=policy)
    num_classes = int(config.num_classes)
    shape = tuple(config.fake_input_shape)
    module = models_lib.get_model(config.model, num_classes, **program_lib.model_kwargs(config))
    hp = {k: config[k] for k in program_lib.OPTIMIZER_FIELDS}
    prog = program_lib.build_program(plan, module, hp, num_classes, "x" if len(shape) == 1 else "image", shape)

    sample = jax.ShapeDtypeStruct((1, *shape), jnp.float32)  # train.py initialises on one example
    state = jax.eval_shape(
        lambda key, x: jaxmp.flax.TrainState.create(prog.model, prog.model.init(key, x, train=False), prog.tx),
        jax.random.key(plan.seed), sample)
    batch = {"x" if len(shape) == 1 else "image": jax.ShapeDtypeStruct((plan.global_batch_size, *shape), jnp.float32),
             "label": jax.ShapeDtypeStruct((plan.global_batch_size,), jnp.int32)}
    return prog.train_step, (state, batch, jax.random.key(plan.seed + 1)), plan.policy


def train_step_report(model: str, policy: str, batch_size: int = 128, input_shape=None,
                      **model_kwargs) -> jaxmp.PrecisionReport:
    """``jaxmp.precision_report`` of `build`'s train step (same arguments)."""
    step, args, policy = build(model, policy, batch_size, input_shape, **model_kwargs)
    return jaxmp.precision_report(step, *args, policy=policy)


def _grid(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def compact_table(rep: jaxmp.PrecisionReport, max_rows: int = 6) -> str:
    """The top ops, two lines each (flagged first, then by FLOPs, as ``rep.table()`` orders
    them), and the risky ops grouped by kind and source line, in 88 columns: one dtype column
    (``lhs,rhs->accumulation``, or one name where all three agree), each op's module path on a
    line of its own, paths too long for the line keeping their end after ``...``.
    ``rep.table()`` has every column; ``rep.to_dict()`` every path whole."""
    order = sorted(range(len(rep.ops)), key=lambda i: (
        not (rep.ops[i].missed or rep.ops[i].shape_problems), -rep.ops[i].flops, i))
    rows = [["#", "op", "dtypes", "MxNxK", "FLOPs", "TC", "flags"]]
    for i in order[:max_rows]:
        op = rep.ops[i]
        flags = (["MISSED"] if op.missed else []) + [f"not x{rep.tc_multiple}: {p}" for p in op.shape_problems]
        dtypes = {op.lhs_dtype, op.rhs_dtype, op.accum_dtype}
        rows.append([str(i), "dot" if op.primitive == "dot_general" else "conv",
                     op.lhs_dtype if len(dtypes) == 1 else f"{op.lhs_dtype},{op.rhs_dtype}->{op.accum_dtype}",
                     f"{op.m}x{op.n}x{op.k}" + (f" (B={op.batch})" if op.batch > 1 else ""),
                     jaxmp_fmt.fmt_count(op.flops), "yes" if op.tensor_core_eligible else "no", "; ".join(flags)])
    grid = _grid(rows)
    out = grid[:1]
    for i, line in zip(order[:max_rows], grid[1:]):
        out += [line, _path_line(rep.ops[i].name)]
    if len(order) > max_rows:
        out.append(f"  ... {len(order) - max_rows} more ops")
    groups: dict = {}
    for r in rep.risky:
        src = r.source.rsplit("/", 1)[-1].split(" ")[0].rsplit(":", 1)[0]  # file:line
        g = groups.setdefault((r.category, r.primitive, r.dtype, src), [0, r, []])
        g[0] += 1
        if math.prod(r.shape) > math.prod(g[1].shape):
            g[1] = r
        name = re.sub(r"_\d+", "_N", r.name)  # one entry for all layers
        if name and name not in g[2]:
            g[2].append(name)
    for (cat, prim, dtype, src), (n, big, names) in groups.items():
        out.append(f"  risky: {n} x {cat} {prim} in {dtype} (largest {dtype}[{','.join(map(str, big.shape))}])")
        where, path = f"@ {src}", ""
        fn = re.search(r"\((\w+)", big.source or "")
        if not names and fn:  # not inside a module: name the function
            where += f" ({fn.group(1)})"
        if len(names) == 1:
            path = names[0]
        elif names:  # the common module path, then what differs
            parts = [x.split("/") for x in names]
            k = next((i for i, col in enumerate(zip(*parts)) if len(set(col)) > 1), min(map(len, parts)))
            path = f"{'/'.join(parts[0][:k])}/{{{', '.join('/'.join(p[k:]) for p in parts)}}}"
        out.append(_path_line(path, f"{where} in " if path else where))
    return "\n".join(out)


def _path_line(path: str, prefix: str = "") -> str:
    """``prefix`` and ``path`` indented under their row, the path's end kept after ``...``
    where the line would pass 88 characters."""
    indent = "      " + prefix
    return indent + jaxmp_fmt.clip_left(path, jaxmp_fmt.WIDTH - len(indent)) if path else indent


def main(argv) -> None:
    del argv  # cli.run rejects extra arguments
    from absl import flags

    f = flags.FLAGS
    for model in f.models:
        for policy in f.policies:
            rep = train_step_report(model, policy, f.batch_size)
            print(f"{model}, batch {f.batch_size}, {policy}:")
            print(jaxmp_fmt.wrap(rep.summary()))
            print(rep.table(max_rows=f.max_rows, width=f.width) if f.full else compact_table(rep, f.max_rows))
            print()


if __name__ == "__main__":
    from absl import flags

    from experiments import cli

    flags.DEFINE_integer("batch_size", 128, "examples per train step", lower_bound=1)
    flags.DEFINE_list("policies", list(DEFAULT_POLICIES), "jaxmp recipes to report")
    flags.DEFINE_list("models", list(SETUPS), "models to report (resnet9, transformer)")
    flags.DEFINE_integer("max_rows", 6, "ops per table (flagged ops first, then by FLOPs)", lower_bound=1)
    flags.DEFINE_bool("full", False, "print PrecisionReport.table() (every column) instead of the compact one")
    flags.DEFINE_integer("width", 160, "characters per line of --full tables", lower_bound=40)
    cli.run(main, parse=False)

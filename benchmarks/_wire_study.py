"""The wire-options fidelity study (issue 63): the small LM and the MNIST-1D CNN under ZeRO or FSDP
on the 8 simulated devices, each quantized-collective option against the unquantized sharded run.

Shared by ``benchmarks/wire_fidelity.py --study`` and its dry-run test. Both models train with
bf16 params (the CNN under ``jaxmp.flax.mixed_precision(..., "O2-bf16")``, the LM as a plain Flax
module on bf16 params: see ``_Task``), float32 masters (``jaxmp.loss_scaling(...,
master_weights=True)``: ZeRO's ``gather_bits`` needs them) and AdamW with warm-up and cosine decay
to 0, through `jaxmp.parallel.make_sharded_train_step`; the option is the only difference between
the runs of one seed. The verdict is benchmarks/fidelity.py's: an option is *within* when the mean
over seeds of its final eval loss is within ``max(spread_ref, 1% of |mean_ref|)`` of the
unquantized run's mean, ``spread_ref`` being max - min over the unquantized run's seeds.
"""

from __future__ import annotations

import time
from typing import Any


#: Option name -> (gather_bits, reduce_bits); the first is the reference.
OPTIONS = {"unquantized": (None, None), "gather 8": (8, None), "reduce 8": (None, 8), "reduce 4": (None, 4),
           "gather 8 + reduce 4": (8, 4)}
REFERENCE = "unquantized"
N = 8
#: Sizes of the study and of the dry run. LM: benchmarks/_lm.py's CausalLM on the standard
#: library's docstrings; CNN: experiments/models/cnn.py's CNN1D (BatchNorm) on MNIST-1D (4000 train).
FULL = {"lm": dict(context=32, width=64, num_layers=2, num_heads=4, mlp_dim=256, batch_size=16, steps=100,
                   warmup=10, learning_rate=3e-3, eval_windows=128, max_chars=None),
        "cnn": dict(features=(32, 32, 32), kernel_sizes=(5, 3, 3), batch_size=128, steps=120, warmup=12,
                    learning_rate=1e-2, num_samples=4000)}
QUICK = {"lm": dict(context=8, width=16, num_layers=1, num_heads=2, mlp_dim=32, batch_size=8, steps=4, warmup=1,
                    learning_rate=3e-3, eval_windows=8, max_chars=5000),
         "cnn": dict(features=(8,), kernel_sizes=(3,), batch_size=16, steps=4, warmup=1, learning_rate=1e-2,
                     num_samples=400)}


def _tx(hp: dict):
    import jax
    import optax

    import jaxmp

    schedule = optax.warmup_cosine_decay_schedule(0.0, hp["learning_rate"], hp["warmup"], hp["steps"], 0.0)
    mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731 - decay the matrices only
    return jaxmp.loss_scaling(optax.adamw(schedule, weight_decay=0.01, mask=mask), "none", master_weights=True)


class _Task:
    """One model and its data: the loss, batches, init and eval."""

    def __init__(self, name: str, hp: dict):
        import jax
        import jax.numpy as jnp
        import optax

        import jaxmp.flax

        self.name, self.hp = name, hp
        if name == "lm":
            from benchmarks import _lm

            self.text = _lm.load_text(max_chars=hp["max_chars"])
            # The plain Flax module on bf16 params (bf16 compute), as the recorded study ran it
            # (jaxmp.flax.mixed_precision's LM traces under the per-shard step since the engine's
            # custom_vjp keeps its cotangents' varying axes; tests/parallel/test_wire_composition.py
            # trains it there with every option).
            self.model = _lm.CausalLM(context=hp["context"], width=hp["width"], num_layers=hp["num_layers"],
                                      num_heads=hp["num_heads"], mlp_dim=hp["mlp_dim"])
            self.cast = True
            self.sample = jnp.zeros((1, hp["context"]), jnp.int32)
            self.model_state = False

            def loss(p, b):
                logits = self.model.apply({"params": p}, b["inputs"]).astype(jnp.float32)
                return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]))

            def evaluate(p, ms, b):
                logits = self.model.apply({"params": p}, b["inputs"]).astype(jnp.float32)
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["label"])
                return jnp.sum(ce), jnp.sum(jnp.argmax(logits, -1) == b["label"]), jnp.float32(ce.size)
        elif name == "cnn":
            from experiments.data import embedded
            from experiments.models.cnn import CNN1D

            self.train = embedded.mnist1d("train", num_samples=hp["num_samples"])
            self.test = embedded.mnist1d("test", num_samples=hp["num_samples"])
            self.model = jaxmp.flax.mixed_precision(
                CNN1D(features=hp["features"], kernel_sizes=hp["kernel_sizes"]), "O2-bf16")
            self.sample = jnp.zeros((2,) + tuple(self.train.input_shape), jnp.float32)
            self.model_state = True
            self.cast = False

            def loss(p, ms, b):  # type: ignore[misc]
                logits, new = self.model.apply({"params": p, **ms}, b["x"], train=True, mutable=["batch_stats"])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), b["label"])
                return jnp.mean(ce), new

            def evaluate(p, ms, b):
                logits = self.model.apply({"params": p, **ms}, b["x"], train=False).astype(jnp.float32)
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]) * b["mask"]
                right = (jnp.argmax(logits, -1) == b["label"]) * b["mask"]
                return jnp.sum(ce), jnp.sum(right), jnp.sum(b["mask"])
        else:
            raise ValueError(f"unknown model {name!r}: choose lm or cnn")
        self.loss = loss
        self.evaluate = jax.jit(evaluate)

    def init(self, seed: int) -> tuple[Any, Any]:
        import jax

        variables = dict(self.model.init(jax.random.key(seed), self.sample, **({"train": False} if self.model_state
                                                                                 else {})))
        params = variables.pop("params")
        if self.cast:
            params = jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16), params)
        return params, variables

    def batches(self, seed: int):
        from benchmarks import _lm

        if self.name == "lm":
            for step in range(self.hp["steps"]):
                yield _lm.train_batch(self.text.train, step, self.hp["batch_size"], self.hp["context"], seed)
        else:
            it = self.train.train_batches(self.hp["batch_size"], seed=seed)
            for _ in range(self.hp["steps"]):
                yield next(it)

    def eval_batches(self):
        from benchmarks import _lm

        if self.name == "lm":
            return _lm.eval_batches(self.text.eval, 64, self.hp["context"], self.hp["eval_windows"])
        return self.test.eval_batches(200)


_STEPS: dict = {}


def run(task: _Task, layout: str, option: str, seed: int) -> dict:
    """Trains ``task`` from ``seed`` under ``layout`` with ``option``; final eval loss and accuracy."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxmp

    gather_bits, reduce_bits = OPTIONS[option]
    key = (task.name, layout, option)
    tx = _tx(task.hp)
    if key not in _STEPS:  # one compile per (model, layout, option), shared by the seeds
        _STEPS[key] = jaxmp.parallel.make_sharded_train_step(
            task.loss, tx, jaxmp.parallel.make_data_mesh(jax.devices()[:N]), layout=layout,
            model_state=task.model_state, gather_bits=gather_bits, reduce_bits=reduce_bits)
    step = _STEPS[key]
    params, ms = task.init(seed)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
    ms = jax.device_put(ms, NamedSharding(step.mesh, P()))
    t0 = time.perf_counter()
    losses, skips = [], 0
    for b in task.batches(seed):
        batch = jaxmp.parallel.make_global_batch(b, step.mesh)
        if task.model_state:
            p, ms, s, m = step(p, ms, s, batch)
        else:
            p, s, m = step(p, s, batch)
        losses.append(float(m["loss"]))
        skips += not bool(m["last_step_finite"])
    train_time = time.perf_counter() - t0
    total = right = count = 0.0
    for b in task.eval_batches():
        l_, r_, n_ = jax.device_get(task.evaluate(p, ms, b))
        total, right, count = total + float(l_), right + float(r_), count + float(n_)
    return {"seed": seed, "eval_loss": total / count, "eval_accuracy": right / count, "final_train_loss": losses[-1],
            "skips": skips, "steps": len(losses), "loop_time_s": train_time}


def summarize(runs: dict) -> dict:
    """Per option: mean and spread over seeds of eval loss and accuracy, and the verdict (module docstring):
    benchmarks/fidelity.py's, against the unquantized run."""
    from benchmarks import fidelity

    return fidelity.summarize(runs, reference=REFERENCE)


def study(models, layouts, options, seeds, quick: bool, log=print) -> dict:
    """Every (model, layout, option, seed) run and each (model, layout)'s summary."""
    out: dict = {}
    for name in models:
        hp = dict((QUICK if quick else FULL)[name])
        task = _Task(name, hp)
        for layout in layouts:
            runs: dict = {}
            for option in options:
                for seed in seeds:
                    r = run(task, layout, option, seed)
                    log(f"{name} {layout} {option} seed {seed}: eval loss {r['eval_loss']:.4f}, "
                        f"acc {r['eval_accuracy']:.4f}, {r['skips']} skips ({r['loop_time_s']:.1f} s, compile "
                        "included for the first seed)")
                    runs.setdefault(option, []).append(r)
            out[f"{name} {layout}"] = {"model": name, "layout": layout, "setup": {k: list(v) if isinstance(v, tuple)
                                                                                   else v for k, v in hp.items()},
                                       "runs": runs, "summary": summarize(runs)}
    return out


def markdown(results: dict) -> str:
    """One line per (model, layout, option): eval loss mean, difference (tolerance), verdict, accuracy."""
    lines = ["| model | layout | option | eval loss mean over seeds | diff vs unquantized (tolerance) | within "
             "| largest same-seed diff | eval accuracy mean |", "|---|---|---|---:|---:|---|---:|---:|"]
    for entry in results.values():
        # The same seed and batches with and without the option: a tighter view than the seed spread.
        ref = {r["seed"]: r["eval_loss"] for r in entry["runs"].get(REFERENCE, [])}
        for option in sorted(entry["summary"], key=lambda o: list(OPTIONS).index(o) if o in OPTIONS else len(OPTIONS)):
            row = entry["summary"][option]
            loss, acc = row["eval_loss"], row["eval_accuracy"]
            diff = "-" if option == REFERENCE else f"{loss['diff_from_reference']:+.4f} ({loss['tolerance']:.4f})"
            within = "-" if option == REFERENCE else ("yes" if loss["within"] else "**no**")
            paired = [r["eval_loss"] - ref[r["seed"]] for r in entry["runs"][option] if r["seed"] in ref]
            same = "-" if option == REFERENCE or not paired else f"{max(paired, key=abs):+.4f}"
            lines.append(f"| {entry['model']} | {entry['layout']} | {option} | {loss['mean']:.4f} | {diff} | {within} "
                         f"| {same} | {100 * acc['mean']:.2f}% |")
    return "\n".join(lines)

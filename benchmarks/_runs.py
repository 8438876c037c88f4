"""One measured training run of the throughput suite (imported lazily by ``throughput.py``).

A run is (model, batch, policy): a jaxmp recipe (``O0-strict``, ``O0``, ``O1``, ``O2-bf16``,
``O2-fp16``: the module under ``jaxmp.flax``, jaxmp's loss-scaling optimizer) or a native Flax
baseline (``native-bf16``: the same module code with ``dtype=bfloat16`` on every layer, plain
optax; ``native-bf16-cudnn``: the same with ``jax.nn.dot_product_attention`` attention,
cuDNN's fused kernel on a GPU). See ``benchmarks/_native.py``. ``autocast-<preset>``: the
float32 module code under ``jaxmp.autocast(apply, preset)`` with its attention calling
``jax.nn.dot_product_attention`` (routed by the engine), and jaxmp's loss-scaling optimizer.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time

from benchmarks import _common as common
from benchmarks import _profile as profile_lib
from benchmarks import flops as flops_lib
from benchmarks._suite import load_model

NATIVE = {"native-bf16": None, "native-bf16-cudnn": "cudnn"}
# The custom-call target of cuDNN's fused attention (forward and backward) in compiled HLO.
CUDNN_ATTENTION = "__cudnn$fmha"


def make_optimizer(kind: str):
    import optax

    if kind == "sgd":  # torch.optim.SGD(lr, momentum=0.9, weight_decay=5e-4): L2 added to the gradient
        return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9))
    if kind == "adamw":
        return optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    raise ValueError(kind)


def memory_analysis_dict(compiled) -> dict | None:
    """The compiled step's ``memory_analysis()`` as a dict, with an estimated peak."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    out = {f: int(getattr(m, f)) for f in fields if hasattr(m, f)}
    if all(k in out for k in fields[:4]):
        out["estimated_peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                       - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out


def _setup(policy: str, spec: dict, entry: dict):
    """(model with init/apply, optimizer, matmul-precision context, jaxmp recipe or None)."""
    import jax
    import jax.numpy as jnp

    import jaxmp
    import jaxmp.flax as jflax

    name, overrides = spec["model"]
    module = load_model(name, spec["classes"], overrides)
    if policy in NATIVE:
        from benchmarks._native import NativeModel

        attention = NATIVE[policy]
        if attention == "cudnn" and jax.devices()[0].platform != "gpu":
            attention = "xla"  # cuDNN exists on GPUs only; same code path otherwise
        entry.update(recipe=None, native={"dtype": "bfloat16", "param_dtype": "float32", "attention": attention},
                     matmul_precision="default")
        return module, NativeModel(module, jnp.bfloat16, attention), make_optimizer(spec["optimizer"]), \
            contextlib.nullcontext(), None
    autocast = policy.startswith("autocast-")
    preset = "O0" if policy == "O0-strict" else policy.removeprefix("autocast-")
    recipe = jaxmp.get_recipe(preset)
    precision = "highest" if policy == "O0-strict" else None
    entry.update(recipe={"name": recipe.name, "policy": str(recipe.policy), "master_weights": recipe.master_weights,
                         "loss_scale": recipe.loss_scale, "keep_fp32": list(recipe.keep_float32)},
                 matmul_precision=precision or "default")
    ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    tx = jaxmp.loss_scaling(make_optimizer(spec["optimizer"]), loss_scale=recipe.loss_scale,
                            master_weights=recipe.master_weights)
    if autocast:
        from benchmarks._native import NativeModel
        from experiments.program import AutocastModel

        # "auto": attention names no implementation, so the engine picks cuDNN's fused kernel.
        entry["front_door"] = "jaxmp.autocast"
        return module, AutocastModel(NativeModel(module, None, "auto"), preset), tx, ctx, recipe
    entry["front_door"] = "jaxmp.flax"
    return module, jflax.mixed_precision(module, preset), tx, ctx, recipe


def _make_step(model, tx, jaxmp_step: bool):
    """The train step ``(params, batch_stats, opt_state), (x, y) -> (state, loss)``."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp

    def step(state, batch):
        params, batch_stats, opt_state = state
        x, y = batch

        def loss_fn(p):
            v = {"params": p, "batch_stats": batch_stats} if batch_stats else {"params": p}
            if batch_stats:
                logits, upd = model.apply(v, x, train=True, mutable=["batch_stats"])
                new_bs = upd["batch_stats"]
            else:
                logits, new_bs = model.apply(v, x, train=True), batch_stats
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
            return loss, new_bs

        if not jaxmp_step:
            (loss, new_bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), new_bs, opt_state), loss
        (loss, new_bs), grads = jaxmp.value_and_grad(loss_fn, opt_state, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jaxmp.apply_updates(params, updates, opt_state)
        # A skipped (non-finite) step keeps the BatchNorm statistics too.
        new_bs = jaxmp.select_tree(jaxmp.scaling_stats(opt_state)["last_step_finite"], new_bs, batch_stats) if batch_stats else new_bs
        return (params, new_bs, opt_state), loss

    return step


def _memory(mem_analysis: dict | None, fresh_process: bool) -> dict:
    import jax

    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        pass
    memory = {"analysis": mem_analysis}
    if stats and stats.get("peak_bytes_in_use"):
        memory["process_peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    if fresh_process and stats and stats.get("peak_bytes_in_use"):
        memory.update(source="peak_bytes_in_use (fresh process for this run)", peak_bytes=int(stats["peak_bytes_in_use"]))
    elif mem_analysis and mem_analysis.get("estimated_peak_bytes"):
        memory.update(source="memory_analysis (compiled step: arguments + outputs - aliased + temporaries)",
                      peak_bytes=int(mem_analysis["estimated_peak_bytes"]))
    else:
        memory.update(source="unavailable", peak_bytes=None)
    return memory


def _time_blocks(compiled, state, batches, timing):
    import jax

    nb = len(batches)
    for i in range(timing["warmup_steps"]):
        state, loss = compiled(state, batches[i % nb])
    jax.block_until_ready((state, loss))
    samples = []
    for _ in range(timing["rounds"]):
        t0 = time.perf_counter()
        for i in range(timing["steps"]):
            state, loss = compiled(state, batches[i % nb])
        jax.block_until_ready((state, loss))
        samples.append((time.perf_counter() - t0) / timing["steps"])
    return state, loss, samples


def _profile(compiled, state, batches, timing, entry):
    """Traces ``profile_steps`` more steps and writes the top-kernel table next to the results."""
    import jax

    box = {"state": state}

    def run():
        for i in range(timing.get("profile_steps", 3)):
            box["state"], loss = compiled(box["state"], batches[i % len(batches)])
        jax.block_until_ready((box["state"], loss))

    with tempfile.TemporaryDirectory() as d:
        prof = profile_lib.top_kernels(profile_lib.trace_steps(run, d), top=timing.get("profile_top", 20))
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    path = profile_lib.profile_path(kind, entry["model"], entry["batch_size"], entry["policy"],
                                       timing.get("dry_run", False))
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": kind, "jax": jax.__version__, "commit": common.git_commit()["sha"][:10],
            "run": f"{entry['model']} batch {entry['batch_size']} {entry['policy']}",
            "profiled steps": timing.get("profile_steps", 3),
            "command": " ".join(["python", *sys.argv]) if sys.argv else ""}
    path.write_text(profile_lib.markdown(prof, f"Top kernels: {meta['run']} on {kind}", meta))
    entry["profile"] = {"path": str(path.relative_to(common.REPO_ROOT)), "timeline": prof["timeline"],
                        "top": prof["rows"][:5]}
    return box["state"]


def run_one(model_key: str, batch_size: int, policy: str, suite: dict, timing: dict,
            fresh_process: bool, quiet: bool = False) -> dict:
    """Builds, compiles, warms up and times one train step; returns the run's entry."""
    import jax
    import jax.numpy as jnp

    import jaxmp

    spec = suite[model_key]
    entry = {"model": model_key, "model_def": list(spec["model"]), "batch_size": batch_size, "policy": policy,
             "unit": spec["unit"], "optimizer": spec["optimizer"]}
    module, model, tx, ctx, recipe = _setup(policy, spec, entry)
    shape = (timing["n_batches"], batch_size, *spec["input"])
    copts = {"xla_backend_optimization_level": 0} if timing.get("fast_compile") else None

    def jit_call(fn, *args):  # data and state built inside jit: eager init compiles op by op
        return jax.jit(fn).lower(*args).compile(compiler_options=copts)(*args)

    def make_data(key):
        kx, ky = jax.random.split(key)
        return jax.random.normal(kx, shape, jnp.float32), jax.random.randint(ky, shape[:2], 0, spec["classes"])

    xs, ys = jit_call(make_data, jax.random.PRNGKey(0))
    batches = [(xs[i], ys[i]) for i in range(shape[0])]

    def make_state(key, x):
        variables = model.init(key, x, train=False)
        # Fresh buffers for the whole (donated) state: an fp32 master copy of an fp32 param
        # would otherwise alias it.
        opt_state = jax.tree_util.tree_map(jnp.copy, tx.init(variables["params"]))
        return variables["params"], variables.get("batch_stats", {}), opt_state

    with ctx:
        state = jit_call(make_state, jax.random.PRNGKey(1), batches[0][0][:2])
    entry["n_params"] = int(sum(p.size for p in jax.tree_util.tree_leaves(state[0])))
    entry["param_dtypes"] = sorted({str(p.dtype) for p in jax.tree_util.tree_leaves(state[0])})
    abstract = jax.eval_shape(lambda k, x: module.init(k, x, train=False), jax.random.PRNGKey(0),
                              jax.ShapeDtypeStruct(shape[1:], jnp.float32))
    entry["flops"] = {**flops_lib.model_train_flops(spec["model"][0], module, abstract, shape[1:]),
                      "source": "analytic"}
    jstep = jax.jit(_make_step(model, tx, recipe is not None), donate_argnums=(0,))
    with ctx:
        t0 = time.perf_counter()
        compiled = jstep.lower(state, batches[0]).compile(compiler_options=copts)
        entry["compile_s"] = time.perf_counter() - t0
        mem_analysis = memory_analysis_dict(compiled)
        try:
            entry["cudnn_attention_calls"] = compiled.as_text().count(CUDNN_ATTENTION)
        except Exception:  # noqa: BLE001 - some backends give no HLO text
            entry["cudnn_attention_calls"] = None
        state, loss, samples = _time_blocks(compiled, state, batches, timing)
        if timing.get("profile"):
            state = _profile(compiled, state, batches, timing, entry)
    if not bool(jnp.isfinite(loss)):
        entry["warning"] = "non-finite loss"
    st = common.summarize(samples)
    items = batch_size * (spec["input"][0] if spec["unit"] == "tokens" else 1)
    entry.update(status="ok", step_time_s=st, samples_s=samples, items_per_step=items,
                 items_per_s=items / st["median"], items_per_s_iqr=[items / st["q75"], items / st["q25"]],
                 final_loss=float(loss), tflops_per_s=entry["flops"]["per_step"] / st["median"] / 1e12)
    if recipe is not None:
        entry.update(skipped_steps=int(jaxmp.scaling_stats(state[2])["total_skips"]),
                     loss_scale=float(jaxmp.get_loss_scale(state[2]).loss_scale))
    entry["memory"] = _memory(mem_analysis, fresh_process)
    common.log(f"  {model_key} b{batch_size} {policy:9s}: {entry['items_per_s']:.1f} {spec['unit']}/s, "
               f"step {st['median'] * 1e3:.2f} ms (IQR {st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f}), "
               f"mem {entry['memory'].get('peak_bytes')} ({entry['memory']['source'].split(' ')[0]})", quiet)
    return entry


def matmul_peak(n: int, rounds: int = 10, steps: int = 10) -> dict:
    """Median TFLOP/s of an n x n x n bf16 matmul (float32 accumulation, bf16 output)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    out = f(a, b)
    for _ in range(3):
        out = f(a, b)
    jax.block_until_ready(out)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = f(a, b)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / steps)
    st = common.summarize(samples)
    return {"n": n, "dtype": "bfloat16", "step_time_s": st, "tflops": 2 * n**3 / st["median"] / 1e12,
            "tflops_best": 2 * n**3 / st["min"] / 1e12}

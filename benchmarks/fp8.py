"""O2-fp8 and O2-fp8-current against O2-bf16: step time and the loss curve, in one process.

    python -m benchmarks.fp8                    # GPU (H100 or newer: fp8 Tensor Cores)
    python -m benchmarks.fp8 --dry-run --out -  # tiny sizes on CPU (fp8 emulated), seconds

Models (plain Linen modules, one definition for every variant; MSE regression on synthetic data):

* ``mlp``: 4096 -> 16384 -> 4096 with GELU, 16,384 tokens per step (the issue's Flax MLP);
* ``transformer``: pre-LN encoder blocks of width 2048 (16 heads, MLP 8192), 2 layers,
  batch 8 x 512 tokens, ``nn.MultiHeadDotProductAttention`` (which ``jaxmp.flax`` runs through
  ``jax.nn.dot_product_attention``).

Variants, all through ``jaxmp.flax``: the module under ``jaxmp.flax.mixed_precision(module,
policy)``, a :class:`jaxmp.flax.TrainState` with AdamW 3e-4 in ``jaxmp.loss_scaling`` (the
preset's loss scale and fp32 master weights) and ``jit(jaxmp.flax.make_train_step(...))``; the
policy is the only difference:

* ``bf16``: ``"O2-bf16"``;
* ``fp8``: ``"O2-fp8"``, delayed scaling with Transformer Engine's defaults (amax history 1024,
  max, margin 0; E4M3 forward, E5M2 gradients): every ``Dense``/``DenseGeneral`` (attention
  projections included) gets an fp8 op whose scales and amax histories live in the
  ``fp8_meta`` collection, updated by the train step every step;
* ``fp8-current``: ``"O2-fp8-current"``, per-tensor current scaling (no state);
* ``mxfp8``, ``fp8-rowwise``, ``fp8-block128``, ``nvfp4``: the block-scaled presets
  (docs/fp8.md#block-scaled-formats). Where ``jaxmp.fp8.check_hardware`` finds no native path
  (anything but Blackwell with JAX >= 0.12, and there only MXFP8's forward) they run emulated
  (``emulate=True``, opted in by this script) and their row carries ``emulated``: the reason. An
  emulated row's time is the simulator's cost, not the format's speed; its loss curve is the
  format's fidelity on this model.

Attention's two batched matmuls and the norms are not fp8 in any variant (as in Transformer
Engine). ``make_train_step`` also computes its argmax accuracy metric, meaningless for a
regression but the same work in every variant. Every variant starts from the same params. Steps are timed interleaved (median and
IQR of ``--rounds`` blocks, speed-ups as medians of per-round ratios); then each variant trains
``--train-steps`` steps from that init on the same batches, and each fp8 curve is compared with
bf16's (final loss, largest relative gap over the last half) against a yardstick for "within
noise": the gap between bf16's curve and a second bf16 run from another init (``bf16-init1``).
The fp8 variant's state is summarised after its run (amaxes recorded per tensor, scale range).
On a CPU fp8 is emulated (operands rounded to fp8 with their scales, matmuls in bf16): its
times say nothing about fp8 speed. On GPUs without fp8 Tensor Cores (compute capability < 8.9)
the fp8 variants are recorded as skipped with the reason. Writes
``benchmarks/results/fp8_<device>.json`` (device, jax version and commit in ``env``).
"""

from __future__ import annotations

import argparse
import time

from benchmarks import _common as common

MODELS = ("mlp", "transformer")
VARIANTS = ("bf16", "fp8", "fp8-current", "mxfp8", "fp8-rowwise", "fp8-block128", "nvfp4")
POLICIES = {"bf16": "O2-bf16", "fp8": "O2-fp8", "fp8-current": "O2-fp8-current", "mxfp8": "O2-mxfp8",
            "fp8-rowwise": "O2-fp8-rowwise", "fp8-block128": "O2-fp8-block128", "nvfp4": "O2-nvfp4"}
#: The block-scaled variants: native only on Blackwell with JAX >= 0.12 (MXFP8's forward), so
#: elsewhere (H100) they run emulated, opted in here, and their rows say so (``emulated``).
BLOCK_VARIANTS = ("mxfp8", "fp8-rowwise", "fp8-block128", "nvfp4")
NOISE_REFERENCE = "bf16-init1"  # bf16 again from another init: the yardstick for "within noise"
SIZES = {"mlp": dict(d_in=4096, hidden=16384, tokens=16384),
         "transformer": dict(layers=2, dim=2048, heads=16, mlp=8192, seq=512, batch=8)}
DRY_SIZES = {"mlp": dict(d_in=16, hidden=32, tokens=64),
             "transformer": dict(layers=1, dim=32, heads=2, mlp=64, seq=16, batch=2)}
TIMING = dict(rounds=10, steps=5, warmup_steps=3, train_steps=300)
DRY_TIMING = dict(rounds=2, steps=1, warmup_steps=1, train_steps=4)
LEARNING_RATE = 3e-4
#: The sublayer names of the encoder's blocks (first norm, attention, second norm, MLP in, MLP out).
_BLOCK_NAMES = ("ln1", "attention", "ln2", "up", "down")


def _modules():
    """The Linen model classes, defined on first use so that ``--help`` does not import Flax."""
    import flax.linen as nn

    from experiments.models.transformer import EncoderBlock

    class Mlp(nn.Module):
        """``d_in -> hidden -> d_in`` with GELU."""

        d_in: int
        hidden: int

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.d_in, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(x)))

    class Transformer(nn.Module):
        """``layers`` encoder blocks regressing a target sequence."""

        layers: int
        dim: int
        heads: int
        mlp: int

        @nn.compact
        def __call__(self, x):
            for i in range(self.layers):
                # experiments' pre-LN block under this benchmark's module names (the names seed the
                # initialisers, so the recorded runs' params stay what they were)
                x = EncoderBlock(self.heads, self.mlp, names=_BLOCK_NAMES, name=f"block_{i}")(x)
            return x

    return Mlp, Transformer


def make_model(name: str, sizes: dict):
    """``(module, batch(key) -> (x, y))`` of one model at ``sizes``.

    Args:
      name: ``"mlp"`` or ``"transformer"``.
      sizes: that model's entry of :data:`SIZES` / :data:`DRY_SIZES`.

    Returns:
      The Linen module and a function making one synthetic float32 ``(inputs, targets)`` batch.
    """
    import jax
    import jax.numpy as jnp

    mlp_cls, transformer_cls = _modules()
    if name == "mlp":
        module = mlp_cls(sizes["d_in"], sizes["hidden"])
        shape = (sizes["tokens"], sizes["d_in"])

        def target(x):
            return jnp.tanh(x[:, ::-1])
    else:
        module = transformer_cls(sizes["layers"], sizes["dim"], sizes["heads"], sizes["mlp"])
        shape = (sizes["batch"], sizes["seq"], sizes["dim"])

        def target(x):
            return jnp.roll(x, 1, axis=1) * 0.5

    def batch(key):
        kx, kt = jax.random.split(key)
        x = jax.random.normal(kx, shape)
        return x, target(x) + 0.1 * jax.random.normal(kt, shape)

    return module, batch


def mse(out, y):
    """Mean squared error in float32 (the model's output is float32 under every O2 preset)."""
    import jax.numpy as jnp

    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def init_params(module, sample, seed: int):
    """The params of ``module`` under O2-bf16 (bf16, as every O2 preset stores them), on the host.

    Args:
      module: the Linen module.
      sample: one input batch (its first row is used: param shapes do not depend on the batch).
      seed: the init key.

    Returns:
      The ``params`` collection as numpy arrays.
    """
    import jax

    import jaxmp.flax

    model = jaxmp.flax.mixed_precision(module, POLICIES["bf16"])
    return jax.device_get(jax.jit(model.init)(jax.random.PRNGKey(seed), sample[:1])["params"])


class Variant:
    """One variant of one model: the model under its policy, the optimizer and one compiled step.

    Args:
      module: the Linen module.
      policy: a preset name (``"O2-bf16"``, ``"O2-fp8"``, ``"O2-fp8-current"``).
      sample: one input batch (only its shape matters; the first row is used).
      batch: an ``(inputs, targets)`` batch to compile the step for.

    Raises:
      ValueError: the device cannot run the policy's fp8 recipe (``jaxmp.fp8.check_hardware``).
    """

    def __init__(self, module, policy: str, sample, batch):
        import dataclasses

        import jax
        import optax

        import jaxmp
        import jaxmp.flax

        recipe = jaxmp.get_recipe(policy)
        self.emulated = None
        if getattr(recipe.fp8, "block", None) is not None and jax.devices()[0].platform != "cpu":
            verdict = jaxmp.fp8.check_hardware(recipe.fp8)
            if verdict == "emulated":  # no native block-scaled GEMM here: emulate on purpose, and say so
                self.emulated = verdict.reason
                recipe = recipe._replace(fp8=dataclasses.replace(recipe.fp8, emulate=True))
        self.model = jaxmp.flax.mixed_precision(module, recipe)
        self.tx = jaxmp.loss_scaling(optax.adamw(LEARNING_RATE), loss_scale=recipe.loss_scale,
                                     master_weights=recipe.master_weights)
        # Collections other than params (the fp8 state) from this policy's init; their shapes do
        # not depend on the batch, so one row is enough.
        init = jax.jit(self.model.init)(jax.random.PRNGKey(0), sample[:1])
        self._other = jax.device_get({k: v for k, v in init.items() if k != "params"})
        step = jax.jit(jaxmp.flax.make_train_step(loss_fn=mse), donate_argnums=0)
        t0 = time.perf_counter()
        # One compiled step serves the timing and every loss curve of this variant.
        self.step = step.lower(self.fresh_state(jax.device_get(init["params"])), batch).compile()
        self.compile_s = time.perf_counter() - t0

    def fresh_state(self, params):
        """A step-0 :class:`jaxmp.flax.TrainState` from ``params`` (host arrays; copied to new buffers,
        since the step donates its state)."""
        import jax
        import jax.numpy as jnp

        import jaxmp.flax

        variables = jax.tree_util.tree_map(jnp.array, {**self._other, "params": params})
        return jaxmp.flax.TrainState.create(self.model, variables, self.tx)

    def train(self, params, batches, steps: int):
        """Trains ``steps`` steps from ``params``; returns ``(losses, skipped steps, final state)``."""
        state, curve, skipped = self.fresh_state(params), [], 0
        for i in range(steps):
            state, metrics = self.step(state, batches[i % len(batches)])
            curve.append(float(metrics["loss"]))
            skipped += not bool(metrics["last_step_finite"])
        return curve, skipped, state


def fp8_state_summary(state) -> dict | None:
    """How much of the delayed-scaling state a run has filled in, or None (no fp8 state).

    Args:
      state: a :class:`jaxmp.flax.TrainState`.

    Returns:
      ``{"layers", "tensors", "history_length", "amaxes_recorded_min", "amaxes_recorded_max",
      "scale_min", "scale_max", "all_finite"}``: layers with fp8 state, tensors with a history,
      the fewest / most non-zero amaxes any history holds (one per step while the run is shorter
      than the history), and the range of the scales.
    """
    import jax
    import numpy as np

    from jaxmp.flax.fp8 import FP8_COLLECTION

    meta = state.model_state.get(FP8_COLLECTION)
    if meta is None:
        return None
    leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in
              jax.tree_util.tree_leaves_with_path(jax.device_get(meta))}
    histories = [x for k, x in leaves.items() if k.endswith("_amax_history']")]
    scales = [float(x) for k, x in leaves.items() if k.endswith("_scale']")]
    counts = [int(np.count_nonzero(h)) for h in histories]
    return {"layers": len(histories) // 3, "tensors": len(histories), "history_length": int(histories[0].shape[0]),
            "amaxes_recorded_min": min(counts), "amaxes_recorded_max": max(counts),
            "scale_min": min(scales), "scale_max": max(scales),
            "all_finite": bool(all(np.all(np.isfinite(x)) for x in leaves.values()))}


def _rel_gap_last_half(curve, reference) -> float:
    half = len(reference) // 2
    return max(abs(a - b) / abs(b) for a, b in zip(curve[half:], reference[half:]))


def measure_model(name: str, sizes: dict, variants: list[str], timing: dict, quiet: bool) -> dict:
    """Times ``variants`` of one model interleaved, then compares their loss curves.

    Args:
      name: ``"mlp"`` or ``"transformer"``.
      sizes: :data:`SIZES` or :data:`DRY_SIZES`.
      variants: names from :data:`VARIANTS`.
      timing: rounds, steps, warmup_steps, train_steps.
      quiet: print only the summary.

    Returns:
      ``{"sizes", "variants": {name: {...}}, "skipped": {name: reason}, ...}`` (see the module docstring).
    """
    import jax

    module, batch = make_model(name, sizes[name])
    batches = [batch(k) for k in jax.random.split(jax.random.PRNGKey(1), 4)]
    sample = batches[0][0]
    # Every variant starts from these params (the fp8 variants add their fp8 state to them).
    params = init_params(module, sample, seed=0)
    out: dict = {"sizes": sizes[name], "variants": {}, "skipped": {}}
    built, states = {}, {}
    for v in variants:
        try:
            built[v] = Variant(module, POLICIES[v], sample, batches[0])
        except ValueError as e:  # no fp8 Tensor Cores (and emulation not asked for)
            out["skipped"][v] = str(e)
            continue
        out["variants"][v] = {"policy": POLICIES[v], "compile_s": built[v].compile_s}
        if built[v].emulated:
            out["variants"][v]["emulated"] = built[v].emulated
        states[v] = built[v].fresh_state(params)

    def block(v):
        def timed():
            s = states[v]
            t0 = time.perf_counter()
            for i in range(timing["steps"]):
                s, metrics = built[v].step(s, batches[i % len(batches)])
            jax.block_until_ready((s, metrics))
            states[v] = s
            return (time.perf_counter() - t0) / timing["steps"]
        return timed

    for v in built:
        for _ in range(timing["warmup_steps"]):
            block(v)()
    samples = common.time_interleaved({v: block(v) for v in built}, timing["rounds"])
    for v, s in samples.items():
        out["variants"][v].update(step_time_s=common.summarize(s), samples_s=s)
        if v != "bf16" and "bf16" in samples:
            out["variants"][v]["speedup_over_bf16"] = common.summarize(common.paired_ratios(samples["bf16"], s))
    states.clear()  # free the timing states before the curves

    curves = {}
    for v, variant in built.items():  # same init, same batches: only the policy differs
        curve, skipped, state = variant.train(params, batches, timing["train_steps"])
        curves[v] = curve
        out["variants"][v].update(loss_curve=curve, final_loss=curve[-1], skipped_steps=skipped,
                                  fp8_state=fp8_state_summary(state))
        del state
    if "bf16" in curves:
        ref, _, _ = built["bf16"].train(init_params(module, sample, seed=1), batches, timing["train_steps"])
        noise = _rel_gap_last_half(ref, curves["bf16"])
        out["noise_reference"] = {"variant": NOISE_REFERENCE, "loss_curve": ref, "max_rel_loss_gap_last_half": noise}
        for v in curves:
            if v != "bf16":
                gap = _rel_gap_last_half(curves[v], curves["bf16"])
                final = abs(curves[v][-1] - curves["bf16"][-1]) / abs(curves["bf16"][-1])
                out["variants"][v].update(max_rel_loss_gap_last_half=gap, final_rel_loss_gap=final,
                                          within_noise=bool(gap <= noise))
    common.log(summary(name, out), quiet)
    return out


def summary(name: str, r: dict) -> str:
    """The console table of one model's result."""
    lines = [f"{name}: variant      step ms (IQR)          vs bf16   final loss  gap (last half)"]
    for v, x in r["variants"].items():
        st = x["step_time_s"]
        speed = f"{x['speedup_over_bf16']['median']:.3f}x" if "speedup_over_bf16" in x else "-"
        gap = f"{x['max_rel_loss_gap_last_half']:.4f}" if "max_rel_loss_gap_last_half" in x else "-"
        lines.append(f"  {v:11s} {st['median'] * 1e3:9.3f} ({st['q25'] * 1e3:.3f}-{st['q75'] * 1e3:.3f})  {speed:>7s}  "
                     f"{x['final_loss']:.5f}     {gap}")
    if "noise_reference" in r:
        lines.append(f"  noise yardstick: bf16 from another init, gap {r['noise_reference']['max_rel_loss_gap_last_half']:.4f}")
    for v, why in r["skipped"].items():
        lines.append(f"  {v}: skipped ({why.splitlines()[0]})")
    return "\n".join(lines)


def run(args) -> dict:
    """Runs the benchmark for the parsed ``args``; returns the result dict."""
    import jax

    from jaxmp import fp8

    sizes, timing, models, variants, env = common.run_setup(args, (SIZES, DRY_SIZES), (TIMING, DRY_TIMING), MODELS,
                                                            VARIANTS, train_steps=args.train_steps)
    native, why = fp8._hardware.native_fp8(jax.devices()[0])
    common.log(f"fp8: {env['device']}: {why}", args.quiet)
    results = {m: measure_model(m, sizes, variants, timing, args.quiet) for m in models}
    config = {"sizes": {m: sizes[m] for m in models}, "timing": timing, "variants": variants,
              "policies": {v: POLICIES[v] for v in variants}, "native_fp8": native, "native_fp8_reason": why,
              "step": "jit(jaxmp.flax.make_train_step(loss_fn=mse)) on a jaxmp.flax.TrainState of "
                      "jaxmp.flax.mixed_precision(module, policy); AdamW 3e-4 in jaxmp.loss_scaling "
                      "(the preset's loss scale, fp32 master weights); the state donated"}
    return common.make_result("fp8", env, config, {"models": results}, args.dry_run)


def _positive_int(text: str) -> int:
    """argparse type of ``--train-steps``: an int >= 1 (a curve needs a step)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--dry-run``, ``--out``, ``--quiet``, ``--models``, ``--variants``, the
    timing flags and ``--train-steps``.

    Returns:
      The ``argparse`` parser (unknown flags exit 2 with their name).
    """
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    common.add_timing_args(parser, "untimed blocks per variant")
    parser.add_argument("--train-steps", type=_positive_int, help="steps of the loss-curve comparison (default 300)")
    return parser


def main(argv=None) -> dict:
    """Runs the benchmark and writes its JSON (``--out``, default ``results/fp8_<device>.json``).

    Args:
      argv: the command-line arguments (default ``sys.argv[1:]``).

    Returns:
      The result dict.
    """
    return common.run_and_emit("fp8", build_parser().parse_args(argv), run)


if __name__ == "__main__":
    main()

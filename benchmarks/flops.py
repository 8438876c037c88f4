"""Analytic training FLOPs of the benchmark models, and model FLOPs utilisation (MFU).

XLA's ``cost_analysis()`` does not count custom calls (cuDNN convolutions, fused attention,
cuBLAS GEMMs on some backends), so a TFLOP/s figure derived from it is low by 10-100x on a GPU.
The FLOPs here come from the model instead:

* **CNNs** (ResNet-50, WRN-28-10, ...): every convolution and matmul of the forward pass,
  ``2 x output elements x (kernel window x input channels per group)`` and
  ``2 x output elements x contracted size``, read from the jaxpr of ``model.apply`` on abstract
  inputs (no compute); training = forward x 3 (the backward pass computes the input and the
  weight gradients, each as costly as the forward). Element-wise work (BatchNorm, ReLU,
  pooling, the optimizer) is left out, as in the usual MFU accounting.
* **Transformer**: ``6 x N x tokens`` with ``N`` the parameters that multiply every token
  (all but the positional embedding), plus attention: ``QK^T`` and ``AV`` are
  ``2 x 2 x T^2 x d`` per sequence and layer forward, ``12 x L x B x T^2 x d`` for training.

MFU = achieved FLOP/s / peak FLOP/s, against two peaks: the bf16 dense matmul probe measured in
the same run (``throughput.matmul_peak``) and the datasheet figure of :data:`DATASHEET_BF16_TFLOPS`.

Example::

    >>> import jax, jax.numpy as jnp
    >>> fwd = lambda w, x: jnp.tanh(x @ w)
    >>> count_forward_flops(fwd, jax.ShapeDtypeStruct((4, 3), jnp.float32),
    ...                     jax.ShapeDtypeStruct((2, 4), jnp.float32))["total"]
    48
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jaxmp import _jaxpr

#: Dense (no sparsity) bf16 tensor peak in TFLOP/s from the vendors' datasheets, matched by
#: substring of ``device.device_kind`` in this order (the first match wins).
DATASHEET_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM5
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("V100", 125.0),  # fp16: V100 has no bf16 tensor cores
    ("TPU v6 lite", 918.0),
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v4", 275.0),
)


def datasheet_peak_tflops(device_kind: str) -> float | None:
    """The datasheet bf16 dense peak of a device kind, or None when unknown (e.g. a CPU).

    Example:
      >>> datasheet_peak_tflops("NVIDIA H100 80GB HBM3")
      989.4
      >>> datasheet_peak_tflops("cpu") is None
      True
    """
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key.lower() in device_kind.lower():
            return tflops
    return None


# ----------------------------------------------------------------------------------------------
# Counting matmuls and convolutions in a jaxpr.


def _dot_flops(eqn) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)


def _conv_flops(eqn) -> int:
    dn = eqn.params["dimension_numbers"]
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    # rhs_spec = (out feature dim, in feature dim, spatial dims...); the in-feature size is
    # already per group.
    rhs_spec = dn.rhs_spec
    window = math.prod(rhs[d] for d in rhs_spec[2:]) * rhs[rhs_spec[1]]
    return 2 * math.prod(out) * window


def _sub_jaxprs(eqn):
    """(jaxpr, multiplier) pairs of the sub-programs of one equation."""
    name = eqn.primitive.name
    if name == "cond":
        return [("max", [b.jaxpr for b in eqn.params["branches"]])]
    mult = eqn.params.get("length", 1) if name == "scan" else 1
    return [(mult, [j]) for j in _jaxpr.sub_jaxprs(eqn, opened=True)]


def _walk(jaxpr, layers: list, scale: int) -> int:
    total = 0
    for eqn in _jaxpr.equations(jaxpr):
        name = eqn.primitive.name
        if name in ("dot_general", "conv_general_dilated"):
            f = (_dot_flops if name == "dot_general" else _conv_flops)(eqn) * scale
            layers.append({"op": name, "out_shape": list(eqn.outvars[0].aval.shape),
                           "operand_shapes": [list(v.aval.shape) for v in eqn.invars[:2]], "flops": f})
            total += f
            continue
        for mult, subs in _sub_jaxprs(eqn):
            if mult == "max":  # a cond runs one branch: count the costliest
                counts = [(_walk(s, tmp := [], scale), tmp) for s in subs]
                best, best_layers = max(counts, key=lambda c: c[0])
                layers.extend(best_layers)
                total += best
            else:
                for s in subs:
                    total += _walk(s, layers, scale * mult)
    return total


def count_forward_flops(fn: Callable, *args: Any) -> dict:
    """FLOPs of the matmuls and convolutions of ``fn(*args)``, from its jaxpr (nothing runs).

    Args:
      fn: a JAX-traceable function (e.g. ``lambda v, x: model.apply(v, x, train=False)``).
      *args: arrays or ``jax.ShapeDtypeStruct``s.

    Returns:
      ``{"total": int, "layers": [{"op", "out_shape", "operand_shapes", "flops"}, ...]}``, one
      layer entry per ``dot_general`` / ``conv_general_dilated`` in program order.
    """
    import jax

    closed = jax.make_jaxpr(fn)(*args)
    layers: list = []
    total = _walk(closed.jaxpr, layers, 1)
    return {"total": int(total), "layers": layers}


# ----------------------------------------------------------------------------------------------
# Training FLOPs of the suite's models.


def transformer_train_flops(n_params: int, batch: int, seq_len: int, num_layers: int, model_dim: int) -> int:
    """``6 N B T + 12 L B T^2 d``: matmul FLOPs of one training step of an encoder.

    Args:
      n_params: parameters that multiply every token (all but the positional embedding).
      batch: sequences per step (B).
      seq_len: tokens per sequence (T).
      num_layers: encoder blocks (L).
      model_dim: width (d); attention scores and values are ``2 x 2 T^2 d`` per layer forward.

    Returns:
      FLOPs per step (forward + backward).

    Example:
      >>> transformer_train_flops(100, 2, 4, 1, 8)
      7872
    """
    return 6 * n_params * batch * seq_len + 12 * num_layers * batch * seq_len ** 2 * model_dim


def _abstract(tree):
    import jax

    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def model_train_flops(model_name: str, module, variables, x_shape: tuple, overrides: dict | None = None) -> dict:
    """Analytic FLOPs of one training step of a suite model on a batch of shape ``x_shape``.

    Args:
      model_name: the ``experiments.models`` name (``"transformer"`` uses the 6NT formula,
        anything else counts convolutions and matmuls of the forward pass x 3).
      module: the plain (float32) Flax module.
      variables: its variables (arrays or ShapeDtypeStructs; only shapes are read).
      x_shape: the input batch shape.
      overrides: the model's keyword overrides (layers and width of the Transformer).

    Returns:
      ``{"per_step": int, "forward": int, "method": str}`` (plus ``"n_params"`` for the Transformer).
    """
    import jax
    import jax.numpy as jnp

    variables = _abstract(variables)
    x = jax.ShapeDtypeStruct(tuple(x_shape), jnp.float32)
    fwd = count_forward_flops(lambda v, a: module.apply(v, a, train=False), variables, x)["total"]
    if model_name == "transformer":
        params = variables["params"]
        n = sum(math.prod(p.shape) for path, p in jax.tree_util.tree_leaves_with_path(params)
                if "pos_embedding" not in jax.tree_util.keystr(path))
        batch, seq = x_shape[0], x_shape[1]
        per_step = transformer_train_flops(n, batch, seq, module.num_layers, module.model_dim)
        return {"per_step": int(per_step), "forward": int(fwd), "n_params": int(n),
                "method": "6 x params (all but pos_embedding) x tokens + 12 x layers x batch x T^2 x d"}
    return {"per_step": int(3 * fwd), "forward": int(fwd),
            "method": "3 x forward conv + matmul FLOPs (jaxpr of model.apply, 2 x output x window)"}


def mfu(flops_per_step: float, step_time_s: float, measured_peak_tflops: float | None,
        device_kind: str) -> dict:
    """Achieved TFLOP/s and its fraction of the measured and of the datasheet bf16 peak.

    Example:
      >>> mfu(1e12, 0.01, 500.0, "NVIDIA H100 80GB HBM3")["mfu_measured_peak"]
      0.2
    """
    achieved = flops_per_step / step_time_s / 1e12
    sheet = datasheet_peak_tflops(device_kind)
    return {"tflops_per_s": achieved,
            "mfu_measured_peak": achieved / measured_peak_tflops if measured_peak_tflops else None,
            "datasheet_peak_tflops": sheet,
            "mfu_datasheet": achieved / sheet if sheet else None}


def suite_table(suite: dict) -> list[dict]:
    """Analytic FLOPs of every model and batch of a throughput suite (abstract shapes: no compute)."""
    import jax
    import jax.numpy as jnp

    from benchmarks._suite import load_model

    rows = []
    for key, spec in suite.items():
        name, overrides = spec["model"]
        module = load_model(name, spec["classes"], overrides)
        for batch in spec["batches"]:
            shape = (batch, *spec["input"])
            variables = jax.eval_shape(lambda k, x: module.init(k, x, train=False), jax.random.PRNGKey(0),
                                       jax.ShapeDtypeStruct(shape, jnp.float32))
            rows.append({"model": key, "batch": batch, **model_train_flops(name, module, variables, shape)})
    return rows


def main(argv=None) -> list[dict]:
    """Prints the analytic training FLOPs of the throughput suite's models."""
    import argparse

    parser = argparse.ArgumentParser(description="Analytic training FLOPs per step of the throughput suite's models "
                                                 "(abstract shapes, nothing runs).")
    parser.add_argument("--dry-run", action="store_true", help="the tiny models of the dry-run suite")
    parser.add_argument("--models", help="comma list of suite models (default: all)")
    args = parser.parse_args(argv)
    from benchmarks import _common as common
    from benchmarks._suite import DRY_SUITE, SUITE

    suite = DRY_SUITE if args.dry_run else SUITE
    chosen = common.parse_choices(args.models, list(suite), "model")
    rows = suite_table({k: suite[k] for k in chosen})
    for r in rows:
        print(f"{r['model']:12s} batch {r['batch']:4d}: {r['per_step'] / 1e12:10.4f} TFLOP per training step "
              f"(forward conv+matmul {r['forward'] / 1e9:.3f} GFLOP; {r['method']})")
    return rows


if __name__ == "__main__":
    main()

"""The one catalogue of JAX primitives: each op's class and the facts jaxmp's readers need.

Every list of primitive names in jaxmp is read from `TABLE` here: autocast's op lists
(``jaxmp.engine.HALF_OPS``, ``FLOAT32_OPS``, the ops that follow ...), the control-flow kinds the
engine and the diagnostics enter, the precision report's risky ops and strict mode's, the
debugger's exact ops, the unscale folding and the misuse checks. A new op, or a fact about one,
is one row. See docs/architecture.md#the-op-catalogue.

A row is ``name: (class, facts)``. The class is one of `CLASSES`; the facts, space-separated,
are among `FACTS` (each says who reads it). Names JAX does not define in every release (older
spellings, kernels of other backends) are harmless: a list only matches the names it meets.
"""

from __future__ import annotations

from typing import NamedTuple

#: The classes, what each means to the engine (docs/autocast.md#the-default-op-lists-beside-torchautocasts).
CLASSES: dict[str, str] = {
    "half": "the half list: runs in the compute dtype (matmuls, convolutions)",
    "float32": "the float32 list: runs in float32 (transcendentals, powers, every reduction)",
    "follow": "follows its inputs under the promotion rule",
    "passthrough": "several independent operands, each keeps its own dtype",
    "collective": "a collective: runs as traced, keeps a float32-list result float32",
    "combiner": "carries a combiner jaxpr traced for its operands' dtypes: runs as traced",
    "opaque": "a kernel the engine cannot look into: runs as traced",
    # control flow: the kinds of higher-order equation (jaxmp._jaxpr.bodies gives their sub-jaxprs)
    "call": "control flow: calls a jaxpr once, inline (jit, closed_call ...)",
    "remat": "control flow: jax.checkpoint",
    "scan": "control flow: lax.scan",
    "while": "control flow: lax.while_loop",
    "cond": "control flow: lax.cond / lax.switch",
    "custom_jvp": "control flow: a jax.custom_jvp function",
    "custom_vjp": "control flow: a jax.custom_vjp function",
    "shard_map": "control flow: a per-device body (jax.shard_map)",
    "pmap": "control flow: a per-device body (jax.pmap); the engine runs it as traced",
    "": "no class of its own (casts, old spellings): the reader decides",
}

#: The control-flow classes (`CLASSES`' kinds of higher-order equation).
CONTROL_FLOW: frozenset[str] = frozenset({"call", "remat", "scan", "while", "cond", "custom_jvp", "custom_vjp",
                                          "shard_map", "pmap"})

#: The facts, and who reads each.
FACTS: dict[str, str] = {
    "reduction": "reduces along axes (the float32 list's reductions)",
    "gemm": "precision report: a matmul/conv with a GEMM geometry (its table of matmuls)",
    "risky_exp": "risky in half (report, strict mode): an exp (a softmax when it feeds a sum)",
    "risky_log": "risky in half: a log",
    "risky_pow": "risky in half: a power or rsqrt (norm statistics)",
    "risky_sum": "risky in half: a sum or product over many elements",
    "normalises": "report: the sum that makes an exp a softmax",
    "softmax_pass": "report: an exp's result passes it on its way into a softmax's sum",
    "scalar_pass": "report: scalar arithmetic between a full reduction and a loss or a norm",
    "full_reduction": "report: reduces an array to a scalar loss or norm",
    "elementwise": "report: a float32 operand rounded to half right before it loses what it keeps",
    "moves": "report: moves a value unchanged (followed back to the input it came from)",
    "weight_path": "engine (O2): a weight passes it on its way to its matmul",
    "accumulates": "engine: an accumulator carry may pass it on its way to the next carry",
    "adds": "engine: adds something to an accumulator",
    "never_merged": "engine: never merged with an equal op (a random draw, a barrier)",
    "carries_param": "debugger: its result is still the parameter it reads (for naming sites)",
    "exact": "debugger: moves or selects, exact in any dtype (no noise on it)",
    "mapped": "debugger: a per-device program the locator runs as one op",
    "guard": "misuse checks: selects or compares, a non-finite value behind it is not used",
    "fold_same": "unscale folding: homogeneous of its operand's degree in the inverse scale",
    "fold_into": "unscale folding: a reduction the unscaling folds out of",
    "gathers": "per-layer FSDP: makes a gathered param (never saved for the backward)",
    "jit": "engine: a nested jax.jit, whose shardings and donation are kept (other calls are inlined)",
    "per_element": "lean's chunked update: an output element reads only the same element of each operand",
}


class Op(NamedTuple):
    """One row of the catalogue: the op's class (a key of `CLASSES`) and its facts (of `FACTS`)."""

    cls: str
    facts: frozenset[str]


_ROWS: dict[str, tuple[str, str]] = {
    # -- the half list ----------------------------------------------------------------------
    "dot_general": ("half", "gemm"),
    "conv_general_dilated": ("half", "gemm"),
    "ragged_dot_general": ("half", ""),
    # -- the float32 list: transcendentals and powers ---------------------------------------
    "exp": ("float32", "risky_exp per_element"),
    "exp2": ("float32", "risky_exp per_element"),
    "expm1": ("float32", "risky_exp per_element"),
    "log": ("float32", "risky_log per_element"),
    "log1p": ("float32", "risky_log per_element"),
    "logistic": ("float32", "per_element"),
    "pow": ("float32", "risky_pow per_element"),
    "integer_pow": ("float32", "risky_pow per_element"),
    "square": ("float32", "per_element"),
    "erf": ("float32", "per_element"), "erfc": ("float32", "per_element"), "erf_inv": ("float32", "per_element"),
    "sqrt": ("float32", "scalar_pass per_element"),
    "rsqrt": ("float32", "risky_pow per_element"),
    "cbrt": ("float32", "per_element"), "tan": ("float32", "per_element"), "sinh": ("float32", "per_element"),
    "cosh": ("float32", "per_element"),
    "asin": ("float32", "per_element"), "acos": ("float32", "per_element"), "atan": ("float32", "per_element"),
    "atan2": ("float32", "per_element"),
    "asinh": ("float32", "per_element"), "acosh": ("float32", "per_element"), "atanh": ("float32", "per_element"),
    "lgamma": ("float32", "per_element"), "digamma": ("float32", "per_element"), "igamma": ("float32", "per_element"),
    "igammac": ("float32", "per_element"),
    "polygamma": ("float32", "per_element"), "zeta": ("float32", "per_element"),
    "bessel_i0e": ("float32", "per_element"),
    "bessel_i1e": ("float32", "per_element"), "regularized_incomplete_beta": ("float32", "per_element"),
    # -- the float32 list: reductions (softmax, log_softmax, logsumexp, mean/variance, the loss)
    "reduce_sum": ("float32", "reduction risky_sum normalises full_reduction fold_same fold_into"),
    "reduce_max": ("float32", "reduction full_reduction exact fold_same fold_into"),
    "reduce_min": ("float32", "reduction full_reduction exact"),
    "reduce_prod": ("float32", "reduction risky_sum full_reduction"),
    "reduce_window_sum": ("float32", "reduction"),
    "cumsum": ("float32", "reduction risky_sum normalises"),
    "cumprod": ("float32", "reduction risky_sum"),
    "cummax": ("float32", "reduction exact"),
    "cummin": ("float32", "reduction exact"),
    "cumlogsumexp": ("float32", "reduction risky_sum"),
    # -- ops that follow: arithmetic ---------------------------------------------------------
    "add": ("follow", "scalar_pass elementwise accumulates adds per_element"),
    "add_any": ("follow", "accumulates adds"),
    "sub": ("follow", "scalar_pass elementwise accumulates adds per_element"),
    "mul": ("follow", "scalar_pass elementwise accumulates per_element"),
    "div": ("follow", "scalar_pass elementwise accumulates per_element"),
    "neg": ("follow", "scalar_pass accumulates exact fold_same per_element"),
    "abs": ("follow", "exact fold_same per_element"),
    "rem": ("follow", "per_element"), "sign": ("follow", "exact per_element"), "nextafter": ("follow", "per_element"),
    "max": ("follow", "elementwise exact guard per_element"),
    "min": ("follow", "elementwise exact guard per_element"),
    "floor": ("follow", "exact per_element"), "ceil": ("follow", "exact per_element"),
    "round": ("follow", "exact per_element"),
    "is_finite": ("follow", "exact guard per_element"),
    "select_n": ("follow", "elementwise exact guard per_element"),
    "clamp": ("follow", "exact guard per_element"),
    "tanh": ("follow", "per_element"), "sin": ("follow", "per_element"), "cos": ("follow", "per_element"),
    "reduce_precision": ("follow", "carries_param per_element"),
    "eq": ("follow", "exact guard per_element"), "ne": ("follow", "exact guard per_element"),
    "lt": ("follow", "exact guard per_element"),
    "le": ("follow", "exact guard per_element"), "gt": ("follow", "exact guard per_element"),
    "ge": ("follow", "exact guard per_element"),
    "argmax": ("follow", "exact"), "argmin": ("follow", "exact"),
    "reduce_window_max": ("follow", ""), "reduce_window_min": ("follow", ""),
    "top_k": ("follow", ""), "select_and_gather_add": ("follow", ""),
    "zeros_like": ("follow", ""), "iota": ("follow", "exact"),
    # -- ops that follow: layout, movement, sharding -----------------------------------------
    "broadcast_in_dim": ("follow", "softmax_pass moves weight_path carries_param exact"),
    "reshape": ("follow", "scalar_pass softmax_pass moves weight_path carries_param exact"),
    "transpose": ("follow", "softmax_pass moves weight_path carries_param exact"),
    "squeeze": ("follow", "scalar_pass softmax_pass moves weight_path exact"),
    "copy": ("follow", "softmax_pass moves weight_path accumulates carries_param exact per_element"),
    "rev": ("follow", "weight_path exact"),
    "slice": ("follow", "weight_path exact"),
    "dynamic_slice": ("follow", "weight_path exact"),
    "dynamic_update_slice": ("follow", "exact"),
    "gather": ("follow", "weight_path exact"),
    "concatenate": ("follow", "exact"), "pad": ("follow", "exact"),
    "split": ("follow", "exact"), "tile": ("follow", ""),
    "stop_gradient": ("follow", "softmax_pass exact per_element"),
    "sharding_constraint": ("follow", "weight_path carries_param exact gathers"),
    "reshard": ("follow", "weight_path"),
    "mesh_cast": ("follow", "weight_path"),
    "pvary": ("follow", "weight_path carries_param exact"),
    # checkpoint_name: the remat policy saves the value in the dtype it was computed in
    "name": ("follow", "exact"),
    # -- several independent operands -------------------------------------------------------
    "sort": ("passthrough", "exact"),
    "optimization_barrier": ("passthrough", "exact never_merged"),
    "device_put": ("passthrough", ""),
    # -- collectives (a gradient all-reduce keeps its traced dtype: a sum over replicas cannot
    #    overflow fp16; a float32-list result stays float32 through them, so a synchronised
    #    BatchNorm's x - pmean(mean(x)) centres in float32 as an unsynchronised one does)
    "psum": ("collective", ""), "pmax": ("collective", ""), "pmin": ("collective", ""),
    "pmean": ("collective", ""), "all_gather": ("collective", "gathers"), "all_to_all": ("collective", ""),
    "ppermute": ("collective", ""), "psum_scatter": ("collective", ""), "reduce_scatter": ("collective", ""),
    "psum_invariant": ("collective", ""), "ragged_all_to_all": ("collective", ""),
    # -- first-order ops with a combiner jaxpr ----------------------------------------------
    "scatter": ("combiner", ""), "scatter-add": ("combiner", ""), "scatter-sub": ("combiner", ""),
    "scatter-mul": ("combiner", ""), "scatter-min": ("combiner", ""), "scatter-max": ("combiner", ""),
    "reduce": ("combiner", ""), "reduce_window": ("combiner", ""), "select_and_scatter": ("combiner", ""),
    "select_and_scatter_add": ("combiner", ""), "cumred": ("combiner", ""),
    "custom_linear_solve": ("combiner", ""), "argsort": ("combiner", ""),
    # -- kernels -----------------------------------------------------------------------------
    "pallas_call": ("opaque", ""), "custom_call": ("opaque", ""), "ffi_call": ("opaque", ""),
    "triton_kernel_call": ("opaque", ""), "mosaic_gpu_call": ("opaque", ""), "tpu_custom_call": ("opaque", ""),
    "cuda_kernel_call": ("opaque", ""),
    # -- control flow (``call``: pjit up to jax 0.10, jit after; eval_jaxpr replaced closed_call in 0.11)
    "jit": ("call", "jit"), "pjit": ("call", "jit"), "closed_call": ("call", ""), "core_call": ("call", ""),
    "call": ("call", ""), "eval_jaxpr": ("call", ""),
    "remat2": ("remat", ""), "checkpoint": ("remat", ""),
    "scan": ("scan", ""), "while": ("while", ""), "cond": ("cond", ""),
    "custom_jvp_call": ("custom_jvp", ""),
    "custom_vjp_call": ("custom_vjp", "gathers"),
    # A custom_vjp's forward as one equation (``defvjp(..., optimize_remat=True)``), under AD only:
    # jaxmp's quantized FSDP gather is one (jaxmp/parallel/_reduce.py); the release policy refuses
    # it when its forward all-gathers. No class: the engine treats it as before.
    "remat_opt": ("", "gathers"),
    "shard_map": ("shard_map", "mapped"),
    "xla_pmap": ("pmap", "mapped"),
    # -- no class of their own --------------------------------------------------------------
    "convert_element_type": ("", "scalar_pass softmax_pass weight_path accumulates carries_param per_element"),
    "expand_dims": ("", "softmax_pass moves weight_path exact"),
    "copy_p": ("", "softmax_pass carries_param exact per_element"),
    "rng_uniform": ("", "never_merged"),
    "custom_vjp_call_jaxpr": ("", "gathers"),  # custom_vjp_call's name up to jax 0.4
}

#: The catalogue: primitive name -> `Op`.
TABLE: dict[str, Op] = {name: Op(cls, frozenset(facts.split())) for name, (cls, facts) in _ROWS.items()}


def of_class(*classes: str) -> frozenset[str]:
    """The names of the ops of these classes (keys of `CLASSES`), e.g. ``of_class("half")``."""
    unknown = set(classes) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown op class {sorted(unknown)}; the classes are {sorted(CLASSES)}")
    return frozenset(name for name, op in TABLE.items() if op.cls in classes)


def having(fact: str) -> frozenset[str]:
    """The names of the ops with this fact (a key of `FACTS`), e.g. ``having("exact")``."""
    if fact not in FACTS:
        raise ValueError(f"unknown op fact {fact!r}; the facts are {sorted(FACTS)}")
    return frozenset(name for name, op in TABLE.items() if fact in op.facts)


def control_flow_kind(name: str) -> str | None:
    """The control-flow class of the primitive called ``name`` (``"scan"``, ``"call"`` ...), or None."""
    op = TABLE.get(name)
    return op.cls if op is not None and op.cls in CONTROL_FLOW else None


def risk_family(name: str) -> str | None:
    """Which risky family the op is in (``"exp"``, ``"log"``, ``"pow"``, ``"sum"``), or None."""
    op = TABLE.get(name)
    if op is None:
        return None
    return next((f[len("risky_"):] for f in sorted(op.facts) if f.startswith("risky_")), None)

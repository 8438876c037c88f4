"""Walking a jaxpr: every matmul/conv with its GEMM geometry, and the risky half-precision ops.

Sub-jaxprs are walked recursively; ``scan`` bodies count ``length`` times, only the costliest
``cond`` branch counts, a ``while`` body counts once. The counting rules are in
docs/diagnostics.md#does-the-step-actually-compute-in-half-precision-on-shapes-tensor-cores-like.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from jaxmp import _jaxpr, _ops
from jaxmp.diagnostics import _format
from jaxmp.diagnostics._matmul import conv_gemm, dot_gemm, tc_shape_problems

# The op lists below are the op catalogue's (jaxmp/_ops.py), one fact each.
_MATMUL_PRIMS = _ops.having("gemm")
# Ops an exp's result may pass through on its way into the normalising sum of a softmax.
_SOFTMAX_PASS = _ops.having("softmax_pass")
_NORMALISES = _ops.having("normalises")
# Scalar arithmetic between a full reduction and the value a loss or norm ends up as.
_SCALAR_PASS = _ops.having("scalar_pass")
_REDUCE_PRIMS = _ops.having("full_reduction")


class MatmulOp(NamedTuple):
    """One ``dot_general`` or ``conv_general_dilated`` of the traced function.

    Attributes:
      primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
      lhs_dtype, rhs_dtype: operand dtypes (short names: ``f16``, ``bf16``, ``f32`` ...).
      out_dtype: result dtype.
      accum_dtype: the requested accumulation dtype (``preferred_element_type``, else the
        result dtype). GPUs accumulate fp16 products in fp32 internally whatever this says.
      lhs_shape, rhs_shape, out_shape: shapes.
      batch, m, n, k: the GEMM it amounts to (conv: implicit GEMM, ``batch=1``).
      flops_per_call: ``2 * batch * m * n * k``.
      calls: how many times it runs per call of the function (product of enclosing scan lengths).
      flops: ``flops_per_call * calls``.
      low_precision: both operands are float16/bfloat16/float8.
      shape_problems: dimensions breaking the multiple-of-8 rule, e.g. ``("K=30",)``.
      tensor_core_eligible: ``low_precision`` and no ``shape_problems``.
      missed: float32/float64 operands although the policy computes in half precision.
      counted: whether ``flops`` enter the totals (False in a cond's cheaper branches).
      context: enclosing higher-order primitives, e.g. ``"jit(step) > scan x10"``.
      name: the name stack (Flax module path, ``jvp``/``transpose`` for forward/backward).
      source: ``file:line (function)`` of the user code that emitted it.
    """

    primitive: str
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    accum_dtype: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    batch: int
    m: int
    n: int
    k: int
    flops_per_call: int
    calls: int
    flops: int
    low_precision: bool
    shape_problems: tuple[str, ...]
    tensor_core_eligible: bool
    missed: bool
    counted: bool
    context: str
    name: str
    source: str


class RiskyOp(NamedTuple):
    """A half-precision op that commonly loses range or precision.

    Attributes:
      primitive: the JAX primitive (``exp``, ``reduce_sum`` ...).
      category: ``"softmax"``, ``"exp"``, ``"log"``, ``"pow"``, ``"reduction"``,
        ``"all-reduce"``, ``"loss"`` or ``"door derivative"`` (a float32-list op in half in the
        backward of the Flax door's program, differentiated inside the loss: autocast the loss).
      dtype: the half dtype it runs in.
      shape: its input shape.
      detail: one sentence on why it is risky and what to do.
      context, name, source: where it is (as in [`MatmulOp`][jaxmp.diagnostics.MatmulOp]).
    """

    primitive: str
    category: str
    dtype: str
    shape: tuple[int, ...]
    detail: str
    context: str
    name: str
    source: str


@dataclasses.dataclass(frozen=True)
class _Ctx:
    calls: int = 1
    context: tuple[str, ...] = ()
    name_prefix: tuple[str, ...] = ()
    # Ops traced inside library code (jax.nn.*) have no user frame; fall back to the call site.
    source: str = ""
    # the enclosing equations' name stacks (transformations and scopes), outermost first
    stack: tuple = ()


@dataclasses.dataclass
class _Collector:
    compute_half: bool
    multiple: int
    reduction_threshold: int
    ops: list = dataclasses.field(default_factory=list)
    risky: list = dataclasses.field(default_factory=list)
    unknown_trip_counts: int = 0
    # ids of 0-d half vars already reported as a half reduction (Literals are unhashable, so ids).
    half_scalars: set = dataclasses.field(default_factory=set)
    # concrete values of the program's inputs, followed into calls ({var: array}), and the
    # converts already reported as narrowing a float32 value
    values: dict = dataclasses.field(default_factory=dict)
    inputs: set = dataclasses.field(default_factory=set)
    narrowed: set = dataclasses.field(default_factory=set)


_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the jaxmp package


def _source(eqn, ctx: _Ctx | None = None) -> str:
    # Source locations come from a JAX internal (read through the engine's one seam); degrade
    # to no location rather than fail the report.
    try:
        frames = list(itertools.islice(_jaxpr.user_frames(eqn), 16))
        # JAX counts installed libraries (flax, optax) as user code when they do not share the
        # standard library's prefix (a virtualenv): point at the first frame outside them.
        # jaxmp's own wrappers (the Flax door's module hooks) are not where the user's op is either.
        frame = next((f for f in frames if not _INSTALLED.search(f.file_name) and not f.file_name.startswith(_OWN)),
                     next((f for f in frames if not _INSTALLED.search(f.file_name)), frames[0] if frames else None))
        col = f":{frame.start_column}" if frame and frame.start_column else ""
        own = f"{frame.file_name}:{frame.start_line}{col} ({frame.function_name})" if frame else ""
    except Exception:  # pragma: no cover - depends on JAX internals
        own = ""
    if ctx is not None and (not own or own.startswith("unknown")):
        return ctx.source
    return own


def source_of(eqn) -> str:
    """``file:line:col (function)`` of the user code that emitted ``eqn`` ("" when unknown).
    """
    return _source(eqn)


def _name(eqn, ctx: _Ctx) -> str:
    return "/".join(p for p in (*ctx.name_prefix, _format.user_path(_jaxpr.stack_of(eqn))) if p)


def _matmul_op(eqn, ctx: _Ctx, col: _Collector) -> MatmulOp:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        gemm = dot_gemm(lhs.shape, rhs.shape, eqn.params["dimension_numbers"])
    else:
        gemm = conv_gemm(lhs.shape, rhs.shape, out.shape, eqn.params["dimension_numbers"],
                         eqn.params.get("feature_group_count", 1), eqn.params.get("batch_group_count", 1))
    accum = eqn.params.get("preferred_element_type")
    accum = out.dtype if accum is None else accum
    low = _format.is_low_precision(lhs.dtype) and _format.is_low_precision(rhs.dtype)
    floating = _format.is_floating(lhs.dtype) and _format.is_floating(rhs.dtype)
    problems = tc_shape_problems(gemm, col.multiple)
    return MatmulOp(
        primitive=eqn.primitive.name,
        lhs_dtype=_format.short_dtype(lhs.dtype), rhs_dtype=_format.short_dtype(rhs.dtype),
        out_dtype=_format.short_dtype(out.dtype), accum_dtype=_format.short_dtype(accum),
        lhs_shape=tuple(map(int, lhs.shape)), rhs_shape=tuple(map(int, rhs.shape)),
        out_shape=tuple(map(int, out.shape)),
        batch=gemm.batch, m=gemm.m, n=gemm.n, k=gemm.k,
        flops_per_call=gemm.flops, calls=ctx.calls, flops=gemm.flops * ctx.calls,
        low_precision=low, shape_problems=problems if floating else (),
        tensor_core_eligible=low and not problems,
        missed=col.compute_half and floating and not low,
        counted=True, context=" > ".join(ctx.context), name=_name(eqn, ctx), source=_source(eqn, ctx),
    )


def _feeds_sum(var, consumers, depth: int = 4) -> bool:
    """Whether ``var`` reaches a sum within ``depth`` pass-through ops (softmax's normaliser)."""
    frontier = [var]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for eqn in consumers.get(v, ()):
                if eqn.primitive.name in _NORMALISES:
                    return True
                if eqn.primitive.name in _SOFTMAX_PASS:
                    nxt.extend(eqn.outvars)
        frontier = nxt
    return False


def classify_risk(eqn, consumers=None, reduction_threshold: int = 1024) -> tuple[str, str] | None:
    """The one definition of a *risky* half-precision op, shared by the report and strict mode.

    An op is risky when its first operand is float16/bfloat16/fp8 and it is an ``exp`` (a
    ``"softmax"`` when its result reaches a sum), a ``log``, a power or ``rsqrt`` (norm
    statistics), a sum or product over at least ``reduction_threshold`` elements, or a half
    all-reduce. `jaxmp.precision_report` lists these as advice with the default threshold;
    `jaxmp.diagnostics.strict_precision` raises on them with a threshold of 1 when the
    policy's float32 list covers the primitive.

    Args:
      eqn: a jaxpr equation.
      consumers: ``{var: [eqns reading it]}`` of its jaxpr (to tell a softmax's exp); None: unknown.
      reduction_threshold: element count from which a half sum is risky.

    Returns:
      ``(category, why)``, or None when the op is not risky.
    """
    prim = eqn.primitive.name
    if not eqn.invars or not hasattr(eqn.invars[0], "aval"):
        return None
    aval = eqn.invars[0].aval
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not _format.is_low_precision(dtype):
        return None
    d = _format.short_dtype(dtype)
    category = detail = None
    family = _ops.risk_family(prim)
    if family == "exp":
        if consumers is not None and _feeds_sum(eqn.outvars[0], consumers):
            category = "softmax"
            detail = f"exp->sum (softmax/logsumexp) in {d}: small probabilities underflow; compute softmax in float32"
        else:
            category = "exp"
            detail = f"exp in {d} overflows past x~{11 if d == 'f16' else 88}; keep it in float32"
    elif family == "log":
        category = "log"
        detail = f"log in {d}: inputs that underflowed to 0 give -inf; keep it in float32"
    elif family == "pow":
        category = "pow"
        detail = f"{prim} in {d} overflows/underflows quickly (norm statistics, x**2); keep it in float32"
    elif family == "sum":
        axes = eqn.params.get("axes")
        if axes is None and "axis" in eqn.params:
            axes = (eqn.params["axis"],)
        n = int(np.prod([aval.shape[a] for a in (axes or ())], dtype=np.int64)) if axes else 1
        if n >= reduction_threshold:
            category = "reduction"
            detail = (f"{prim} over {n} elements accumulates in {d}: the running sum loses the small terms; "
                      "sum in float32 (jnp.sum upcasts, lax.reduce_sum does not)")
    elif prim.startswith("psum"):
        category = "all-reduce"
        detail = f"all-reduce in {d} can overflow when replicas add up; reduce in float32"
    if category is None:
        return None
    return category, detail


#: The scope the Flax door's engine program runs in (``jaxmp[keep]:autocast(flax <policy>)``).
_DOOR_SCOPE = "jaxmp[keep]:autocast(flax "


def door_derivative(stack) -> bool:
    """Whether a name stack is the backward pass of the Flax door's program, itself differentiated.

    The door runs the model through the engine, but a ``jax.grad`` taken *of* the door (outside
    it) transposes the door's half ops as they are. In an ordinary train step that backward is
    the gradient (``transpose(jvp(door))``, as under ``torch.autocast``); a derivative that is
    part of the loss's value (a physics-informed residual, a gradient penalty) is then
    differentiated again or differentiated twice: at least three ``jvp``/``transpose`` wrappers
    around the door's scope, one of them a transpose.

    Args:
      stack: `jaxmp._jaxpr.StackItem` items, outermost first (the enclosing equations' too).

    Returns:
      True for an op of such a derivative.
    """
    for i, item in enumerate(stack):
        if item.kind == "scope" and item.name.startswith(_DOOR_SCOPE):
            wrappers = [s.name for s in stack[:i] if s.kind == "transform" and s.name in ("jvp", "transpose")]
            return "transpose" in wrappers and len(wrappers) >= 3
    return False


def _door_derivative_risk(eqn, ctx: _Ctx) -> RiskyOp | None:
    """A float32-list op in half inside a differentiated door derivative (see `door_derivative`)."""
    prim = eqn.primitive.name
    if prim not in _FLOAT32_OPS or not eqn.invars or not hasattr(eqn.invars[0], "aval"):
        return None
    aval = eqn.invars[0].aval
    if not _format.is_low_precision(getattr(aval, "dtype", None)) or not door_derivative(
            ctx.stack + _jaxpr.stack_of(eqn)):
        return None
    d = _format.short_dtype(aval.dtype)
    return RiskyOp(prim, "door derivative", d, tuple(map(int, aval.shape)),
                   f"{prim} in {d} in the backward of jaxmp.flax.mixed_precision's program, which the loss "
                   "differentiates (u_x, u_xx, a gradient penalty): JAX transposes the door's half ops as they are, "
                   "so this float32-list op is not float32; wrap the whole loss in jaxmp.autocast(loss, preset) "
                   "(docs/choose-your-way-in.md)", " > ".join(ctx.context), _name(eqn, ctx), _source(eqn, ctx))


def _risk(eqn, ctx: _Ctx, col: _Collector, consumers) -> RiskyOp | None:
    door = _door_derivative_risk(eqn, ctx)
    if door is not None:
        return door
    found = classify_risk(eqn, consumers, col.reduction_threshold)
    if found is None:
        return None
    aval = eqn.invars[0].aval
    return RiskyOp(eqn.primitive.name, found[0], _format.short_dtype(aval.dtype), tuple(map(int, aval.shape)),
                   found[1], " > ".join(ctx.context), _name(eqn, ctx), _source(eqn, ctx))


def _reads_half(var, producers) -> bool:
    """Whether ``var`` is half precision or a float32 copy of a half-precision array."""
    if _format.is_low_precision(var.aval.dtype):
        return True
    eqn = producers.get(var)
    return (eqn is not None and eqn.primitive.name == "convert_element_type"
            and _jaxpr.is_var(eqn.invars[0]) and _format.is_low_precision(eqn.invars[0].aval.dtype))


def _half_scalar_reduction(eqn, producers, seen: set):
    """The reduction a 0-d half-precision value comes from, if it reduces a half array.

    ``jnp.mean(x_f16)`` upcasts, sums in float32 and casts the scalar back to float16: the sum is
    safe but the result (a loss, a global norm) lives in fp16's range and precision.

    Returns:
      ``(reduction eqn, first time seen)``, or ``(None, False)``.
    """
    out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
    aval = getattr(out, "aval", None)
    if aval is None or getattr(aval, "shape", None) != () or not _format.is_low_precision(aval.dtype):
        return None, False
    frontier = [eqn]
    for _ in range(5):
        nxt: list = []
        for e in frontier:
            if e.primitive.name in _REDUCE_PRIMS:
                src = e.invars[0]
                if _jaxpr.is_var(src) and np.prod(src.aval.shape) > 1 and _reads_half(src, producers):
                    new = id(e) not in seen
                    seen.add(id(e))
                    return e, new
                continue
            if e.primitive.name not in _SCALAR_PASS:
                continue
            nxt.extend(producers[v] for v in e.invars if _jaxpr.is_var(v) and v in producers)
        frontier = nxt
    return None, False


#: Elementwise ops where a float32 operand rounded to half loses what it keeps (not add_any: autodiff's sums).
_ELEMENTWISE = _ops.having("elementwise")
#: Ops that move a value without changing it (followed back to the input it came from).
_LAYOUT = _ops.having("moves")
#: The default float32 list (autocast's: ``jaxmp.engine.FLOAT32_OPS``).
_FLOAT32_OPS = _ops.of_class("float32")


def _nmant(dtype) -> int:
    import jax.numpy as jnp  # numpy's finfo does not know bfloat16

    return int(jnp.finfo(dtype).nmant)


def _narrowed(eqn, ctx: _Ctx, col: _Collector, producers) -> list[RiskyOp]:
    """A float32 value rounded to half right before an elementwise op (a bias after a half
    matmul under O2 or a hand cast): with its magnitude and the half ulp there when known."""
    out: list[RiskyOp] = []
    if eqn.primitive.name not in _ELEMENTWISE or not eqn.outvars:
        return out
    out_dtype = getattr(eqn.outvars[0].aval, "dtype", None)
    if out_dtype is None or not _format.is_low_precision(out_dtype):
        return out
    for v in eqn.invars:
        conv = producers.get(v) if _jaxpr.is_var(v) else None
        if conv is None or conv.primitive.name != "convert_element_type" or id(conv) in col.narrowed:
            continue
        src = conv.invars[0]
        src_dtype = np.dtype(getattr(src.aval, "dtype", np.float16)) if hasattr(src, "aval") else None
        if src_dtype is None or src_dtype.kind != "f" or src_dtype.itemsize < 4:
            continue
        root = src
        while _jaxpr.is_var(root) and root in producers and producers[root].primitive.name in _LAYOUT:
            root = producers[root].invars[0]
        if not (_jaxpr.is_var(root) and root in col.inputs):
            continue  # an activation made in float32 (a norm's output): not a value that moves in small steps
        col.narrowed.add(id(conv))
        d = _format.short_dtype(out_dtype)
        value = col.values.get(root) if _jaxpr.is_var(root) else None
        if value is not None:
            mag = float(np.max(np.abs(np.asarray(value, np.float64)))) if np.size(value) else 0.0
            ulp = float(2.0 ** (np.floor(np.log2(mag)) - (_nmant(out_dtype)))) if mag else 0.0
            size = (f"|x| up to {mag:.4g}, where the {d} ulp is {ulp:.3g}: a change smaller than {ulp / 2:.3g} is lost"
                    if mag else  # all zeros (a zero-initialised bias): no ulp to quote yet
                    f"it holds zeros now; once it moves, its {d} ulp is 2**-{_nmant(out_dtype)} of its magnitude "
                    "and a change smaller than half of that is lost")
        else:
            size = f"its {d} ulp is 2**-{_nmant(out_dtype)} of its magnitude"
        out.append(RiskyOp(
            eqn.primitive.name, "narrowed", d, tuple(map(int, getattr(src.aval, "shape", ()))),
            f"a {src_dtype.name} value is rounded to {d} before an elementwise {eqn.primitive.name} ({size}); "
            "a parameter or state that moves in small steps stalls: keep it float32 (O1, jaxmp.float32_region)",
            " > ".join(ctx.context), _name(eqn, ctx), _source(eqn, ctx)))
    return out


def _walk(jaxpr, ctx: _Ctx, col: _Collector) -> int:
    """Appends the ops of ``jaxpr`` (recursively) to ``col``; returns the FLOPs that count."""
    consumers = defaultdict(list)
    producers = {}
    for eqn in _jaxpr.equations(jaxpr):
        for v in eqn.invars:
            if _jaxpr.is_var(v):
                consumers[v].append(eqn)
        for v in eqn.outvars:
            producers[v] = eqn
    reductions_seen: set = set()
    flops = 0
    for eqn in _jaxpr.equations(jaxpr):
        prim = eqn.primitive.name
        if prim in _MATMUL_PRIMS:
            op = _matmul_op(eqn, ctx, col)
            col.ops.append(op)
            flops += op.flops
            continue
        risky = _risk(eqn, ctx, col, consumers)
        if risky is not None:
            col.risky.append(risky)
        col.risky.extend(_narrowed(eqn, ctx, col, producers))
        red, new = _half_scalar_reduction(eqn, producers, reductions_seen)
        if red is not None:
            col.half_scalars.add(id(eqn.outvars[0]))
        if new:
            d = _format.short_dtype(eqn.outvars[0].aval.dtype)
            col.risky.append(RiskyOp(
                red.primitive.name, "loss", d, tuple(map(int, red.invars[0].aval.shape)),
                f"a {d} array is reduced to a {d} scalar (a loss or a norm?): compute it in float32",
                " > ".join(ctx.context), _name(red, ctx), _source(red, ctx)))
        own = _format.user_path(_jaxpr.stack_of(eqn))
        prefix = ctx.name_prefix + ((own,) if own else ())
        src = _source(eqn, ctx)
        stack = ctx.stack + _jaxpr.stack_of(eqn)
        kind = _jaxpr.primitive_kind(eqn)
        if kind in _jaxpr.LOOPS | _jaxpr.BRANCHES:
            # a scan body counts `length` times, a while body once, only the costliest cond branch
            bodies = _jaxpr.bodies(eqn)
            if any(body.trips is None for body in bodies):  # a while
                col.unknown_trip_counts += 1
            branch_flops, spans = [], []
            for body in bodies:
                label = body.label + (" (trip count unknown, counted once)" if body.trips is None else "")
                sub = _Ctx(ctx.calls * (body.trips or 1), ctx.context + (label,), prefix, src, stack)
                start = len(col.ops)
                branch_flops.append(_walk(body.jaxpr, sub, col))
                spans.append((start, len(col.ops)))
            if kind not in _jaxpr.BRANCHES:
                flops += sum(branch_flops)
                continue
            taken = int(np.argmax(branch_flops)) if branch_flops else 0
            for i, (a, b) in enumerate(spans):
                if i != taken:
                    for j in range(a, b):
                        col.ops[j] = col.ops[j]._replace(counted=False)
            flops += branch_flops[taken] if branch_flops else 0
        else:
            label = prim
            if isinstance(eqn.params.get("name"), str):
                label = f"{prim}({eqn.params['name']})"
            for sub_jaxpr in _jaxpr.sub_jaxprs(eqn, opened=True):
                if len(sub_jaxpr.invars) == len(eqn.invars):  # a call: its inputs are the operands
                    col.values.update({i: col.values[o] for i, o in zip(sub_jaxpr.invars, eqn.invars)
                                       if _jaxpr.is_var(o) and o in col.values})
                    col.inputs.update(i for i, o in zip(sub_jaxpr.invars, eqn.invars)
                                      if _jaxpr.is_var(o) and o in col.inputs)
                flops += _walk(sub_jaxpr, _Ctx(ctx.calls, ctx.context + (label,), prefix, src, stack), col)
    return flops


def walk_jaxpr(jaxpr, *, compute_half: bool = False, tc_multiple: int = 8, reduction_threshold: int = 1024,
               values=None):
    """Collects the matmuls/convs and risky ops of ``jaxpr`` and all its sub-jaxprs.

    Args:
      jaxpr: a ``Jaxpr`` (``closed_jaxpr.jaxpr``).
      compute_half: whether the policy computes in half precision (float32 matmuls are missed).
      tc_multiple: the multiple the Tensor-Core shape rule asks for.
      reduction_threshold: element count from which a half-precision sum is risky.
      values: concrete arrays of ``jaxpr``'s inputs, one per invar, or None: the magnitude of a
        narrowed float32 input is then reported with the half ulp there.

    Returns:
      ``(ops, risky, unknown_trip_counts)``: tuples of [`MatmulOp`][jaxmp.diagnostics.MatmulOp] and [`RiskyOp`][jaxmp.diagnostics.RiskyOp]
      in program order, and the number of ``while`` loops counted once.
    """
    col = _Collector(compute_half=compute_half, multiple=tc_multiple, reduction_threshold=reduction_threshold)
    col.inputs = set(jaxpr.invars)
    if values is not None and len(values) == len(jaxpr.invars):
        col.values = {v: x for v, x in zip(jaxpr.invars, values)
                      if getattr(x, "shape", None) == getattr(v.aval, "shape", ())}
    _walk(jaxpr, _Ctx(), col)
    # A scalar half-precision output of a step is nearly always the loss.
    for i, v in enumerate(jaxpr.outvars):
        aval = getattr(v, "aval", None)
        if (aval is not None and getattr(aval, "shape", None) == () and _format.is_low_precision(aval.dtype)
                and id(v) not in col.half_scalars):
            d = _format.short_dtype(aval.dtype)
            col.risky.append(RiskyOp(
                "output", "loss", d, (), f"output #{i} is a {d} scalar: if it is the loss, compute the loss in float32 "
                "(policy.cast_to_output on the logits)", "", "", ""))
    return tuple(col.ops), tuple(col.risky), col.unknown_trip_counts

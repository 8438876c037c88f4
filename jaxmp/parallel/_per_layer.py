"""Per-layer FSDP gathers and the step's remat policy, for models that scan (or loop) over layers.

Under ``make_sharded_train_step(..., layout="fsdp")`` the params are sharded at rest. By default
the step gathers every param where the loss starts, so all of them are live at once and the
temporaries do not fall with N. A loss that calls `scan_layers` (or `gather_params`
on one layer's params) instead keeps those params sharded until that layer runs: each layer's
params are gathered inside the scan body, in the compute dtype (cast first, then gathered: a
bf16 gather is half an fp32 one), released after the forward (never saved for the backward, with
or without the step's ``remat`` policy: `release_policy`) and gathered again in the backward.
What the step gathers where the loss starts is then only the params the loss does not gather itself (embeddings, final norm).

How the step knows: it traces the loss once abstractly (shapes only) and records which params
leaves reach these helpers; those enter the loss sharded. Outside a jaxmp sharded step (or under
another layout) the helpers are a plain cast and a plain ``lax.scan`` (with the remat policy
applied only inside a step), so the same loss runs anywhere.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp import _jaxpr, _ops
from jaxmp._dtypes import float_dtype
from jaxmp.parallel import _reduce, _wire_matmul
from jaxmp._typing import PyTree

__all__ = ["gather_params", "remat_policy", "scan_layers"]

_LOCAL = threading.local()

REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def remat_policy(remat: str | Callable[..., bool] | None) -> Callable | None:
    """The ``jax.checkpoint`` policy of a step's ``remat`` setting.

    Args:
      remat: ``None`` (no remat), a name in ``jax.checkpoint_policies`` (``"nothing_saveable"``:
        keep only each layer's input and recompute the rest in the backward; ``"dots_saveable"``:
        keep matmul outputs) or a policy callable.

    Returns:
      The policy, or ``None``.

    Example:
      >>> from jaxmp.parallel import remat_policy
      >>> remat_policy("nothing_saveable") is not None, remat_policy(None)
      (True, None)
    """
    if remat is None or callable(remat):
        return remat
    if isinstance(remat, str) and remat in REMAT_POLICIES:
        return getattr(jax.checkpoint_policies, remat)
    raise ValueError(f"remat must be None, a policy callable or one of {', '.join(map(repr, REMAT_POLICIES))}; "
                     f"got {remat!r}")


class LayerContext:
    """What the helpers do inside one trace of a step's loss.

    ``mode``: ``"record"`` (the abstract trace: note which leaves are gathered), ``"manual"``
    (inside the per-shard ``shard_map``: ``leaves`` maps a sharded leaf's id to its data-axis
    dimension) or ``"global"`` (``reduce_dtype=None``: ``leaves`` maps an id to the
    ``NamedSharding`` the gathered leaf takes).
    """

    def __init__(self, mode: str, *, axis: str | None = None, reduce_dtype: Any = None, leaves: dict | None = None,
                 remat: Callable | None = None, mesh: Any = None, wire: Any = None):
        self.mode, self.axis, self.reduce_dtype, self.remat, self.mesh = mode, axis, reduce_dtype, remat, mesh
        self.wire = wire  # the quantized collectives (`jaxmp.parallel._wire.Wire`), or None
        self.leaves = {} if leaves is None else leaves
        self.recorded: set = set()


def _current() -> LayerContext | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def context(ctx: LayerContext):
    """Makes ``ctx`` the helpers' context for the trace inside (a stack: nested steps work)."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


GATHERED = "jaxmp_fsdp_gathered"
"""The ``checkpoint_name`` of a layer's gathered params inside `scan_layers` (what the
release policy refuses to save)."""

# The primitives that make a gathered param from its slice: an all-gather (manual mode, inside
# the ``custom_vjp`` of `jaxmp.parallel._reduce.gathered`) or a sharding constraint (global
# mode). Their outputs are whole params, never saved for the backward: re-gathered from the slice.
_GATHER_PRIMITIVES = _ops.having("gathers")  # the op catalogue's
_COLLECTIVE_GATHERS = _GATHER_PRIMITIVES & _ops.of_class("collective")


def _makes_a_gathered_param(prim: Any, params: dict) -> bool:
    # A custom_vjp's forward as one equation (``optimize_remat=True``: ``remat_opt``) is refused only
    # when it gathers: jaxmp's quantized gather (quantize, gather the codes, dequantize) is one, so
    # none of the dequantized values between the codes and the param is saved; another (a kernel's
    # forward in the user's layer) is saved as the step's policy says.
    inner = params.get("fwd_jaxpr")
    if inner is None:
        return True
    return any(e.eqn.primitive.name in _COLLECTIVE_GATHERS for e in _jaxpr.walk(inner))


def release_policy(policy: Callable | None) -> Callable:
    """``policy`` that never saves a gathered param: FSDP's reshard after forward.

    ``jax.checkpoint`` saves for the backward what its policy allows; a scan body without one
    saves every residual, the gathered weights of every layer included (the matmuls' backward
    needs them), so they stay whole for the whole step and the temporaries barely fall with N.
    Under this policy a gathered param (named `GATHERED`) and the gather that made it are
    never saved: the backward re-gathers them from the slice (one more all-gather per layer,
    what FSDP2's ``reshard_after_forward=True`` does; with ``gather_bits`` the quantized gather,
    one ``remat_opt`` equation, is refused whole, so its dequantized values are not saved
    either and the backward gathers the codes again), and everything else is saved as
    ``policy`` says (``None``: everything, i.e. the activations stay as without remat).
    ``jax.checkpoint_policies.save_anything_except_these_names`` would say this, but in JAX
    0.10.2 it saves everything (its body is a placeholder), hence this one.

    Args:
      policy: the step's remat policy, or ``None`` (keep the activations).

    Returns:
      A ``jax.checkpoint`` policy (tested in tests/parallel/test_per_layer.py).
    """
    def saveable(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") == GATHERED:
            return False
        if prim.name in _GATHER_PRIMITIVES and _makes_a_gathered_param(prim, params):
            return False
        return True if policy is None else policy(prim, *args, **params)

    return saveable


def _check_dtype(dtype: Any, where: str) -> Any:
    """``dtype`` as a floating numpy dtype, or None; a TypeError naming ``where`` otherwise.

    An integer dtype would truncate the weights (an FSDP step then trains on integers without
    a word), and a misspelt name is otherwise numpy's "data type not understood".
    """
    if dtype is None:
        return None
    try:
        return float_dtype(dtype, f"{where}: dtype")
    except TypeError as e:
        raise TypeError(f"{e}; it is the compute dtype the floating params are cast to (e.g. jnp.bfloat16), "
                        "or None to use them as stored") from None


def _cast(x: Any, dtype: Any) -> Any:
    return x.astype(dtype) if dtype is not None and _reduce.is_float(x) else x


def _gather(ctx: LayerContext | None, x: Any, info: Any, dtype: Any, key: str = "") -> Any:
    # ``key``: the last key of the leaf's path (a kernel may be gathered in its matmul's format).
    if ctx is None or info is None:
        return _cast(x, dtype)
    if ctx.mode == "manual":
        assert ctx.axis is not None  # a manual context is made with its data axis
        x = _cast(x, dtype)
        return _reduce.gathered(x, ctx.axis, info, ctx.reduce_dtype, _wire_matmul.leaf_wire(ctx.wire, key, x))
    return jax.lax.with_sharding_constraint(_cast(x, dtype), info)


def gather_params(tree: PyTree, dtype: jax.typing.DTypeLike | None = None) -> PyTree:
    """One layer's (or any sub-tree's) params, gathered where they are used (FSDP).

    Inside a ``make_sharded_train_step(..., layout="fsdp")`` step the leaves of ``tree`` stay
    sharded until this call, which casts them to ``dtype`` (if given) and then all-gathers them;
    their gradients are reduce-scattered back onto each device's slice in the step's
    ``reduce_dtype``. Elsewhere it is only the cast. Pass the params as the loss received them
    (``params["block3"]``), not a computed value.

    Args:
      tree: a sub-tree of the params the loss was given.
      dtype: the compute dtype to cast floating leaves to before gathering (``None``: as stored;
        under O2-bf16 they are stored bf16 already).

    Returns:
      ``tree`` with every leaf whole (and cast).

    Raises:
      TypeError: a ``dtype`` that is not a floating dtype (an integer one would truncate the weights).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.parallel import gather_params
      >>> gather_params({"w": jnp.ones((2, 2))}, jnp.bfloat16)["w"].dtype
      dtype(bfloat16)
    """
    dtype = _check_dtype(dtype, "gather_params")
    ctx = _current()
    if ctx is not None and ctx.mode == "record":
        ctx.recorded.update(id(x) for x in jax.tree_util.tree_leaves(tree))
        return jax.tree_util.tree_map(lambda x: _cast(x, dtype), tree)
    lookup = (lambda x: None) if ctx is None else (lambda x: ctx.leaves.get(id(x)))  # noqa: E731
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _gather(ctx, x, lookup(x), dtype, _wire_matmul.leaf_key(path)), tree)


def _slice_info(ctx: LayerContext, info: Any, name: str) -> Any:
    # The layer axis (0) is scanned over: the sharded dimension of one layer's slice is one lower.
    if info is None:
        return None
    if ctx.mode == "manual":
        if info == 0:
            raise ValueError(f"the stacked params leaf {name} is sharded along its layer axis (0), so one layer's "
                             "slice cannot be gathered on its own: its largest dimension that the device count "
                             "divides is the layer count; raise min_shard_size past its size to keep it replicated, "
                             "or give it a wider dimension")
        return info - 1
    spec = list(info.spec) + [None]
    return NamedSharding(info.mesh, PartitionSpec(*spec[1:]))


def _check_layers(layers: PyTree) -> None:
    """A ValueError naming the leaves where lax.scan's own error would name only sizes."""
    way = "pass the stacked layers' params (e.g. params['layers'], every leaf stacked on a leading layer axis)"
    with_paths = jax.tree_util.tree_leaves_with_path(layers)
    if not with_paths:
        raise ValueError(f"scan_layers got no layers: layers={layers!r} has no array leaves; {way}")
    lengths: dict = {}
    for path, x in with_paths:
        name = jax.tree_util.keystr(path) or "<root>"
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if not shape:
            raise ValueError(f"scan_layers: the layers leaf at {name} is a scalar, it has no layer axis; {way}")
        lengths.setdefault(shape[0], []).append(name)
    if len(lengths) > 1:
        listing = "; ".join(f"{n} layers: {', '.join(names)}" for n, names in sorted(lengths.items()))
        raise ValueError(f"scan_layers: the layers' leaves disagree on the number of layers (their leading axis): "
                         f"{listing}; every leaf must stack the same layers, e.g. "
                         "jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer_params)")


def scan_layers(body: Callable, init: PyTree, layers: PyTree, *, dtype: jax.typing.DTypeLike | None = None,
                unroll: int = 1) -> tuple[PyTree, PyTree]:
    """``lax.scan(body, init, layers)`` over stacked layers, each layer's params gathered in its body.

    ``layers`` is the sub-tree of params holding every layer's params stacked on a leading axis.
    Inside an FSDP step each layer's slice is cast to ``dtype`` and gathered inside the scan
    body (`gather_params`), so about one layer's params are whole at a time: the body runs
    under ``jax.checkpoint`` with `release_policy`, so a layer's gathered params are dropped
    after its forward and re-gathered in its backward (reshard after forward), and the step's
    ``remat`` policy (``make_sharded_train_step(..., remat=...)``) decides the rest: with
    ``None`` the activations are saved, with ``"nothing_saveable"`` only each layer's input.

    Args:
      body: ``body(carry, layer_params) -> (carry, y)``, as for ``lax.scan``.
      init: the initial carry (the activations).
      layers: the stacked layers' params, as the loss received them (``params["layers"]``).
      dtype: the compute dtype to cast floating params to before gathering (``None``: as stored).
      unroll: as for ``lax.scan``.

    Returns:
      ``(carry, ys)`` as from ``lax.scan``.

    Raises:
      TypeError: a ``dtype`` that is not a floating dtype.
      ValueError: ``layers`` with no array leaves, a scalar leaf, or leaves whose leading (layer)
        axes differ (each leaf is named with its length).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.parallel import scan_layers
      >>> layers = {"w": jnp.stack([jnp.eye(4)] * 3)}
      >>> carry, _ = scan_layers(lambda h, p: (h @ p["w"], None), jnp.ones(4), layers)
      >>> carry.tolist()
      [1.0, 1.0, 1.0, 1.0]
    """
    dtype = _check_dtype(dtype, "scan_layers")
    _check_layers(layers)
    ctx = _current()
    leaves, treedef = jax.tree_util.tree_flatten(layers)
    if ctx is not None and ctx.mode == "record":
        ctx.recorded.update(id(x) for x in leaves)
        infos = [None] * len(leaves)
    else:
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(layers)]
        infos = [None if ctx is None else _slice_info(ctx, ctx.leaves.get(id(x)), n) for x, n in zip(leaves, names)]

    gathers = any(info is not None for info in infos)
    keys = [_wire_matmul.leaf_key(p) for p, _ in jax.tree_util.tree_leaves_with_path(layers)]

    def step(carry, xs):
        used = [_gather(ctx, x, info, dtype, key) for x, info, key in zip(treedef.flatten_up_to(xs), infos, keys)]
        if gathers:  # named, so that the release policy knows them
            used = [x if info is None else checkpoint_name(x, GATHERED) for x, info in zip(used, infos)]
        return body(carry, jax.tree_util.tree_unflatten(treedef, used))

    if gathers:
        # Reshard after forward: the layer's gathered params are not saved for the backward
        # (re-gathered there from their slices), with or without the step's remat policy.
        step = jax.checkpoint(step, policy=release_policy(ctx.remat))
    elif ctx is not None and ctx.remat is not None:
        step = jax.checkpoint(step, policy=ctx.remat)
    return jax.lax.scan(step, init, layers, unroll=unroll)

"""The sharded layouts split a state node the way the node says (``jaxmp._tree.ShardsItself``),
never by its type: a state of anyone's making that implements the two methods is laid out by
them, jaxmp.lean's quantized state is one such node, and no module of jaxmp.parallel names a
jaxmp.lean type or field (issue 61, item 2)."""

import ast
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import _tree, lean

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Columns(NamedTuple):
    """A moment kept whole on its rows: it allows its param a split on the last axis only."""

    moment: Any

    def split_axes(self, params_def, param_shapes, n):
        return {j: {len(shape) - 1} for j, shape in enumerate(param_shapes)}

    def partition_specs(self, specs_of):
        return _Columns(specs_of(self.moment))


def _columns_tx():
    return optax.GradientTransformation(lambda p: _Columns(jax.tree_util.tree_map(jnp.zeros_like, p)),
                                        lambda g, s, p=None: (g, s))


def test_a_node_that_says_how_it_splits_is_split_so():
    mesh = jaxmp.parallel.make_data_mesh()
    params = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32)}
    state = jax.eval_shape(_columns_tx().init, params)
    assert isinstance(state, _tree.ShardsItself)
    ps, ss = jaxmp.parallel.state_shardings(params, state, mesh, "fsdp")
    # Left to itself the layout splits the larger axis (the 64 rows); the node allows the columns only.
    assert ps["w"].spec == P(None, "data") and ss.moment["w"].spec == P(None, "data")
    plain = jax.eval_shape(optax.sgd(0.1, momentum=0.9).init, params)
    assert jaxmp.parallel.state_shardings(params, plain, mesh, "fsdp")[0]["w"].spec == P("data")


def test_the_quantized_state_lays_itself_out():
    params = {"w": jnp.zeros((64, 512))}
    q = lean.quantized_moments(optax.adam(1e-3), bits=4).init(params)
    assert isinstance(q, _tree.ShardsItself)
    params_def = jax.tree_util.tree_structure(params)
    # Rows of 4 blocks (128 a block): 8 devices split the 64 rows, not the 512 columns (64 a device).
    assert q.split_axes(params_def, [(64, 512)], 8) == {0: {0}}
    specs = q.partition_specs(lambda tree: jax.tree_util.tree_map(
        lambda x: P("data") if jnp.ndim(x) == 2 else P(), tree))
    assert specs.inner_state[0].mu["w"] == P("data") and specs.absmax[0].mu["w"] == P("data")
    assert specs.key == P() and specs.count == P() and specs.map_revision == P() and specs.grid == q.grid


def _names_in(path: pathlib.Path) -> set:
    """The jaxmp.lean modules a file imports and the names it imports from them."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmp.lean"):
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "jaxmp":
            found |= {f"jaxmp.{a.name}" for a in node.names if a.name == "lean"}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxmp.lean")}
    return found


def test_no_module_of_jaxmp_parallel_names_a_lean_type():
    lean_types = {name for name in dir(lean) if isinstance(getattr(lean, name), type)
                  and getattr(lean, name).__module__.startswith("jaxmp.lean")}
    assert "QuantizedMomentsState" in lean_types
    offenders = {}
    for path in sorted((ROOT / "jaxmp" / "parallel").glob("*.py")):
        imported = {name for name in _names_in(path) if name != "jaxmp.lean._seams.whole_leaves"}
        named = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)} & lean_types
        if imported or named:
            offenders[path.name] = sorted(imported | named)
    assert offenders == {}

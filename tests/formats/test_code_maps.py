"""The quantized format as a value (issue 61, item 2): `jaxmp._formats.Grid` quantizes,
dequantizes and shapes a leaf itself, and the grid travels whole, never as loose ``bits`` and
``block`` ints through the lean recipes."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import _formats

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORMAT_FILES = ("jaxmp/_formats/_code_maps.py", "jaxmp/lean/_chunked.py", "jaxmp/lean/_quantized.py")


@pytest.mark.parametrize("bits,block", [(8, 256), (8, 64), (4, 128), (4, 5)])
@pytest.mark.parametrize("shape", [(6, 512), (3, 4, 64), (7, 37), (300,), (2, 3, 130)])
def test_the_grid_says_the_shapes_it_quantizes_to(bits, block, shape):
    grid = _formats.Grid(bits, block)
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    codes, absmax = grid.quantize(x, signed=True)
    assert codes.shape == grid.codes_shape(shape) and absmax.shape == grid.absmax_shape(shape)
    back = grid.dequantize(codes, absmax, True, shape)
    assert back.shape == shape
    # Each value within half the map's largest gap of its block's absmax.
    gap = float(np.diff(grid.code_map(True)).max())
    assert float(jnp.max(jnp.abs(back - x))) <= float(jnp.max(absmax)) * gap / 2 * (1 + 1e-5)


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            # The one place the loose ints become a grid: a function that returns a Grid.
            makes_grid = node.returns is not None and ast.unparse(node.returns).endswith("Grid")
            yield node.name, [] if makes_grid else positional


def test_no_function_of_the_format_takes_bits_and_block_loose():
    loose, long = [], []
    for name in FORMAT_FILES:
        for fn, positional in _functions(ROOT / name):
            if {"bits", "block"} <= set(positional):
                loose.append(f"{name}:{fn}")
            if len(positional) >= 8:
                long.append(f"{name}:{fn} ({len(positional)})")
    assert loose == [] and long == []


def test_the_grid_is_static_and_compares_by_value():
    grid = _formats.Grid(8, 256)
    assert jax.tree_util.tree_leaves(grid) == [] and grid == _formats.Grid(8, 256)
    assert jax.tree_util.tree_structure(grid) != jax.tree_util.tree_structure(_formats.Grid(4, 128))

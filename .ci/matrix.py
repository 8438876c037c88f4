"""Prints the CI version matrix (jaxmp/engine/_tested.py's MATRIX), one `python jax` pair a line.

Read with ast, so it needs no JAX: .ci/run calls it before any environment exists.
`--extra` leaves out the first row, which is the main CI environment itself.
"""

import ast
import pathlib
import sys

source = (pathlib.Path(__file__).resolve().parents[1] / "jaxmp" / "engine" / "_tested.py").read_text()
tree = ast.parse(source)
matrix = next(ast.literal_eval(node.value) for node in tree.body
              if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "MATRIX")
for python, jax in matrix[1:] if "--extra" in sys.argv else matrix:
    print(python, jax)

"""jaxmp/engine/_tested.py: the CI matrix table and what the engine derives from it."""

import jax
import pytest

from jaxmp.engine import _internals as internals
from jaxmp.engine._tested import MATRIX, TESTED_JAX, describe, is_newer_than_tested


def test_the_matrix_rows_are_python_and_jax_versions_and_tested_jax_their_releases():
    assert MATRIX and all(len(row) == 2 and all(isinstance(v, str) for v in row) for row in MATRIX)
    assert TESTED_JAX == tuple(sorted({tuple(int(p) for p in j.split(".")[:2]) for _, j in MATRIX}))
    # Every CI cell runs these tests on one of the matrix's JAX versions.
    assert jax.__version__ in {j for _, j in MATRIX}


@pytest.mark.parametrize("version,newer", [((0, 10, 2), False), ((0, 10, 99), False), ((0, 4, 0), False),
                                           ((*max(TESTED_JAX), 7), False), ((max(TESTED_JAX)[0], max(TESTED_JAX)[1] + 1), True),
                                           ((1, 0, 0), True)])
def test_only_a_major_minor_above_every_tested_one_is_newer(version, newer):
    assert is_newer_than_tested(version) is newer


def test_the_installed_jax_is_a_tested_one_so_no_canary_runs():  # in every CI cell
    assert not is_newer_than_tested(internals.JAX_VERSION)


def test_describe_lists_every_row():
    text = describe()
    assert text.count("jax ") == len(MATRIX)
    for py, jx in MATRIX:
        assert f"jax {jx} (Python {py})" in text

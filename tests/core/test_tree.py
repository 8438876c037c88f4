"""jaxmp/_tree.py: finding states by class and the two tree checks that name the leaf."""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmp import _tree


class Marker(NamedTuple):
    value: object


def test_find_states_finds_every_instance_at_any_depth_in_tree_order():
    a, b = Marker(1), Marker(jnp.ones(2))
    tree = {"x": [a, (jnp.zeros(1), {"y": b})], "z": None}
    found = _tree.find_states(tree, Marker)
    assert found == [a, b] and found[0] is a  # the instances themselves, not their leaves
    assert _tree.find_states(optax.sgd(0.1).init({"w": jnp.ones(1)}), Marker) == []
    assert _tree.find_states(a, Marker) == [a]
    # A state nested inside another is found as the outer one only (its leaves are not walked).
    assert _tree.find_states(Marker(Marker(0)), Marker) == [Marker(Marker(0))]


def test_check_all_arrays_names_the_first_non_array_leaf():
    _tree.check_all_arrays({"a": jnp.ones(1), "b": np.ones(1), "c": np.float32(1)}, "grads")
    with pytest.raises(TypeError, match=r"grads leaf at \['b'\]\[1\] is a float, not an array"):
        _tree.check_all_arrays({"a": jnp.ones(1), "b": [np.ones(1), 1.0]}, "grads")


def test_check_same_structure_names_the_differing_structure_or_leaf():
    _tree.check_same_structure({"w": jnp.ones((2, 3))}, {"w": np.zeros((2, 3))}, "grads", "params")
    with pytest.raises(ValueError, match="grads and params have different tree structures"):
        _tree.check_same_structure({"w": 1}, {"v": 1}, "grads", "params")
    with pytest.raises(ValueError, match=r"grads leaf at \['b'\] has shape \(3,\) but the params leaf has \(2,\)"):
        _tree.check_same_structure({"a": jnp.ones(1), "b": jnp.ones(3)}, {"a": jnp.ones(1), "b": jnp.ones(2)},
                                   "grads", "params")
    # Scalars and Python numbers have shape ().
    _tree.check_same_structure([1.0], [jnp.float32(2)], "a", "b")

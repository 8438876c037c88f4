"""Tests of jaxmp.flax, the Flax doors (Linen, NNX)."""

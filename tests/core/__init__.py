"""Tests of jaxmp's top-level modules (jaxmp/x.py): transform, loss scale, step, policy ..."""

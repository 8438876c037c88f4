"""Tests of jaxmp.engine, the autocast interpreter."""

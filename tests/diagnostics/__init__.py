"""Tests of jaxmp.diagnostics."""

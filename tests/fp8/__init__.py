"""Tests of jaxmp.fp8."""

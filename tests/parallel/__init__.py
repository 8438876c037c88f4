"""Tests of jaxmp.parallel (8 simulated CPU devices)."""

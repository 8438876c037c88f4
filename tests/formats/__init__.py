"""Tests of jaxmp._formats: the element table, lean's code maps and Grid, the block-scaled quantizer."""

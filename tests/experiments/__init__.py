"""Tests of the experiments/ package (trainings at CI size, checkpoints, the CLI)."""

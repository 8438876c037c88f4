"""jaxmp benchmarks (not part of the installed package): run the scripts, see README.md."""

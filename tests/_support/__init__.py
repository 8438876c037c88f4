"""Helpers of the tests (jaxpr op dtypes, markdown pages, import graph, multiprocess workers)."""

"""The JAX versions CI tests jaxmp with: one table, read by .ci/run and by the engine.

``.ci/run`` builds one virtual environment per row (``python .ci/matrix.py`` prints them) and
runs the default tier of tests/{engine,core,fp8,parallel} in it. The engine reads the same rows: on a JAX newer than
every tested version, the first autocast function built runs a small canary
(`jaxmp.engine._contract.run_canary_once`); tested versions pay nothing.
"""

from __future__ import annotations

#: (Python version, JAX version) per CI cell. The first row is the main CI environment (the
#: README's install on the machine's Python); the others get a venv of their own.
MATRIX: tuple[tuple[str, str], ...] = (
    ("3.11", "0.10.2"),
    ("3.12", "0.11.2"),
    ("3.12", "0.12.0.1"),
)

#: The tested (major, minor) JAX releases.
TESTED_JAX: tuple[tuple[int, int], ...] = tuple(sorted({tuple(int(p) for p in jax.split(".")[:2])
                                                         for _, jax in MATRIX}))


def is_newer_than_tested(version: tuple[int, ...]) -> bool:
    """Whether a JAX version (as a tuple of ints) is newer than the newest tested release.

    Args:
      version: e.g. ``(0, 13, 0)``.

    Returns:
      True for a major.minor above every tested one.
    """
    return tuple(version[:2]) > max(TESTED_JAX)


def describe() -> str:
    """The tested versions as text, e.g. ``"jax 0.10.2 (Python 3.11), ..."``."""
    return ", ".join(f"jax {j} (Python {p})" for p, j in MATRIX)

"""jaxmp experiments: reproduce the seeds' mixed-precision studies per hardware.

Flax-examples shape: ``main.py`` (entry point), ``train.py`` (training and
evaluation loop built on jaxmp's public API), ``compare.py`` (one command that
trains the same config under several policies and writes the results table and
plots), ``configs/`` (``default.py`` plus one file per hardware), ``models/``
and ``data/``; ``results.py`` formats the table and plots, ``checkpoint/`` wraps orbax, and
``recorded/`` keeps the outputs of the runs quoted in the README.

Nothing here is imported by ``jaxmp`` itself; TensorFlow, TFDS and matplotlib
are imported lazily, only when a config needs them.
"""

"""A small character-level causal Transformer LM and its offline text: the docstrings of Python's standard library.

The text is the docstrings (module, class and function, in ``ast.walk`` order) of the standard
library modules :data:`DOC_MODULES`, read from their source files with ``ast`` (nothing is
imported or executed, no network), in that fixed order. Characters outside :data:`VOCAB`
(printable ASCII and newline) become ``?``. The text depends only on the Python version's
standard library; :func:`load_text` returns its SHA-256 so a result names exactly what it trained on.

The last :data:`EVAL_FRACTION` of the characters is held out. Training batches are random windows
drawn from a generator seeded by ``(seed, step)``, so a batch depends on nothing but those two
numbers; the evaluation windows are the held-out text cut into consecutive windows.

Used by ``benchmarks/fidelity.py``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from typing import NamedTuple

import flax.linen as nn
import numpy as np

from experiments.models.transformer import EncoderBlock

DOC_MODULES = ("argparse", "collections", "functools", "inspect", "json.decoder",
               "json.encoder", "logging", "pathlib", "subprocess", "textwrap", "typing", "unittest.case",
               "dataclasses", "enum", "string", "shutil", "tempfile", "threading", "datetime", "fractions")
"""Standard-library modules (pure Python, so they have source files) whose docstrings make the text."""

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
"""The characters, id = index: newline and printable ASCII (96)."""

EVAL_FRACTION = 0.1
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_UNKNOWN = _INDEX["?"]


def docstrings(module: str) -> list[str]:
    """The docstrings of ``module``'s source file, read with ``ast`` (nothing imported), in ``ast.walk`` order.

    Raises:
      FileNotFoundError: the module has no Python source file.
    """
    spec = importlib.util.find_spec(module)
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not origin.endswith(".py"):
        raise FileNotFoundError(f"{module} has no Python source file (origin {origin!r})")
    with open(origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=origin)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node))]


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) of ``text``; characters outside :data:`VOCAB` map to ``?``."""
    return np.array([_INDEX.get(c, _UNKNOWN) for c in text], np.uint8)


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


class Text(NamedTuple):
    """The encoded text, split into training and held-out parts."""

    train: np.ndarray
    eval: np.ndarray
    sha256: str          # of the UTF-8 text before encoding
    num_chars: int
    source: str          # what the text is, in words


def load_text(modules=DOC_MODULES, max_chars: int | None = None) -> Text:
    """The docstrings of ``modules``, joined by blank lines, encoded and split (the last 10% held out).

    Args:
      modules: standard-library module names, in the order their text is joined.
      max_chars: keep only the first ``max_chars`` characters (dry runs).
    """
    text = "\n\n".join(d for m in modules for d in docstrings(m))
    if max_chars is not None:
        text = text[:max_chars]
    ids = encode(text)
    cut = int(len(ids) * (1 - EVAL_FRACTION))
    source = (f"docstrings of {len(modules)} Python {sys.version_info.major}.{sys.version_info.minor} "
              f"standard-library modules ({', '.join(modules)}), read with ast")
    return Text(ids[:cut], ids[cut:], hashlib.sha256(text.encode()).hexdigest(), len(ids), source)


def train_batch(ids: np.ndarray, step: int, batch_size: int, context: int, seed: int) -> dict:
    """Batch ``step`` of seed ``seed``: ``batch_size`` random windows; ``inputs`` [B, context], ``label`` the next characters."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - context - 1, size=batch_size)
    windows = np.stack([ids[s:s + context + 1] for s in starts]).astype(np.int32)
    return {"inputs": windows[:, :-1], "label": windows[:, 1:]}


def eval_batches(ids: np.ndarray, batch_size: int, context: int, max_windows: int | None = None):
    """The held-out text as consecutive windows (the tail that fills no window left out), in batches."""
    n = (len(ids) - 1) // context
    if max_windows is not None:
        n = min(n, max_windows)
    windows = np.stack([ids[i * context:i * context + context + 1] for i in range(n)]).astype(np.int32)
    for i in range(0, n, batch_size):
        w = windows[i:i + batch_size]
        yield {"inputs": w[:, :-1], "label": w[:, 1:]}


class CausalLM(nn.Module):
    """Token + learned position embeddings, ``num_layers`` causal blocks, a final LN and a linear head."""

    vocab_size: int = len(VOCAB)
    context: int = 64
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 256

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        del train
        x = nn.Embed(self.vocab_size, self.width)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
        x = x + pos[:tokens.shape[1]].astype(x.dtype)
        for i in range(self.num_layers):
            # experiments' block, under this model's own module names (Block_0, ...): the
            # names seed the initialisers, so the recorded runs' params stay what they were
            x = EncoderBlock(self.num_heads, self.mlp_dim, causal=True, name=f"Block_{i}")(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))

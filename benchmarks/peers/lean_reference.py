"""The peers' own 8-bit and 4-bit optimizer-state code on fixed inputs: a reference file for jaxmp.lean.

Runs bitsandbytes' and torchao's code (maps, blockwise quantization, ``torchao.optim.AdamW8bit``
and ``AdamW4bit``) on inputs built here from fixed seeds, and writes everything, inputs included,
to one small ``.npz``: ``tests/lean/data/lean_reference.npz``. tests/lean/test_lean_reference.py
holds jaxmp to it without torch; docs/lean-recipes.md#the-peers-bit-for-bit lists what differs by
design.

Needs torch, torchao and bitsandbytes (not jaxmp's dependencies), and no JAX::

    /work/peers-venv/bin/python -m benchmarks.peers.lean_reference    # from the repository root

The file records the peers' versions; the run is deterministic (CPU, fixed seeds), so a re-run
with the same versions writes the same arrays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "lean" / "data" / "lean_reference.npz"

#: Hyperparameters of the AdamW trajectories: torchao's defaults.
HPARAMS = {"lr": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "steps": 200}
#: The formats: (bits, signed, block): torchao's AdamW8bit / AdamW4bit block sizes.
FORMATS = {"8s": (8, True, 256), "8u": (8, False, 256), "4s": (4, True, 128), "4u": (4, False, 128)}
#: The blocks of each format's input, in order (see `inputs`).
BLOCKS = ("normal", "decades", "zeros", "tiny", "ties", "nan", "inf", "entries")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.lean_reference",
        description="Run bitsandbytes' and torchao's 8-bit/4-bit optimizer-state code on fixed inputs and write "
                    "the reference file tests/lean/data/lean_reference.npz (needs torch, torchao, bitsandbytes).")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the .npz (default: {OUT})")
    parser.add_argument("--steps", type=int, default=HPARAMS["steps"], help="AdamW trajectory length (default: 200)")
    return parser


def inputs(qmap: np.ndarray, signed: bool, block: int, seed: int) -> np.ndarray:
    """One block of each kind of `BLOCKS`, float32 ``(len(BLOCKS), block)``.

    ``ties``: every midpoint of two neighbouring map entries (float32 ``(a + b) / 2``, repeated to
    fill the block) with one 1.0, so the absmax is 1 and each value sits on a rounding boundary;
    ``entries``: the map's own entries times a power of two; ``tiny``: an absmax of about 1e-20,
    under torchao's 1e-12 clip; ``nan``/``inf``: one non-finite element in a normal block.
    """
    rng = np.random.default_rng(seed)
    n = rng.normal(size=(4, block)).astype(np.float32)
    sign = (lambda x: x) if signed else np.abs
    decades = (n[1] * 10.0 ** rng.uniform(-7, 0, block)).astype(np.float32)
    mids = ((qmap[:-1] + qmap[1:]) / np.float32(2)).astype(np.float32)
    if not signed:
        mids = mids[mids >= 0]
    ties = np.resize(mids, block).astype(np.float32)
    ties[0] = 1.0
    entries = (np.resize(qmap, block) * np.float32(4)).astype(np.float32)
    entries[0] = 4.0
    nan, inf = sign(n[2]).copy(), sign(n[3]).copy()
    nan[5], inf[7] = np.nan, np.inf
    rows = [sign(n[0]), sign(decades), np.zeros(block, np.float32), sign(n[0] * np.float32(1e-20)), ties, nan, inf,
            entries]
    return np.stack(rows).astype(np.float32)


def _maps(torch):
    import bitsandbytes.functional as bnb
    from torchao.optim import subclass_4bit, subclass_8bit

    as_np = lambda values: np.asarray(torch.tensor(values, dtype=torch.float32).numpy(), np.float32)  # noqa: E731
    return {"bnb_map_8s": as_np(bnb.create_dynamic_map(signed=True)),
            "bnb_map_8u": as_np(bnb.create_dynamic_map(signed=False)),
            "torchao_map_8s": as_np(subclass_8bit.get_qmap_signed()),
            "torchao_map_8u": as_np(subclass_8bit.get_qmap_unsigned()),
            "torchao_map_4s": as_np(subclass_4bit.get_qmap_signed()),
            "torchao_map_4u": as_np(subclass_4bit.get_qmap_unsigned())}


def _quantized(torch, maps: dict) -> dict:
    """Per format: the input, torchao's codes (unpacked), scales and dequantized values; bitsandbytes'
    too at 8 bits (its CPU blockwise kernel)."""
    import bitsandbytes.functional as bnb
    from torchao.optim import quant_utils as q

    out = {}
    for seed, (name, (bits, signed, block)) in enumerate(FORMATS.items()):
        qmap = maps[f"torchao_map_{name}"]
        x = inputs(qmap, signed, block, seed)
        t, tmap = torch.from_numpy(x.reshape(-1)), torch.from_numpy(qmap)
        scaled, scale = q.scale_tensor(t, block)
        codes = (q.quantize_8bit_with_qmap if bits == 8 else q.quantize_4bit_with_qmap)(scaled, tmap)
        out.update({f"x_{name}": x, f"torchao_codes_{name}": codes.numpy().reshape(x.shape),
                    f"torchao_absmax_{name}": scale.numpy(),
                    f"torchao_dequant_{name}": q.dequant_with_qmap(codes, tmap, scale).numpy().reshape(x.shape)})
        if bits == 8:
            code = torch.from_numpy(maps[f"bnb_map_{name}"])
            bcodes, state = bnb.quantize_blockwise(t, code=code, blocksize=block)
            back = bnb.dequantize_blockwise(bcodes, absmax=state.absmax, code=code, blocksize=block)
            out.update({f"bnb_codes_{name}": bcodes.numpy().reshape(x.shape),
                        f"bnb_absmax_{name}": state.absmax.numpy().astype(np.float32),
                        f"bnb_dequant_{name}": back.numpy().reshape(x.shape)})
    return out


def problem(seed: int = 0) -> dict:
    """The trajectories' problem: a tanh MLP whose two weights are quantized (8192 and 4096 values,
    whole blocks) and whose biases are not (under 4096: float32 in both). Each input appears twice
    with two targets, so the loss has a floor (about 0.5) and its relative gap stays meaningful."""
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (rng.normal(size=shape) * s).astype(np.float32)  # noqa: E731
    return {"x": np.tile(f(64, 32), (2, 1)), "y": f(128, 16), "w1": f(32, 256, s=0.2), "b1": f(256, s=0.1), "w2": f(256, 16, s=0.1),
            "b2": f(16, s=0.1)}


def _trajectory(torch, optim_cls, block: int, data: dict, steps: int) -> dict:
    params = {k: torch.nn.Parameter(torch.from_numpy(data[k].copy())) for k in ("w1", "b1", "w2", "b2")}
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    opt = optim_cls(list(params.values()), lr=HPARAMS["lr"], betas=(HPARAMS["b1"], HPARAMS["b2"]), eps=HPARAMS["eps"],
                    weight_decay=HPARAMS["weight_decay"], block_size=block)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"] - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"loss": np.asarray(losses, np.float32), **{k: v.detach().numpy().copy() for k, v in params.items()}}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    import bitsandbytes
    import torch
    import torchao
    from torchao.optim import AdamW4bit, AdamW8bit

    torch.manual_seed(0)
    maps = _maps(torch)
    record = {**maps, **_quantized(torch, maps)}
    data = problem()
    record.update({f"problem_{k}": v for k, v in data.items()})
    for bits, cls in ((8, AdamW8bit), (4, AdamW4bit)):
        for k, v in _trajectory(torch, cls, FORMATS[f"{bits}s"][2], data, args.steps).items():
            record[f"adamw{bits}_{k}"] = v
    meta = {"torch": torch.__version__, "torchao": torchao.__version__, "bitsandbytes": bitsandbytes.__version__,
            "hparams": {**HPARAMS, "steps": args.steps}, "formats": FORMATS, "blocks": BLOCKS,
            "command": "python -m benchmarks.peers.lean_reference"}
    record["meta"] = np.asarray(json.dumps(meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **record)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {meta['torch']}, torchao {meta['torchao']}, "
          f"bitsandbytes {meta['bitsandbytes']}")
    return record


if __name__ == "__main__":
    main()

"""The PyTorch peer: the throughput suite's models with torch.autocast + GradScaler on the same GPU.

    python -m benchmarks.torch_amp                      # full suite on a CUDA GPU
    python -m benchmarks.torch_amp --dry-run --out -    # tiny models on CPU (needs CPU torch)

PyTorch is not a dependency of jaxmp: it is imported here only, and when it is missing the
script says so, writes a ``"status": "skipped"`` result and exits 0.

Same models (hand-written to match ``experiments.models``: pre-activation WRN, ResNet-50 v1.5
-- torchvision's when installed, which is the same architecture -- and the pre-LN Transformer
encoder), same batch sizes, input shapes, synthetic on-device data, optimizers (SGD momentum
0.9 + weight decay 5e-4 as an L2 term; AdamW) and timing method (warm-up excluded, blocks of
steps closed by ``torch.cuda.synchronize()``, median and spread) as ``throughput.py``.
CNNs run channels-last. Variants:

* ``fp32-strict`` -- TF32 off for matmuls and cuDNN (pairs with jaxmp ``O0-strict``);
* ``fp32-tf32``   -- TF32 on (pairs with ``O0`` at the default matmul precision);
* ``amp-fp16``    -- ``torch.autocast(dtype=float16)`` + ``torch.amp.GradScaler`` (pairs with ``O1``, ``O2-fp16``);
* ``amp-bf16``    -- ``torch.autocast(dtype=bfloat16)``, GradScaler disabled as PyTorch
  recommends for bf16 (pairs with ``O2-bf16``);
* ``compile-amp-fp16``, ``compile-amp-bf16`` -- the same with the model under ``torch.compile``
  (default mode; compilation happens in the warm-up steps and is not timed).

Peak memory is ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``
per run. On a GPU every (model, batch, variant) runs in a fresh process (``--no-isolate`` to
share one) and the JSON is rewritten after every run, so a time-out or a crash loses that run
only.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable

from benchmarks import _common as common
from benchmarks._suite import DRY_SUITE, DRY_TIMING, SUITE, TIMING  # plain data, no JAX

VARIANTS = ("fp32-strict", "fp32-tf32", "amp-fp16", "amp-bf16", "compile-amp-fp16", "compile-amp-bf16")
SKIP_MESSAGE = "PyTorch is not installed: the PyTorch AMP peer is skipped (it is not a jaxmp dependency; " \
               "`pip install torch` on the GPU machine to run it)"

# Defaults of experiments.models (kept in step by hand; the spec's overrides are applied on top).
WRN_DEFAULTS = {"wrn28_10": dict(depth=28, widen_factor=10), "wrn16_4": dict(depth=16, widen_factor=4)}
RESNET_DEFAULTS = dict(stage_sizes=(3, 4, 6, 3), width=64)
TRANSFORMER_DEFAULTS = dict(num_layers=2, model_dim=64, num_heads=4, mlp_dim=128)


def build_model(torch, spec: dict, prefer_torchvision: bool = True):
    """The PyTorch twin of a throughput-suite model; returns (module, description)."""
    nn = torch.nn
    F = torch.nn.functional
    name, overrides = spec["model"]
    classes = spec["classes"]

    if name in WRN_DEFAULTS:
        cfg = {**WRN_DEFAULTS[name], **overrides}
        depth, k = cfg["depth"], cfg["widen_factor"]

        class WideBlock(nn.Module):
            def __init__(self, cin, cout, stride):
                super().__init__()
                self.bn1 = nn.BatchNorm2d(cin, momentum=0.1)
                self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
                self.bn2 = nn.BatchNorm2d(cout, momentum=0.1)
                self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
                self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

            def forward(self, x):
                out = F.relu(self.bn1(x))
                shortcut = self.proj(out) if self.proj is not None else x
                y = F.relu(self.bn2(self.conv1(out)))
                return self.conv2(y) + shortcut

        class WideResNet(nn.Module):
            def __init__(self):
                super().__init__()
                n = (depth - 4) // 6
                layers, cin = [nn.Conv2d(3, 16, 3, 1, 1, bias=False)], 16
                for g, w in enumerate((16, 32, 64)):
                    for i in range(n):
                        layers.append(WideBlock(cin, w * k, 2 if (g > 0 and i == 0) else 1))
                        cin = w * k
                self.body = nn.Sequential(*layers)
                self.bn = nn.BatchNorm2d(cin, momentum=0.1)
                self.head = nn.Linear(cin, classes)

            def forward(self, x):
                x = F.relu(self.bn(self.body(x)))
                return self.head(x.mean(dim=(2, 3)))

        return WideResNet(), f"WRN-{depth}-{k} (pre-activation, hand-written)"

    if name == "resnet50":
        cfg = {**RESNET_DEFAULTS, **overrides}
        if prefer_torchvision and tuple(cfg["stage_sizes"]) == (3, 4, 6, 3) and cfg["width"] == 64:
            try:
                import torchvision

                return (torchvision.models.resnet50(num_classes=classes, zero_init_residual=True),
                        f"torchvision {torchvision.__version__} resnet50 (v1.5)")
            except ImportError:
                pass

        class Bottleneck(nn.Module):
            def __init__(self, cin, f, stride):
                super().__init__()
                self.c1, self.b1 = nn.Conv2d(cin, f, 1, bias=False), nn.BatchNorm2d(f)
                self.c2, self.b2 = nn.Conv2d(f, f, 3, stride, 1, bias=False), nn.BatchNorm2d(f)
                self.c3, self.b3 = nn.Conv2d(f, 4 * f, 1, bias=False), nn.BatchNorm2d(4 * f)
                nn.init.zeros_(self.b3.weight)
                self.down = None
                if cin != 4 * f or stride != 1:
                    self.down = nn.Sequential(nn.Conv2d(cin, 4 * f, 1, stride, bias=False), nn.BatchNorm2d(4 * f))

            def forward(self, x):
                y = F.relu(self.b1(self.c1(x)))
                y = F.relu(self.b2(self.c2(y)))
                y = self.b3(self.c3(y))
                return F.relu((self.down(x) if self.down is not None else x) + y)

        class ResNet(nn.Module):
            def __init__(self):
                super().__init__()
                w = cfg["width"]
                self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                          nn.MaxPool2d(3, 2, 1))
                blocks, cin = [], w
                for i, n in enumerate(cfg["stage_sizes"]):
                    for j in range(n):
                        blocks.append(Bottleneck(cin, w * 2**i, 2 if i > 0 and j == 0 else 1))
                        cin = 4 * w * 2**i
                self.blocks = nn.Sequential(*blocks)
                self.head = nn.Linear(cin, classes)

            def forward(self, x):
                return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

        return ResNet(), f"ResNet stages {tuple(cfg['stage_sizes'])} width {cfg['width']} (v1.5, hand-written)"

    if name == "transformer":
        cfg = {**TRANSFORMER_DEFAULTS, **overrides}
        d, h, mlp, layers = cfg["model_dim"], cfg["num_heads"], cfg["mlp_dim"], cfg["num_layers"]
        seq_len = spec["input"][0]

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1 = nn.LayerNorm(d, eps=1e-6)  # Flax's LayerNorm epsilon
                self.attn = nn.MultiheadAttention(d, h, batch_first=True)
                self.ln2 = nn.LayerNorm(d, eps=1e-6)
                self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)

            def forward(self, x):
                y = self.ln1(x)
                x = x + self.attn(y, y, y, need_weights=False)[0]
                return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))  # flax nn.gelu

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(1, d)
                self.pos = nn.Parameter(torch.randn(1, seq_len, d) * 0.02)
                self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
                self.ln = nn.LayerNorm(d, eps=1e-6)
                self.head = nn.Linear(d, classes)

            def forward(self, x):
                x = self.embed(x[..., None]) + self.pos
                return self.head(self.ln(self.blocks(x)).mean(dim=1))

        return Encoder(), f"pre-LN encoder L={layers} d={d} h={h} mlp={mlp} (hand-written, nn.MultiheadAttention)"

    raise ValueError(f"no PyTorch twin for model {name!r}")


def run_one(torch, model_key: str, spec: dict, batch_size: int, variant: str, timing: dict, device: str,
            channels_last: bool, compile_model: bool, quiet: bool) -> dict:
    F = torch.nn.functional
    entry = {"model": model_key, "batch_size": batch_size, "policy": variant, "unit": spec["unit"],
             "optimizer": spec["optimizer"], "framework": "pytorch"}
    cuda = device == "cuda"
    compile_model = compile_model or variant.startswith("compile-")
    variant = variant.removeprefix("compile-")
    tf32 = variant != "fp32-strict"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True
    amp_dtype = {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}.get(variant)
    use_scaler = variant == "amp-fp16"
    image = spec["unit"] == "images"
    fmt = torch.channels_last if (image and channels_last) else torch.contiguous_format
    entry.update(autocast=str(amp_dtype) if amp_dtype else None, grad_scaler=use_scaler, tf32=tf32 if cuda else None,
                 channels_last=fmt is torch.channels_last, torch_compile=compile_model)

    torch.manual_seed(0)
    model, desc = build_model(torch, spec)
    entry["model_impl"] = desc
    model = model.to(device=device, memory_format=fmt)
    model.train()
    entry["n_params"] = int(sum(p.numel() for p in model.parameters()))
    if spec["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device, enabled=use_scaler)
    fwd = torch.compile(model) if compile_model else model

    n_in = tuple(spec["input"])
    batches = []
    for i in range(timing["n_batches"]):
        if image:  # NHWC shapes in the suite -> NCHW tensors (channels-last memory when asked)
            h, w, c = n_in
            x = torch.randn(batch_size, c, h, w, device=device).contiguous(memory_format=fmt)
        else:
            x = torch.randn(batch_size, *n_in, device=device)
        y = torch.randint(0, spec["classes"], (batch_size,), device=device)
        batches.append((x, y))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = fwd(x)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    nb = len(batches)
    t0 = time.perf_counter()
    for i in range(timing["warmup_steps"]):
        loss = step(*batches[i % nb])
    sync()
    entry["warmup_s"] = time.perf_counter() - t0
    samples = []
    for _ in range(timing["rounds"]):
        t0 = time.perf_counter()
        for i in range(timing["steps"]):
            loss = step(*batches[i % nb])
        sync()
        samples.append((time.perf_counter() - t0) / timing["steps"])
    st = common.summarize(samples)
    items = batch_size * (n_in[0] if spec["unit"] == "tokens" else 1)
    final_loss = float(loss.detach())
    entry.update(status="ok", step_time_s=st, samples_s=samples, items_per_step=items,
                 items_per_s=items / st["median"], items_per_s_iqr=[items / st["q75"], items / st["q25"]],
                 final_loss=final_loss if math.isfinite(final_loss) else None,
                 loss_scale=float(scaler.get_scale()) if use_scaler else None)
    if cuda:
        entry["memory"] = {"source": "torch.cuda.max_memory_allocated", "peak_bytes": int(torch.cuda.max_memory_allocated()),
                           "max_reserved_bytes": int(torch.cuda.max_memory_reserved())}
    else:
        entry["memory"] = {"source": "unavailable (CPU)", "peak_bytes": None}
    common.log(f"  {model_key} b{batch_size} {variant:11s}: {entry['items_per_s']:.1f} {spec['unit']}/s, "
               f"step {st['median'] * 1e3:.2f} ms (IQR {st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f})", quiet)
    model = opt = fwd = batches = None  # drop the references (the step closure holds cells) before empty_cache
    if cuda:
        torch.cuda.empty_cache()
    return entry


def torch_env(torch, device: str) -> dict:
    env = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "platform": device,
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "cudnn": str(torch.backends.cudnn.version()) if device == "cuda" else None,
                        "torchvision": common._version("torchvision"),
                        "jax": common._version("jax"), "jaxlib": common._version("jaxlib"),
                        "flax": common._version("flax"), "optax": common._version("optax")}}
    if device == "cuda":
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    env.update(common._host_env())
    return env


def skipped_result(reason: str, dry_run: bool, config: dict) -> dict:
    env = {"device": "n/a", "platform": "n/a", "versions": {"torch": None}}
    env.update(common._host_env())
    return common.make_result("torch_amp", env, config, {"runs": []}, dry_run, status="skipped", reason=reason)


def _guarded_run(torch, m, spec, b, v, timing, device, args) -> dict:
    try:
        return run_one(torch, m, spec, b, v, timing, device, not args.no_channels_last, args.compile, args.quiet)
    except Exception as ex:  # noqa: BLE001 - recorded, the suite goes on
        msg = f"{type(ex).__name__}: {ex}"
        e = {"model": m, "batch_size": b, "policy": v, "framework": "pytorch",
             "status": "oom" if "out of memory" in msg.lower() else "error", "error": msg[:4000]}
        common.log(f"  {m} b{b} {v}: {e['status']}: {msg[:300]}", args.quiet)
        if device == "cuda":
            torch.cuda.empty_cache()
        return e


def _child_main(args) -> None:
    """``--single MODEL:BATCH:VARIANT``: one run in this (fresh) process, JSON to --child-out."""
    import torch

    suite = DRY_SUITE if args.dry_run else SUITE
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, b, v = args.single.split(":")
    e = _guarded_run(torch, m, suite[m], int(b), v, timing, device, args)
    Path(args.child_out).write_text(json.dumps(common._finite_json(e)))


def _child_tail(args) -> list[str]:
    tail = ["--dry-run"] if args.dry_run else []
    for k in ("rounds", "steps", "warmup_steps"):
        if getattr(args, k) is not None:
            tail += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for flag in ("no_channels_last", "compile", "quiet"):
        if getattr(args, flag):
            tail.append("--" + flag.replace("_", "-"))
    return tail


def run_suite(args, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Runs every (model, batch, variant); ``on_progress(partial_result)`` after each run."""
    suite = DRY_SUITE if args.dry_run else SUITE
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    models = common.parse_choices(args.models, list(suite), "model")
    variants = common.parse_choices(args.variants, list(VARIANTS), "variant")
    config = {"suite": {k: {**v, "model": list(v["model"])} for k, v in suite.items() if k in models},
              "timing": timing, "variants": variants, "channels_last_cnns": not args.no_channels_last,
              "torch_compile": "compile-* variants" + (" and every variant (--compile)" if args.compile else ""),
              "data": "synthetic, on device, n_batches cycled"}
    try:
        import torch
    except ImportError as e:
        print(f"torch_amp: SKIPPED: {SKIP_MESSAGE} ({e})", flush=True)
        return skipped_result(SKIP_MESSAGE, args.dry_run, config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        reason = "no CUDA GPU visible to PyTorch: the PyTorch peer is a GPU benchmark (use --dry-run for a CPU smoke test)"
        print(f"torch_amp: SKIPPED: {reason}", flush=True)
        return skipped_result(reason, args.dry_run, config)
    isolate = args.isolate if args.isolate is not None else device == "cuda"
    config["isolated_processes"] = isolate
    env = torch_env(torch, device)
    common.log(f"torch_amp: {env['device']}, torch {torch.__version__}", args.quiet)
    entries = []
    for m in models:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else list(suite[m]["batches"])
        for b in batches:
            for v in variants:
                if isolate:
                    e = common.run_child("benchmarks.torch_amp", ["--single", f"{m}:{b}:{v}", *_child_tail(args)], args.timeout)
                    e.setdefault("model", m), e.setdefault("batch_size", b), e.setdefault("policy", v)
                    if e.get("status") != "ok":
                        common.log(f"  {m} b{b} {v}: {e.get('status')}: {str(e.get('error'))[:300]}", args.quiet)
                else:
                    e = _guarded_run(torch, m, suite[m], b, v, timing, device, args)
                entries.append(e)
                if on_progress is not None:
                    on_progress(common.make_result("torch_amp", env, config, {"runs": list(entries)}, args.dry_run,
                                                   status="ok", complete=False))
    return common.make_result("torch_amp", env, config, {"runs": entries}, args.dry_run, status="ok", complete=True)


def build_parser():
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help=f"comma list of {', '.join(SUITE)} (default: all)")
    parser.add_argument("--batches", help="comma list of batch sizes overriding each model's")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--rounds", type=int, help="timed blocks per run")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps (cudnn autotuning, torch.compile)")
    parser.add_argument("--no-channels-last", action="store_true", help="keep CNNs in NCHW memory format")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every variant (the compile-* variants always are)")
    iso = parser.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                     help="one fresh process per run (default on a GPU)")
    iso.add_argument("--no-isolate", dest="isolate", action="store_false", help="all runs in this process")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per isolated run")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser


def _print_runs(result: dict) -> None:
    for e in result["results"]["runs"]:
        if e.get("status") == "ok":
            st = e["step_time_s"]
            print(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:16s} {e['items_per_s']:10.1f} {e['unit']}/s  "
                  f"step {st['median'] * 1e3:.2f} ms ({st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f})", flush=True)
        else:
            print(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:16s} {e['status']}: {e.get('error', '')[:100]}")


def main(argv=None) -> dict | None:
    return common.run_suite_main("torch_amp", build_parser().parse_args(argv), run_suite, _child_main, _print_runs)


if __name__ == "__main__":
    main()

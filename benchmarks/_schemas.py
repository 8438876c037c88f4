"""The results schemas of the benchmarks, as data, and the one checker that reads them.

A schema is a leaf name (a key of ``LEAVES``), ``"result"`` (a whole nested result, such as
the parts of a GPU suite: ``ROOT``), or a dict:

* a list node: ``{"items": schema, "nonempty": bool}``;
* a dict node: ``"keys"`` (required, each with its schema), ``"opt"`` (checked when present
  and not None), ``"values"`` (the schema of every other key), ``"nonempty"``, ``"rules"``
  (relations between keys, names of ``RULES``), ``"switch"`` with ``"cases"`` / ``"default"``
  (a further schema for the same dict, picked by the value of one of its keys), ``"if_has"``
  (a further schema for the same dict when it holds a key);
* ``{"fail": message}``: always a problem (an unknown benchmark, a bad status).

Every problem names its key path (``results.runs[0].step_time_s.median ...``). Stdlib only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable
from typing import Any


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


#: Leaf name -> (predicate, what a good value is).
LEAVES = {
    "any": (lambda x: True, "anything"),
    "str": (lambda x: isinstance(x, str), "a string"),
    "text": (lambda x: isinstance(x, str) and bool(x), "a non-empty string"),
    "bool": (lambda x: isinstance(x, bool), "a bool"),
    "dict": (lambda x: isinstance(x, dict), "a dict"),
    "num": (_num, "a number"),
    "float": (lambda x: isinstance(x, float), "a float"),
    "int": (lambda x: isinstance(x, int) and not isinstance(x, bool), "an int"),
    "count": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0, "a count (int >= 0)"),
    "pos_int": (lambda x: isinstance(x, int) and x >= 1, "a positive int"),
    "pos": (lambda x: _num(x) and math.isfinite(x) and x > 0, "a positive number"),
    "nonneg": (lambda x: _num(x) and x >= 0, "a non-negative number"),
}

#: Rule name -> (holds(dict, *args), what it asks(*args)); checked only where the node is clean.
RULES = {
    "ordered": (lambda d, *ks: all(d[a] <= d[b] for a, b in zip(ks, ks[1:])),
                lambda *ks: " <= ".join(ks) + " does not hold"),
    "covers": (lambda d, a, b: set(d[b]) <= set(d[a]), lambda a, b: f"{a} lacks an entry for a key of {b}"),
    "some_nonempty": (lambda d, *ks: any(d[k] for k in ks), lambda *ks: " or ".join(ks) + " must be non-empty"),
}


def _at(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


def check(value: Any, schema: Any, path: str = "") -> list[str]:
    """The problems of ``value`` against ``schema`` (empty when it conforms), each naming its path."""
    where, schema = path or "result", ROOT if schema == "result" else schema
    if isinstance(schema, str):
        ok, want = LEAVES[schema]
        return [] if ok(value) else [f"{where} is not {want}: {value!r:.60}"]
    if "fail" in schema:  # its message may name the value's keys: "unknown benchmark {benchmark!r}"
        fields = defaultdict(lambda: None, value if isinstance(value, dict) else {})
        return [f"{where}: " + schema["fail"].format_map(fields)]
    if "items" in schema:
        if not isinstance(value, list) or (schema.get("nonempty") and not value):
            return [f"{where} is not a {'non-empty ' * bool(schema.get('nonempty'))}list: {value!r:.60}"]
        return [p for i, x in enumerate(value) for p in check(x, schema["items"], _at(path, i))]
    if not isinstance(value, dict) or (schema.get("nonempty") and not value):
        return [f"{where} is not a {'non-empty ' * bool(schema.get('nonempty'))}dict: {value!r:.60}"]
    keys, opt = schema.get("keys", {}), schema.get("opt", {})
    missing = [f"{path + ': ' if path else ''}missing key {k!r}" for k in keys if k not in value]
    if missing:  # the rest would only repeat what a missing key already says
        return missing
    p = [q for k, s in keys.items() for q in check(value[k], s, _at(path, k))]
    p += [q for k, s in opt.items() if value.get(k) is not None for q in check(value[k], s, _at(path, k))]
    if "values" in schema:
        p += [q for k, x in value.items() if k not in keys and k not in opt
              for q in check(x, schema["values"], _at(path, k))]
    for name, *args in schema.get("rules", ()) if not p else ():
        holds, asks = RULES[name]
        p += [] if holds(value, *args) else [f"{where}: {asks(*args)}"]
    if "switch" in schema:
        v, sub = value.get(schema["switch"]), schema.get("default")
        sub = schema.get("cases", {}).get(v, sub) if isinstance(v, Hashable) else sub
        p += check(value, sub, path) if sub is not None else []
    for k, sub in schema.get("if_has", {}).items():
        p += check(value, sub, path) if k in value else []
    return list(dict.fromkeys(p))  # a key checked by two parts of a schema: say it once


def validate_result(result: Any) -> list[str]:
    """Checks a benchmark result against the envelope and its benchmark's schema.

    Args:
      result: the object a benchmark writes (``_common.make_result``), or any JSON value.

    Returns:
      The problems, each naming its key path; empty when the result is well formed.

    Example::

        >>> validate_result({"benchmark": "overhead"})[0]
        "missing key 'schema_version'"
    """
    return check(result, ROOT)


# ----------------------------------------------------------------------------------------------
# The schemas.

#: Summary statistics of samples (``_common.summarize``): positive, with ordered quantiles.
STATS = {"keys": {k: "pos" for k in ("median", "q25", "q75", "min", "max")} | {"n": "pos_int"},
         "rules": [("ordered", "min", "q25", "median", "q75", "max")]}


def sourced(amount: str) -> dict:
    """A measurement that says where it comes from: a ``source``, and ``amount`` positive or None."""
    return {"keys": {"source": "str"}, "opt": {amount: "pos"}}


def run_entry(unit: str, **more_when_ok) -> dict:
    """One (model, policy, batch) run: timed stats when its status is ``ok``, else an error text."""
    ok = {"keys": {"step_time_s": STATS, unit: "pos", "memory": sourced("peak_bytes"), **more_when_ok}}
    return {"keys": {"model": "any", "policy": "any", "batch_size": "any"},
            "switch": "status", "cases": {"ok": ok}, "default": {"keys": {"error": "str"}}}


def per_model(variant: dict, **model_extra) -> dict:
    """``results.models.<model>``: timed ``variants`` (each with step stats) and ``skipped`` reasons."""
    timed = {**variant, "keys": {"step_time_s": STATS, **variant.get("keys", {})}}
    model = {"keys": {"variants": {"values": timed, **model_extra.pop("variants", {})},
                      "skipped": {"values": "text"}}, **model_extra}
    return {"keys": {"results": {"keys": {"models": {"values": model, "nonempty": True}}}}}


def rows(**row_keys) -> dict:
    """``results.rows``: a non-empty list of rows with these keys."""
    return {"keys": {"results": {"keys": {"rows": {"items": {"keys": row_keys}, "nonempty": True}}}}}


#: What a JAX benchmark's ``env.versions`` holds (the PyTorch peer's holds ``torch`` instead).
JAX_ENV = {"keys": {"versions": {"keys": dict.fromkeys(("jax", "jaxlib", "flax", "optax"), "str")}}}


def jax_benchmark(schema: dict) -> dict:
    """A JAX benchmark's schema: its own keys and the JAX library versions in ``env``."""
    return {**schema, "keys": {**schema["keys"], "env": JAX_ENV}}


#: One compiled program's counts (benchmarks/efficiency.py).
PROGRAM = {"keys": dict.fromkeys(("ops", "converts", "bytes"), "num")}

#: Benchmark name -> the schema of its result (besides the envelope, ``ROOT``).
SCHEMAS = {
    "overhead": jax_benchmark({"keys": {"results": {"keys": {
        "step_time_s": {"keys": {"bare": STATS, "jaxmp": STATS}, "values": STATS},
        "ratios": {"keys": {"jaxmp/bare": STATS}, "values": STATS},
        "target": "dict"}}}}),
    "throughput": jax_benchmark({"keys": {"results": {"keys": {
        "runs": {"items": run_entry("items_per_s", flops=sourced("per_step")), "nonempty": True},
        "matmul_peak": {"keys": {"tflops": "pos"}}}}}}),
    "torch_amp": {"switch": "status", "default": {"fail": "status must be 'ok' or 'skipped', got {status!r}"},
                  "cases": {
        "skipped": {"keys": {"reason": "text"}},
        "ok": {"keys": {"env": {"keys": {"versions": {"keys": {"torch": "str"}}}},
                        "results": {"keys": {"runs": {"items": run_entry("items_per_s"), "nonempty": True}}}}}}},
    "gpu_suite": jax_benchmark({"keys": {"results": {"keys": {"throughput": "result", "torch_amp": "result"},
                                                     "opt": {"overhead": "result"}}}}),
    "autocast": jax_benchmark(per_model({"keys": {"trace_s": "pos", "trace_lower_compile_s": "pos",
                                                  "hlo_converts": "count", "loss_rel_error": "nonneg"}})),
    "fp8": jax_benchmark(per_model(
        {"keys": {"loss_curve": {"items": "float", "nonempty": True}, "policy": "str"},
         "switch": "policy", "cases": {"O2-fp8": {"keys": {"fp8_state": {"keys": {"amaxes_recorded_min": "pos"}}}}}},
        # Beside a bf16 run, every other variant reports its loss gap to it.
        variants={"if_has": {"bf16": {"keys": {"bf16": "any"},
                                      "values": {"keys": {"max_rel_loss_gap_last_half": "float"}}}}},
        rules=[("some_nonempty", "variants", "skipped")])),
    "memory": jax_benchmark(rows(**dict.fromkeys(("recipe", "layout", "devices", "params", "bytes_per_param_measured",
                                                  "bytes_per_param_analytic"), "any"))),
    "memory_gpt2": jax_benchmark(rows(**dict.fromkeys(("who", "layout", "reduce_dtype", "devices", "params"), "any"),
                                      compiled={"keys": {"peak_estimate_bytes": "int"}})),
    "memory_lean": jax_benchmark(rows(**dict.fromkeys(("recipe", "layout", "devices", "params", "bytes_per_param"),
                                                       "any"), compiled={"keys": {"peak_estimate_bytes": "int"}})),
    "efficiency": jax_benchmark({"keys": {"results": {"keys": {"models": {"nonempty": True, "values": {"keys": {
        prog: {"keys": {ref: PROGRAM}, "values": PROGRAM} for prog, ref in (("grad", "native"), ("step", "floor"))
    }}}}}}}),
    "fp8_blocks": jax_benchmark(rows(policy="str", seed="int", eval_loss="nonneg", eval_accuracy="nonneg",
                                     train_time_s="pos")),
    "wire": jax_benchmark({"keys": {"results": {"keys": {
        "rows": {"nonempty": True, "items": {
            "keys": dict.fromkeys(("who", "layout", "gather", "reduce", "status"), "str"),
            "switch": "status", "default": {"fail": "status must be measured, refused or not available, got {status!r}"},
            "cases": {"measured": {"keys": {"wire_bytes": "nonneg", "buffer_bytes": "nonneg", "params": "pos",
                                            "gather_wire_bytes": "nonneg", "reduce_wire_bytes": "nonneg",
                                            "by_kind": {"values": {"keys": {"wire_bytes": "nonneg",
                                                                            "buffer_bytes": "nonneg"}}},
                                            "cpu_only": {"keys": {"wire_bytes": "nonneg"}}}},
                      "refused": {"keys": {"error": "text"}},
                      "not available in this build": {"keys": {"missing": {"items": "str", "nonempty": True}}}}}},
        "prediction": {"items": {"keys": {"seconds": "nonneg", "model": "str", "link": "str"}}}}}}}),
    "precision_search": jax_benchmark({"keys": {"results": {"keys": {"models": {"nonempty": True, "values": {
        "keys": {"float32_spread": "nonneg", "modules": {"items": {"keys": {"path": "text", "rung": "text",
                                                                             "flops": "count"}}},
                 "search": {"keys": {"step_s": "pos", "gave_up": "str"}, "opt": {"cost_steps": "pos_int", "seconds": "pos"}},
                 "variants": {"keys": {"float32": "dict"}, "values": {"keys": {
                     "final": {"items": "num", "nonempty": True}, "within": "bool", "bits": "pos",
                     "shares": {"values": "nonneg", "nonempty": True}}}}}}}}}}}),
    "wire_fidelity": jax_benchmark({"keys": {"results": {"keys": {"models": {"nonempty": True, "values": {
        "keys": {"setup": "dict", "summary": "dict", "runs": {"values": {"nonempty": True, "items": {
            "keys": {"eval_loss": "nonneg", "eval_accuracy": "nonneg", "skips": "count"}}}}},
        "rules": [("covers", "summary", "runs")]}}}}}}),
    "fidelity": jax_benchmark({"keys": {"results": {"nonempty": True, "values": {
        "keys": {"setup": "any", "summary": "dict", "tail": "any", "runs": {"values": {"nonempty": True, "items": {
            "keys": {"eval_loss": "nonneg", "eval_accuracy": "nonneg"}}}}},
        "rules": [("covers", "summary", "runs")]}}}}),
}

#: The envelope every result file has (``_common.make_result``), then its benchmark's schema.
ROOT = {
    "keys": {"schema_version": "any", "benchmark": "any", "dry_run": "bool", "created_utc": "any",
             "config": "dict", "results": "any",
             "env": {"keys": {"device": "text", "platform": "any", "python": "any", "versions": "dict",
                              "git_commit": {"keys": {"sha": "str"}}}}},
    "switch": "benchmark", "cases": SCHEMAS, "default": {"fail": "unknown benchmark {benchmark!r}"},
}

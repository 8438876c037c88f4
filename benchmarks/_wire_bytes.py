"""Wire bytes of a partitioned program: what every collective moves, per step and per device.

One reader of the program XLA partitions, for every collective kind: all-gather, reduce-scatter,
all-reduce, all-to-all and collective-permute, their asynchronous ``-start`` forms (the
``-done`` halves move nothing more), and collectives wrapped in an ``async-start``. Shared by
``benchmarks/wire.py`` (the wire table), ``benchmarks/_o2_prediction.py`` and
tests/parallel/test_gather_dtypes.py (through :func:`gathers`).

**Which program.** On the CPU the program is read after SPMD partitioning and just before
XLA:CPU's ``all-reduce-promotion`` pass, which widens every bf16 all-reduce and reduce-scatter to
float32; the ``float-normalization-bf16`` pass after it widens the bf16 all-gathers too (the final
CPU HLO shows float32 collectives for a bf16 and a float32 step alike), so the final program would
count a bf16 collective at twice its bytes. Elsewhere (a GPU keeps bf16 collectives) the compiled
program's text is read.

**Per step.** A collective inside a ``while`` body counts once per trip (the body of a
``lax.scan`` over layers gathers every layer); the trip count is XLA's ``known_trip_count``
when the program has one, else read from the loop's counter (JAX's ``i = start; while i < n;
i += step``), and a collective in a loop whose trip count neither gives is a ``ValueError``
rather than a silent undercount. A collective in a ``conditional`` branch counts as if every
branch ran (an upper bound; :attr:`Collective.in_branch` marks it).

**Bytes moved per device** (``wire_bytes``): the bytes one device sends per step under the
ring algorithms, for a collective over a group of ``n`` devices whose full-size buffer (the
side that is not 1/n) is ``B`` bytes on each device:

=====================  ==========================  =====================================
kind                   B (per device)              bytes sent per device
=====================  ==========================  =====================================
all-gather             the gathered output         B * (n - 1) / n
reduce-scatter         the input (n x the output)  B * (n - 1) / n
all-reduce             the buffer                  2 * B * (n - 1) / n (reduce-scatter +
                                                   all-gather)
all-to-all             all pieces together         B * (n - 1) / n (a device keeps its own)
collective-permute     the buffer                  B (a device that sends, sends it once)
=====================  ==========================  =====================================

Each collective also reports ``B`` itself (``buffer_bytes``, the raw buffer a device holds on the
full side), so another algorithm's figure can be derived. An all-to-all that prints as a tuple of
pieces (one per peer) counts every piece; a variadic (combined) collective counts every operand.
Element sizes are the HLO types' bit widths (``s4`` is half a byte; JAX hands XLA a ``jnp.int4``
gather as ``s8``, so 4-bit codes must be packed by hand to travel as 4 bits).
Send/recv pairs are not read (the layouts never emit them).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import re
import tempfile
from typing import Any, Iterable

#: Bits per element of the HLO element types a collective can carry.
BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
        "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
        "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e4m3": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
        "f8e4m3b11fnuz": 8, "f8e3m4": 8, "token": 0}
#: The collective kinds, in the order tables print them.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
#: Factor of ``buffer_bytes * (n - 1) / n`` that one device sends (collective-permute: see _sent).
_RING = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1}
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in ("all-gather", "all-reduce", "collective-permute")}
# Attributes that name computations an instruction runs; the -done / -update halves of an async
# pair name the same computation as their start and run nothing more.
_CALLS = ("body", "condition", "to_apply", "calls", "branch_computations", "true_computation",
          "false_computation", "called_computations")
_NO_CALL = ("async-update", "async-done")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+) = (.*?) ([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program, and how often a step runs it.

    Attributes:
      kind: one of :data:`KINDS` (an asynchronous ``-start`` form is counted as its kind).
      dtype: the HLO element type it moves (``bf16``, ``f32``, ``s8`` ...).
      buffer_bytes: ``B``, the full-size buffer on one device (module docstring): the gathered
        output, the reduce-scatter input, the all-reduce buffer, every all-to-all piece together.
      group: ``n``, the devices of each replica group.
      count: how many times one step runs it (a ``while`` body's trip count, else 1).
      name: the HLO instruction's name.
      in_branch: it sits in a ``conditional`` branch (counted as if it ran).
      frames: the Python stack that emitted it, innermost first, as ``"path:function"`` (from the
        module's stack frames; empty where the program has none).
    """

    kind: str
    dtype: str
    buffer_bytes: float
    group: int
    count: int = 1
    name: str = ""
    in_branch: bool = False
    frames: tuple[str, ...] = ()

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step (the ring algorithms of the module docstring)."""
        return self.count * _sent(self.kind, self.buffer_bytes, self.group)


def _sent(kind: str, buffer_bytes: float, n: int) -> float:
    if kind == "collective-permute":
        return buffer_bytes
    return _RING[kind] * buffer_bytes * (n - 1) / n


def _bytes(dtype: str, dims: str) -> float:
    if dtype not in BITS:
        raise ValueError(f"unknown HLO element type {dtype!r}: add its bit width to BITS")
    return math.prod(int(x) for x in dims.split(",") if x) * BITS[dtype] / 8


def _matching(text: str, start: int) -> int:
    """The index of the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]}")


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: str
    attrs: str

    def attr(self, key: str) -> str | None:
        """The value of attribute ``key`` (a braced value whole), quoted strings (metadata) left out."""
        plain = re.sub(r'"(?:[^"\\]|\\.)*"', '""', self.attrs)
        m = re.search(rf"(?:^|[\s,]){key}=", plain)
        if m is None:
            return None
        start = m.end()
        if plain[start:start + 1] != "{":
            # An iota list of groups ([2,4]<=[4,2]T(1,0)) holds commas; anything else ends at one.
            return re.match(r"\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?|[^,\s]*", plain[start:]).group(0)  # type: ignore[union-attr]
        depth = 0
        for i in range(start, len(plain)):
            depth += {"{": 1, "}": -1}.get(plain[i], 0)
            if depth == 0:
                return plain[start:i + 1]
        return plain[start:]

    def refs(self) -> list[str]:
        """The operands' instruction names."""
        if "%" in self.operands:
            return re.findall(r"%([\w.\-]+)", self.operands)
        return [t.split()[-1] for t in re.split(r",\s*(?![^\[{]*[\]}])", self.operands) if t.strip()]


def _parse(text: str) -> tuple[dict[str, dict[str, _Instr]], dict[str, str], str, int | None]:
    """Computations (name -> instruction name -> instruction), each one's ROOT, the entry's name,
    and the module's ``num_partitions`` (None where the header lacks it)."""
    comps: dict[str, dict[str, _Instr]] = {}
    roots: dict[str, str] = {}
    entry, current = "", None
    m = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
    partitions = int(m.group(1)) if m else None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line) if line.rstrip().endswith("{") and not line[:1].isspace() else None
            if header:
                current = header.group(1)
                comps[current] = {}
                entry = current if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        open_at = m.end() - 1
        close = _matching(line, open_at)
        ins = _Instr(m.group(1), m.group(2), m.group(3), line[open_at + 1:close], line[close + 1:])
        comps[current][ins.name] = ins
        if line.lstrip().startswith("ROOT "):
            roots[current] = ins.name
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, roots, entry, partitions


def _stack_frames(text: str) -> dict[int, tuple[str, ...]]:
    """Stack frame id -> ``("path:function", ...)`` innermost first, from the module's tables.

    A frame prints its parent as the parent's id + 1 (0: none), so frame k's parent is p - 1.
    """
    def table(name: str, end: str) -> str:
        m = re.search(rf"^{name}\n(.*?)(?=^{end}\n|\Z)", text, re.M | re.S)
        return m.group(1) if m else ""

    files = dict(re.findall(r'^(\d+) "(.*)"$', table("FileNames", "FunctionNames"), re.M))
    functions = dict(re.findall(r'^(\d+) "(.*)"$', table("FunctionNames", "FileLocations"), re.M))
    locations = {k: f"{files.get(f, '?')}:{functions.get(g, '?')}" for k, f, g in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", table("FileLocations", "StackFrames"), re.M)}
    parents = {int(k): (loc, int(p) - 1) for k, loc, p in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", table("StackFrames", "%|ENTRY"), re.M)}
    out: dict[int, tuple[str, ...]] = {}
    for frame in parents:
        chain, k = [], frame
        while k in parents and len(chain) < 256:
            loc, k = parents[k]
            chain.append(locations.get(loc, "?"))
        out[frame] = tuple(chain)
    return out


def _group_size(ins: _Instr, devices: int | None) -> int:
    # The three spellings of replica groups: a mesh's axes (mesh['a'=1,'b'=8] {'b'}: the product of
    # the named axes), an iota list ([2,4]<=[8]: groups of 4) and explicit groups ({{0,1},{2,3}}).
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attrs)
    if mesh:
        sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2)))
    groups = ins.attr("replica_groups")
    if groups is not None:
        iota = re.match(r"\[(\d+),(\d+)\]<=", groups)
        if iota:
            return int(iota.group(2))
        first = re.match(r"\{\{([0-9,]*)\}", groups)
        if first and first.group(1):
            return len(first.group(1).split(","))
    # No groups ({}): every device of the program.
    if devices is None:
        raise ValueError(f"{ins.name}: replica_groups {groups!r} name no group and the module no num_partitions; "
                         "pass devices=")
    return devices


def _collectives_of(ins: _Instr, devices: int | None) -> list[Collective]:
    """The collective ``ins`` is, one entry per dtype it moves (none when it is not a collective)."""
    kind = _OPCODES.get(ins.opcode)
    if kind is None:
        return []
    shapes = _SHAPE.findall(ins.type)
    if ins.opcode == "all-gather-start":  # (operands..., outputs...): the gathered outputs
        shapes = shapes[len(shapes) // 2:]
    elif ins.opcode == "collective-permute-start":  # (operand, output, context...): the operand
        shapes = shapes[:1]
    if kind == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attr("source_target_pairs") or "")
        sends = any(a != b for a, b in pairs)
        n, scale = 1, 1 if sends else 0
    else:
        n = _group_size(ins, devices)
        scale = n if kind == "reduce-scatter" else 1  # reduce-scatter: the input is n x the output
    per_dtype: dict[str, float] = {}
    for dtype, dims in shapes:
        per_dtype[dtype] = per_dtype.get(dtype, 0.0) + _bytes(dtype, dims) * scale
    return [Collective(kind, dtype, b, n, name=ins.name) for dtype, b in per_dtype.items()]


def _const(comp: dict[str, _Instr], name: str) -> int | None:
    """The integer a scalar constant (through copies and converts) holds, or None."""
    for _ in range(8):
        ins = comp.get(name)
        if ins is None:
            return None
        if ins.opcode == "constant":
            try:
                return int(ins.operands.strip())
            except ValueError:
                return None
        if ins.opcode not in ("copy", "convert", "bitcast", "reshape") or not ins.refs():
            return None
        name = ins.refs()[0]
    return None


def _tuple_index(comp: dict[str, _Instr], name: str) -> int | None:
    ins = comp.get(name)
    if ins is None or ins.opcode != "get-tuple-element":
        return None
    index = ins.attr("index")
    return int(index) if index is not None else None


def _trip_count(ins: _Instr, caller: dict[str, _Instr], comps: dict, roots: dict) -> int | None:
    """A while loop's trip count: XLA's ``known_trip_count``, else its counter ``i < n, i += step``."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    if known:
        return int(known.group(1))
    cond_name, body_name = ins.attr("condition"), ins.attr("body")
    if cond_name is None or body_name is None:
        return None
    cond, body = comps.get(cond_name.lstrip("%"), {}), comps.get(body_name.lstrip("%"), {})
    root = cond.get(roots.get(cond_name.lstrip("%"), ""))
    if root is None or root.opcode != "compare" or root.attr("direction") not in ("LT", "GT") or len(root.refs()) != 2:
        return None
    counter, limit = root.refs()
    if root.attr("direction") == "GT":  # n > i
        counter, limit = limit, counter
    k, n = _tuple_index(cond, counter), _const(cond, limit)
    init = caller.get(ins.refs()[0]) if ins.refs() else None
    if k is None or n is None or init is None or init.opcode != "tuple" or len(init.refs()) <= k:
        return None
    start = _const(caller, init.refs()[k])
    body_root = body.get(roots.get(body_name.lstrip("%"), ""))
    if start is None or body_root is None or body_root.opcode != "tuple" or len(body_root.refs()) <= k:
        return None
    update = body.get(body_root.refs()[k])
    if update is None or update.opcode != "add" or len(update.refs()) != 2:
        return None
    a, b = update.refs()
    step = _const(body, b) if _tuple_index(body, a) == k else _const(body, a) if _tuple_index(body, b) == k else None
    if not step or step <= 0:
        return None
    return max(0, -(-(n - start) // step))


def collectives(text: str, devices: int | None = None) -> list[Collective]:
    """Every collective a step of the program runs, each with its per-step ``count``.

    Args:
      text: an HLO module's text (:func:`program_text`'s).
      devices: the group size of a collective with empty ``replica_groups`` (default: the
        module's ``num_partitions``).

    Returns:
      One :class:`Collective` per instruction, in program order of each computation.

    Raises:
      ValueError: a collective in a loop whose trip count cannot be read, an unknown element type,
        or text without an ENTRY computation.

    >>> from benchmarks._wire_bytes import collectives
    >>> hlo = '''HloModule m, num_partitions=8
    ... ENTRY %main (p: bf16[16,4]) -> bf16[128,4] {
    ...   %p = bf16[16,4]{1,0} parameter(0)
    ...   ROOT %g = bf16[128,4]{1,0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
    ... }'''
    >>> (c,) = collectives(hlo)
    >>> c.kind, c.dtype, c.buffer_bytes, c.wire_bytes
    ('all-gather', 'bf16', 1024.0, 896.0)
    """
    comps, roots, entry, partitions = _parse(text)
    devices = partitions if devices is None else devices
    stacks = _stack_frames(text)
    memo: dict[str, list[tuple[Collective, int | None, bool]]] = {}

    def walk(name: str, stack: tuple = ()) -> list[tuple[Collective, int | None, bool]]:
        # (collective, runs per call of `name` (None: unknown), in a branch); memoized: a reducer
        # or a wrapped computation referenced from many places is read once.
        if name in memo:
            return memo[name]
        if name in stack:
            raise ValueError(f"recursive HLO computation {name!r}")
        comp, out = comps.get(name, {}), []
        for ins in comp.values():
            out.extend((c, 1, False) for c in _collectives_of(ins, devices))
            if ins.opcode in _NO_CALL:
                continue
            for key in _CALLS:
                value = ins.attr(key)
                if value is None:
                    continue
                trips: int | None = 1
                if ins.opcode == "while" and key in ("body", "condition"):
                    trips = _trip_count(ins, comp, comps, roots)
                branch = ins.opcode == "conditional"
                for callee in re.findall(r"%?([^\s{},%]+)", value):
                    for cc, k, b in walk(callee, stack + (name,)):
                        out.append((cc, None if k is None or trips is None else k * trips, b or branch))
        memo[name] = out
        return out

    comps_attrs = {ins.name: ins.attrs for comp in comps.values() for ins in comp.values()}
    result = []
    for c, k, branch in walk(entry):
        if k is None:
            raise ValueError(f"collective {c.name} ({c.kind} {c.dtype}) runs in a while loop whose trip count "
                             "is neither XLA's known_trip_count nor a counter i < n the reader can follow")
        frame = re.search(r"stack_frame_id=(\d+)", comps_attrs.get(c.name, ""))
        result.append(dataclasses.replace(c, count=k, in_branch=branch,
                                          frames=stacks.get(int(frame.group(1)), ()) if frame else ()))
    return result


def program_text(lowered: Any) -> str:
    """The partitioned program whose collectives a step runs, as HLO text.

    On the CPU, the program just before ``all-reduce-promotion`` (compiled with
    ``xla_dump_hlo_pass_re``), whose bf16 collectives are still bf16 (that pass widens bf16
    reductions, ``float-normalization-bf16`` after it bf16 gathers); on other platforms the
    compiled program.

    Args:
      lowered: a ``jax.stages.Lowered`` (``jax.jit(f).lower(...)``, ``step.lower(...)``).

    Returns:
      The HLO module's text.

    >>> import jax, jax.numpy as jnp
    >>> from benchmarks._wire_bytes import program_text
    >>> "HloModule" in program_text(jax.jit(jnp.sin).lower(jnp.zeros(4)))
    True
    """
    import jax

    if jax.devices()[0].platform != "cpu":
        return lowered.compile().as_text()
    with tempfile.TemporaryDirectory() as d:
        # Backend optimization level 0: LLVM's code generation, after the program read here, then
        # takes half the compile time (the HLO passes before it are the same).
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_pass_re": "all-reduce-promotion",
                                          "xla_backend_optimization_level": 0})
        paths = sorted(glob.glob(d + "/*before_all-reduce-promotion.txt"))
        if not paths:
            raise ValueError("XLA:CPU dumped no program before all-reduce-promotion: did it rename the pass?")
        with open(paths[0]) as f:
            return f.read()


def _as_collectives(program: Any) -> list[Collective]:
    if isinstance(program, str):
        return collectives(program)
    if isinstance(program, list):
        return program
    return collectives(program_text(program))


def summarize(program: Any) -> dict:
    """Wire and buffer bytes per step per device, by collective kind and dtype.

    Args:
      program: a ``jax.stages.Lowered``, an HLO text, or :func:`collectives`' list.

    Returns:
      ``{"wire_bytes": total, "buffer_bytes": total, "by_kind": {kind: {dtype: {"wire_bytes",
      "buffer_bytes", "ops"}}}, "in_branch": bool}`` (``ops``: executions per step).

    >>> import jax, jax.numpy as jnp
    >>> from benchmarks._wire_bytes import summarize
    >>> summarize(jax.jit(jnp.sin).lower(jnp.zeros(4)))["wire_bytes"]
    0.0
    """
    found = _as_collectives(program)
    by_kind: dict[str, dict[str, dict[str, float]]] = {}
    for c in found:
        entry = by_kind.setdefault(c.kind, {}).setdefault(c.dtype, {"wire_bytes": 0.0, "buffer_bytes": 0.0, "ops": 0})
        entry["wire_bytes"] += c.wire_bytes
        entry["buffer_bytes"] += c.count * c.buffer_bytes
        entry["ops"] += c.count
    return {"wire_bytes": float(sum(c.wire_bytes for c in found)),
            "buffer_bytes": float(sum(c.count * c.buffer_bytes for c in found)),
            "by_kind": {k: by_kind[k] for k in KINDS if k in by_kind},
            "in_branch": any(c.in_branch for c in found)}


def kind_bytes(summary: dict, kinds: Iterable[str], key: str = "wire_bytes") -> float:
    """The ``key`` bytes of ``summary`` (:func:`summarize`'s) over the collective ``kinds``."""
    return float(sum(v[key] for k in kinds for v in summary["by_kind"].get(k, {}).values()))


def gathers(lowered: Any) -> collections.Counter:
    """Elements all-gathered per step, per dtype (each gather's output), in the program before
    XLA:CPU widens bf16 collectives (:func:`program_text`).

    Args:
      lowered: a ``jax.stages.Lowered``, or the program's HLO text.

    Returns:
      ``Counter({"bf16": elements, "f32": elements, ...})``.
    """
    counts: collections.Counter = collections.Counter()
    for c in _as_collectives(lowered):
        if c.kind == "all-gather":
            counts[c.dtype] += int(c.count * c.buffer_bytes * 8 // BITS[c.dtype])
    return counts

"""benchmarks/_wire_bytes.py: the collectives of a partitioned program, counted in bytes per step per device.

A hand-written ``shard_map`` with one collective of each kind, of known shapes and dtypes, on the 8
simulated CPU devices: every byte count is exact. The bf16 collectives are read before XLA:CPU
widens them to float32 (a bf16 gather and a bf16 reduce-scatter count 2 bytes an element), a
collective in a ``lax.scan`` body counts once per trip, and the text-only cases (async forms, all
three spellings of replica groups, a loop whose trip count is unknown) need no compile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import _wire_bytes as wb

N = 8


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _lower(mesh, f, *shapes, out_specs):
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec)) for s, d, spec in shapes]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=tuple(spec for _, _, spec in shapes), out_specs=out_specs,
                              check_vma=False))
    return g.lower(*args)


@pytest.fixture(scope="module")
def five_kinds(mesh):
    """One collective of each kind; shapes are per device inside the shard_map."""
    def f(a, b, c, d, e):
        return (lax.all_gather(a, "d", tiled=True),                              # bf16 [16,4] -> [128,4]
                lax.psum_scatter(b, "d", scatter_dimension=0, tiled=True),       # bf16 [64,8] -> [8,8]
                lax.psum(c, "d"),                                                # f32 [32]
                lax.all_to_all(d, "d", 0, 0, tiled=True),                        # s8 [64,2], 8 pieces
                lax.ppermute(e, "d", [(i, (i + 1) % N) for i in range(N)]))      # f16 [10]
    lowered = _lower(mesh, f, ((128, 4), jnp.bfloat16, P("d")), ((512, 8), jnp.bfloat16, P("d")),
                     ((256,), jnp.float32, P("d")), ((512, 2), jnp.int8, P("d")), ((80,), jnp.float16, P("d")),
                     out_specs=(P("d"),) * 5)
    return wb.program_text(lowered)


def test_each_collective_kind_moves_its_ring_bytes_exactly(five_kinds):
    found = {c.kind: c for c in wb.collectives(five_kinds)}
    assert set(found) == set(wb.KINDS)
    expect = {  # kind: (dtype, B = full-size buffer per device, bytes sent per device)
        "all-gather": ("bf16", 128 * 4 * 2, 128 * 4 * 2 * 7 / 8),
        "reduce-scatter": ("bf16", 64 * 8 * 2, 64 * 8 * 2 * 7 / 8),
        "all-reduce": ("f32", 32 * 4, 2 * 32 * 4 * 7 / 8),
        "all-to-all": ("s8", 64 * 2, 64 * 2 * 7 / 8),   # eight [8,2] pieces, one kept
        "collective-permute": ("f16", 10 * 2, 10 * 2),
    }
    for kind, (dtype, buffer_bytes, wire) in expect.items():
        c = found[kind]
        assert (c.dtype, c.buffer_bytes, c.wire_bytes, c.count) == (dtype, buffer_bytes, wire, 1), c
        assert c.group == (1 if kind == "collective-permute" else N)
    s = wb.summarize(five_kinds)
    assert s["wire_bytes"] == sum(w for _, _, w in expect.values()) == 2148.0
    assert s["buffer_bytes"] == sum(b for _, b, _ in expect.values())
    assert wb.kind_bytes(s, ["all-gather"]) == 896.0


def test_bf16_collectives_are_counted_before_xla_cpu_widens_them(mesh, five_kinds):
    # The final CPU program gathers and reduce-scatters float32: read there, the bf16 ones would
    # count twice their bytes.
    def f(a, b):
        return lax.all_gather(a, "d", tiled=True), lax.psum_scatter(b, "d", scatter_dimension=0, tiled=True)
    lowered = _lower(mesh, f, ((128, 4), jnp.bfloat16, P("d")), ((512, 8), jnp.bfloat16, P("d")),
                     out_specs=(P("d"), P("d")))
    final = wb.summarize(lowered.compile().as_text())["by_kind"]
    assert set(final["all-gather"]) == set(final["reduce-scatter"]) == {"f32"}, final
    ours = wb.summarize(wb.program_text(lowered))["by_kind"]
    assert set(ours["all-gather"]) == set(ours["reduce-scatter"]) == {"bf16"}, ours
    assert final["all-gather"]["f32"]["wire_bytes"] == 2 * ours["all-gather"]["bf16"]["wire_bytes"]
    assert wb.gathers(wb.program_text(lowered)) == {"bf16": 128 * 4}


def test_a_gather_in_a_scan_body_counts_once_per_layer(mesh):
    def f(x, w):
        def body(h, wi):
            return jnp.tanh(h @ lax.all_gather(wi, "d", tiled=True).astype(jnp.float32)), None
        return lax.scan(body, x, w)[0]
    lowered = _lower(mesh, f, ((4, 64), jnp.float32, P()), ((3, 64, 64), jnp.bfloat16, P(None, "d")), out_specs=P())
    (c,) = wb.collectives(wb.program_text(lowered))
    assert (c.kind, c.dtype, c.count, c.buffer_bytes) == ("all-gather", "bf16", 3, 64 * 64 * 2)
    assert c.wire_bytes == 3 * 64 * 64 * 2 * 7 / 8


_ASYNC = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (x: bf16[16,4], y: f32[64], z: f32[8]) -> f32[8] {
  %x = bf16[16,4]{1,0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %z = f32[8]{0} parameter(2)
  %ags = (bf16[16,4]{1,0}, bf16[128,4]{1,0}) all-gather-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = bf16[128,4]{1,0} all-gather-done(%ags)
  %rss = ((f32[64]{0}), f32[16]{0}) async-start(%y), calls=%wrapped
  %rsd = f32[16]{0} async-done(%rss), calls=%wrapped
  %ars = f32[8]{0} all-reduce-start(%z), replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%ard), source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[8]{0} collective-permute-done(%cps)
}
"""


def test_async_forms_and_group_spellings_from_text():
    found = {c.kind: c for c in wb.collectives(_ASYNC)}
    assert set(found) == set(wb.KINDS) - {"all-to-all"}
    # all-gather-start: the gathered half of its (operand, output) tuple.
    assert (found["all-gather"].buffer_bytes, found["all-gather"].group) == (1024, 8)
    # A reduce-scatter wrapped in async-start counts once (async-done names the same computation),
    # in groups of 4 (iota [2,4]<=[8]): its input is 4 x its f32[16] output.
    assert (found["reduce-scatter"].buffer_bytes, found["reduce-scatter"].group, found["reduce-scatter"].count) \
        == (4 * 16 * 4, 4, 1)
    assert found["reduce-scatter"].wire_bytes == 256 * 3 / 4
    # mesh['a'=2,'b'=4] {'b'}: groups of 4.
    assert (found["all-reduce"].group, found["all-reduce"].wire_bytes) == (4, 2 * 32 * 3 / 4)
    assert (found["collective-permute"].buffer_bytes, found["collective-permute"].wire_bytes) == (32, 32)


def test_a_collective_in_a_loop_of_unknown_trip_count_is_refused():
    text = """HloModule m, num_partitions=8

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %t = pred[] custom-call(%p), custom_call_target="stop"
}

%body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %v = f32[8]{0} get-tuple-element(%q), index=1
  %g = f32[64]{0} all-gather(%v), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %s = f32[8]{0} slice(%g), slice={[0:8]}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %s)
}

ENTRY %main (x: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = (s32[], f32[8]{0}) parameter(0)
  ROOT %w = (s32[], f32[8]{0}) while(%x), condition=%cond, body=%body
}
"""
    with pytest.raises(ValueError, match="trip count"):
        wb.collectives(text)
    known = text.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}')
    (c,) = wb.collectives(known)
    assert (c.count, c.wire_bytes) == (5, 5 * 256 * 7 / 8)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="ENTRY"):
        wb.collectives("HloModule m\n")
    with pytest.raises(ValueError, match="element type 'q9'"):
        wb.collectives(_ASYNC.replace("f32[8]{0} all-reduce-start", "q9[8]{0} all-reduce-start"))


# ----------------------------------------------------------------------------------------------
# benchmarks/wire.py --quick: a tiny model, one depth, the ZeRO rows and the hand-written reference.


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run (nine compiles of a tiny model: the hand-written ZeRO, jaxmp's ZeRO with each
    gather and reduction option)."""
    import json

    from benchmarks import wire

    out = tmp_path_factory.mktemp("wire") / "wire.json"
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: Python float ** int32 count
        result = wire.main(["--quick", "--quiet", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "wire"
    return result


def _row(result, who, gather, reduce, layout="zero"):
    (r,) = [r for r in result["results"]["rows"]
            if (r["who"], r["layout"], r["gather"], r["reduce"]) == (who, layout, gather, reduce)]
    return r


def test_wire_quick_gathers_half_the_bytes_of_float32_masters_and_reduces_in_the_reduce_dtype(quick):
    from benchmarks import _common as common, wire

    assert common.validate_result(quick) == []
    have = wire.step_options()
    for r in quick["results"]["rows"]:
        missing = set(r["options"]) - have
        assert (r["status"] == wire.NOT_AVAILABLE) == bool(missing), r  # never a faked row
    hand = _row(quick, "hand", "f32 masters", "bf16 (XLA)")
    f32, bf16 = _row(quick, "jaxmp", "bf16", "float32"), _row(quick, "jaxmp", "bf16", "bf16")
    # The hand-written step gathers each float32 master; jaxmp gathers the bf16 params: half the bytes.
    assert 0.45 <= f32["gather_wire_bytes"] / hand["gather_wire_bytes"] <= 0.55, (f32, hand)
    assert set(hand["by_kind"]) >= {"all-gather f32"} and "all-gather f32" not in f32["by_kind"]
    # The reduction's bytes follow the reduce dtype; the gathers do not change.
    assert f32["gather_wire_bytes"] == bf16["gather_wire_bytes"] > 0
    assert 0.45 <= bf16["reduce_wire_bytes"] / f32["reduce_wire_bytes"] <= 0.55, (bf16, f32)
    assert "reduce-scatter f32" in f32["by_kind"] and "reduce-scatter bf16" in bf16["by_kind"]
    assert f32["vs_reference"] == 1.0 and bf16["vs_reference"] > 1.3


def test_wire_quick_holds_each_wire_option_to_its_byte_count(quick):
    """Each quantized option against the bf16-gather, float32-reduce ZeRO row, to the byte: the tiny
    model's pieces are whole blocks of 256, so codes are 1 byte (8-bit) or half a byte (4-bit) an
    element and each block of 256 adds one float32 scale; the small replicated leaves' float32
    all-reduce stays as it is (none of them reaches 8 x 256 elements)."""
    base = _row(quick, "jaxmp", "bf16", "float32")
    gather = base["by_kind"]["all-gather bf16"]["wire_bytes"]       # 2 bytes an element
    reduce = base["by_kind"]["reduce-scatter f32"]["wire_bytes"]    # 4 bytes an element
    rest = base["reduce_wire_bytes"] - reduce                       # the small leaves' all-reduces, the skip flag
    for gbits in (None, 8):
        for rbits in (None, 8, 4):
            r = _row(quick, "jaxmp", "bf16" if gbits is None else "8-bit", "float32" if rbits is None else f"{rbits}-bit")
            assert r["status"] == "measured", r
            kinds = {k: v["wire_bytes"] for k, v in r["by_kind"].items()}
            want_g = gather if gbits is None else gather / 2 + gather / 2 / 256 * 4
            want_r = reduce if rbits is None else reduce * rbits / 32 + reduce / 4 / 256 * 4
            assert r["gather_wire_bytes"] == want_g and r["reduce_wire_bytes"] == want_r + rest, (gbits, rbits, kinds)
            if gbits:  # codes and scales gathered, no bf16 weight gather left
                assert (kinds["all-gather u8"], kinds["all-gather f32"]) == (gather / 2, gather / 128)
                assert "all-gather bf16" not in kinds
            if rbits:  # codes and scales exchanged by all-to-all, no reduce-scatter left
                assert (kinds["all-to-all u8"], kinds["all-to-all f32"]) == (reduce * rbits / 32, reduce / 256)
                assert not any(k.startswith("reduce-scatter") for k in kinds)
    best = _row(quick, "jaxmp", "8-bit", "4-bit")
    assert best["vs_reference"] == max(r.get("vs_reference", 0) for r in quick["results"]["rows"]) > 3.5


@pytest.fixture(scope="module")
def quick_fsdp(tmp_path_factory):
    """``--quick --layouts fsdp --layers 2``: the tiny model's FSDP rows (``scan_layers`` over two
    layers; nine compiles)."""
    from benchmarks import wire

    out = tmp_path_factory.mktemp("wire_fsdp") / "wire.json"
    with jax.numpy_dtype_promotion("standard"):
        return wire.main(["--quick", "--quiet", "--layouts", "fsdp", "--layers", "2", "--out", str(out)])


def _sharded_elements(layers):
    """Elements of the tiny model's params that FSDP splits over the 8 devices: (per layer, non-layer)."""
    import jaxmp
    from benchmarks import _gpt2, wire

    params = _gpt2.abstract_params(wire._shape(True, layers), True)
    p, _ = jaxmp.parallel.abstract_state((params, {}), jaxmp.parallel.make_data_mesh(jax.devices()[:N]), "fsdp")
    split = lambda x: any(a is not None for a in x.sharding.spec)  # noqa: E731
    per_layer = sum(x.size for x in jax.tree_util.tree_leaves(p["layers"]) if split(x)) // layers
    rest = sum(x.size for k, v in p.items() if k != "layers" for x in jax.tree_util.tree_leaves(v) if split(x))
    return per_layer, rest


@pytest.mark.slow  # nine compiles with scan_layers: minutes on 2 cores
def test_wire_quick_fsdp_counts_the_backward_regather_and_holds_each_option_to_its_byte_count(quick_fsdp):
    """FSDP's rows to the byte. A scanned layer's slice is gathered twice a step (the forward, and the
    backward's re-gather: the gathered weights are not kept), in the scan's while loop once per trip,
    with bf16 and with 8-bit gathers alike; the embeddings, gathered where the loss starts, once. Each
    gradient is reduce-scattered once. Before the backward re-gathered 8-bit codes (it kept the
    dequantized weights), the 8-bit rows counted one gather a layer, and this test failed."""
    layers = 2
    layer, rest = _sharded_elements(layers)
    assert layer > 0 and rest > 0
    ring = (N - 1) / N
    base = _row(quick_fsdp, "jaxmp", "bf16", "float32", layout="fsdp")
    assert base["status"] == "measured" and base["layers_compiled"] == [layers]
    # bf16 gathers: 2 bytes an element, twice a layer and once for the rest; each float32
    # reduce-scatter once.
    assert base["by_kind"]["all-gather bf16"]["wire_bytes"] == (2 * layers * layer + rest) * 2 * ring
    assert base["by_kind"]["reduce-scatter f32"]["wire_bytes"] == (layers * layer + rest) * 4 * ring
    gather = base["by_kind"]["all-gather bf16"]["wire_bytes"]
    reduce = base["by_kind"]["reduce-scatter f32"]["wire_bytes"]
    for gbits in (None, 8):
        for rbits in (None, 8, 4):
            r = _row(quick_fsdp, "jaxmp", "bf16" if gbits is None else "8-bit",
                     "float32" if rbits is None else f"{rbits}-bit", layout="fsdp")
            kinds = {k: v["wire_bytes"] for k, v in r["by_kind"].items()}
            if gbits:  # the same gathers as codes (1 byte) and a float32 scale a block of 256
                assert (kinds["all-gather u8"], kinds["all-gather f32"]) == (gather / 2, gather / 128), kinds
                assert "all-gather bf16" not in kinds
            else:
                assert kinds["all-gather bf16"] == gather, kinds
            if rbits:
                assert (kinds["all-to-all u8"], kinds["all-to-all f32"]) == (reduce * rbits / 32, reduce / 256)
                assert not any(k.startswith("reduce-scatter") for k in kinds)
            else:
                assert kinds["reduce-scatter f32"] == reduce, kinds


def test_wire_prediction_is_labelled_and_scales_with_bytes_and_bandwidth(quick, capsys):
    from benchmarks import wire

    rows = quick["results"]["rows"]
    pred = wire.predict(rows, {"slow": 1e9, "fast": 4e9}, {"m": 1e9})
    by = {(p["reduce"], p["link"]): p for p in pred if p["who"] == "jaxmp" and p["gather"] == "bf16"}
    assert by["float32", "slow"]["seconds"] == pytest.approx(4 * by["float32", "fast"]["seconds"])
    f32 = _row(quick, "jaxmp", "bf16", "float32")
    assert by["float32", "slow"]["seconds"] == pytest.approx(f32["wire_bytes"] / f32["params"])
    assert by["float32", "slow"]["saved_seconds"] == 0 and by["bf16", "slow"]["saved_seconds"] > 0
    # The headline: the row with the fewest bytes (8-bit gathers, 4-bit reduction) against ZeRO bf16/f32.
    assert wire.headline(rows).startswith("headline: jaxmp zero gather=8-bit reduce=4-bit sends ")
    assert f"{max(r.get('vs_reference', 0) for r in rows):.2f}x fewer" in wire.headline(rows)
    text = wire.prediction_text(pred)
    assert text and all(line.startswith("predicted, not measured: ") for line in text.splitlines())


def test_docs_quote_the_committed_wire_table_and_its_figures():
    """docs/parallel.md's "Wire bytes" tables are what benchmarks/results/wire.json holds (no compile)."""
    import json
    from pathlib import Path

    from benchmarks import wire

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / "benchmarks" / "results" / "wire.json").read_text())
    text = (root / "docs" / "parallel.md").read_text()
    rows = result["results"]["rows"]
    assert not result["dry_run"] and not result["config"].get("partial")
    assert wire.markdown(rows) in text
    assert wire.prediction_markdown(result["results"]["prediction"]) in text
    f32, bf16 = _row(result, "jaxmp", "bf16", "float32"), _row(result, "jaxmp", "bf16", "bf16")
    # The figures the prose quotes.
    assert f32["layout"] == "zero" and f"{f32['wire_bytes'] / f32['params']:.2f} bytes a parameter" in text
    assert f"{bf16['wire_bytes'] / bf16['params']:.1f} bytes a parameter, {bf16['vs_reference']:.2f}x" in text
    assert f"{f32['params_per_layer'] / 1e6:.2f}M parameters a layer" in text


def test_wire_rows_this_build_lacks_or_refuses_say_so_without_a_figure(monkeypatch):
    from benchmarks import wire

    rows = [r for r in wire.plan(["zero"]) if r["who"] == "jaxmp"][:2]  # float32 and bf16 reduce
    monkeypatch.setattr(wire, "step_options", lambda: {"reduce_dtype"} - {"reduce_dtype"})
    out = wire.run(rows, quick=True, layers=(1,), log=lambda m: None)
    assert [r["status"] for r in out] == [wire.NOT_AVAILABLE] * 2
    assert out[0]["missing"] == ["reduce_dtype"] and "wire_bytes" not in out[0]

    def refuse(row, shape):
        raise ValueError("reduce_dtype='bfloat16' is not for this layout")

    monkeypatch.setattr(wire, "step_options", lambda: {"reduce_dtype"})
    monkeypatch.setattr(wire, "lower", refuse)
    out = wire.run(rows, quick=True, layers=(1,), log=lambda m: None)
    assert [r["status"] for r in out] == ["refused"] * 2
    assert out[1]["error"] == "ValueError: reduce_dtype='bfloat16' is not for this layout"
    md = wire.markdown(out + [{**rows[0], "status": wire.NOT_AVAILABLE}]).splitlines()
    assert "| not available in this build |" in md[-1] and "| refused |" in md[2]
    assert len(md) == 5 and all(line.count("|") == md[0].count("|") for line in md)


@pytest.mark.slow  # two models under two layouts, every option: about 40 s
def test_wire_fidelity_study_quick_trains_both_models_and_judges_each_option(tmp_path, capsys):
    """``wire_fidelity.py --study --quick``: the LM and the CNN under ZeRO and FSDP, two seeds, the unquantized
    run and both quantizers."""
    import json

    from benchmarks import _common as common, wire_fidelity

    out = tmp_path / "wire_fidelity.json"
    assert wire_fidelity.main(["--study", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert common.validate_result(result) == [] and result["dry_run"]
    models = result["results"]["models"]
    assert set(models) == {"lm zero", "cnn zero", "lm fsdp", "cnn fsdp"}  # both layouts by default
    for entry in models.values():
        ref, quant = entry["summary"]["unquantized"]["eval_loss"], entry["summary"]["gather 8 + reduce 4"]["eval_loss"]
        assert quant["tolerance"] == max(ref["spread"], 0.01 * abs(ref["mean"])) > 0
        assert quant["diff_from_reference"] == pytest.approx(quant["mean"] - ref["mean"])
        assert quant["within"] == (abs(quant["diff_from_reference"]) <= quant["tolerance"])
        assert all(r["skips"] == 0 and r["steps"] == 4 for rs in entry["runs"].values() for r in rs)
    printed = capsys.readouterr().out
    assert "| cnn | zero | gather 8 + reduce 4 |" in printed and "| lm | fsdp | gather 8 + reduce 4 |" in printed

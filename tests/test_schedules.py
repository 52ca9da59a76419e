"""Schedules as data: closed forms of the simulator, validation, plots."""

import pytest

from multimesh import schedules as S


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("costs", [(1.0, 1.0), (1.0, 2.0)])
def test_bubble_closed_form(name, stages, m, costs):
    tl = S.simulate(name, stages, m, forward_cost=costs[0], backward_cost=costs[1])
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))
    assert tl.makespan == pytest.approx((m + stages - 1) * sum(costs))


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 8), (4, 16)])
def test_peak_in_flight(stages, m):
    one = S.simulate("1f1b", stages, m)
    gpipe = S.simulate("gpipe", stages, m)
    assert one.peak_in_flight == [min(stages - s, m) for s in range(stages)]
    assert gpipe.peak_in_flight == [m] * stages


@pytest.mark.parametrize("chunks", [2, 4])
def test_interleaving_cuts_bubble_by_about_v(chunks):
    stages, m = 4, 8
    base = S.simulate("1f1b", stages, m).bubble_fraction
    tl = S.simulate(S.Interleaved1F1B(num_chunks=chunks), stages, m)
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (chunks * m + stages - 1))
    assert base / tl.bubble_fraction == pytest.approx(chunks, rel=0.25)


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (3, 33)])
def test_zero_bubble_h1_closed_form_at_1f1b_peak_memory(stages, m):
    """ZB-H1 (Qi et al. 2023) with F, B and W of equal cost: 3M + S - 1 units, a bubble
    of (S - 1) / (3M + S - 1) -- a third of 1F1B's -- while no submesh holds more
    microbatches than 1F1B's first (its peak). (W run right after its B, the first
    version, had 2(S - 1) idle units: two thirds of 1F1B's.)"""
    one = S.simulate("1f1b", stages, m, 1.0, 2.0)
    zb = S.simulate("zero-bubble-h1", stages, m, 1.0, 2.0)
    assert zb.makespan == pytest.approx(3 * m + stages - 1)
    assert zb.bubble_fraction == pytest.approx((stages - 1) / (3 * m + stages - 1))
    assert zb.bubble_fraction < one.bubble_fraction / 2
    assert max(zb.peak_in_flight) == max(one.peak_in_flight) == stages


@pytest.mark.parametrize("stages,m", [(2, 1), (4, 2), (8, 3)])
def test_zero_bubble_h1_below_1f1b_with_few_microbatches(stages, m):
    one = S.simulate("1f1b", stages, m, 1.0, 2.0)
    zb = S.simulate("zero-bubble-h1", stages, m, 1.0, 2.0)
    assert zb.bubble_fraction < one.bubble_fraction
    assert max(zb.peak_in_flight) <= max(one.peak_in_flight)


def test_orders_are_data_and_valid():
    for sched in [S.GPipe(), S.OneFOneB(), S.Interleaved1F1B(num_chunks=2), S.ZeroBubbleH1()]:
        chunks = sched.chunks(4)
        order = sched.build(4, 8, chunks)
        assert len(order) == 4
        per = (3 if sched.splits_backward else 2) * 8 * chunks
        assert all(len(row) == per for row in order)
        S.validate(order, 4, 8, chunks)
    assert str(S.OneFOneB().build(2, 2)[1][0]) == "F0@s1"


def test_named_schedules():
    assert isinstance(S.get("1f1b"), S.OneFOneB)
    assert isinstance(S.get("gpipe"), S.GPipe)
    assert isinstance(S.get("interleaved-1f1b"), S.Interleaved1F1B)
    assert isinstance(S.get("zero-bubble-h1"), S.ZeroBubbleH1)
    with pytest.raises(ValueError, match="unknown schedule"):
        S.get("nope")
    with pytest.raises(ValueError, match="divisible"):
        S.Interleaved1F1B(num_chunks=2).build(4, 6, 2)


def test_plot_and_trace(tmp_path):
    tl = S.simulate("zero-bubble-h1", 4, 8)
    tl.plot(str(tmp_path / "zb.png"))
    assert (tmp_path / "zb.png").stat().st_size > 1000
    trace = tl.to_chrome_trace(str(tmp_path / "zb.json"))
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 4 * 8 * 3


@pytest.mark.parametrize("bad", [(-1, 0, "F"), (0, -2, "F")])
def test_custom_rejects_negative_stages_and_microbatches(bad):
    with pytest.raises(ValueError, match="has a negative .* count from 0"):
        S.Custom([[bad]])


@pytest.mark.parametrize("bad", [(0.5, 0, "F"), ("0", 0, "F"), (0, 1.0, "F"), (True, 0, "F")])
def test_custom_rejects_non_integer_actions(bad):
    with pytest.raises(ValueError, match="is not an int"):
        S.Custom([[bad]])
    with pytest.raises(ValueError, match="is not an int"):
        S.validate([[bad, (0, 0, "B")]], 1, 1)


def test_custom_rejects_bad_phase_and_shape():
    with pytest.raises(ValueError, match="phase 'X'"):
        S.Custom([[(0, 0, "X")]])
    with pytest.raises(ValueError, match="not a .stage, microbatch, phase. triple"):
        S.Custom([[(0, 0)]])


def test_simulate_checks_its_arguments():
    import numpy as np

    with pytest.raises(ValueError, match="forward_cost must be finite and >= 0"):
        S.simulate("1f1b", 2, 4, forward_cost=-1)
    with pytest.raises(ValueError, match="backward_cost must be finite"):
        S.simulate("1f1b", 2, 4, backward_cost=float("nan"))
    with pytest.raises(ValueError, match="weight_cost applies to schedules that split"):
        S.simulate("1f1b", 2, 4, weight_cost=5)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        S.simulate("1f1b", 0, 4)
    a = S.simulate("1f1b", np.int64(2), np.int32(4))  # NumPy ints, as in Custom orders
    assert a.bubble_fraction == pytest.approx(S.simulate("1f1b", 2, 4).bubble_fraction)
    with pytest.raises(ValueError, match="num_chunks=3 but the schedule was made with"):
        S.simulate(S.Interleaved1F1B(num_chunks=2), 4, 8, num_chunks=3)


def test_plot_on_given_axes_saves_to_path(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    S.simulate("interleaved-1f1b", 2, 4, num_chunks=2).plot(str(tmp_path / "i.png"), ax=ax)
    plt.close(fig)
    assert (tmp_path / "i.png").stat().st_size > 1000


def test_interleaved_num_chunks_must_match_the_model():
    """num_chunks other than the model's stages per submesh was silently ignored (too
    many) or reported as needing an interleaved schedule (too few)."""
    import jax
    import jax.numpy as jnp

    import multimesh as mm

    ws = [jnp.eye(8) * 0.5 for _ in range(4)]
    x = jnp.ones((8, 8))

    def loss(ws, xb):
        h = xb
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    mmesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    for chunks, match in ((3, r"num_chunks=3, but .*\(2 per submesh\)"), (1, "as many chunks")):
        sched = S.Interleaved1F1B(num_chunks=chunks)
        step = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, schedule=sched)
        with pytest.raises(ValueError, match=match):
            mm.jit(step, mesh=mmesh)(ws, x)
    step = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, schedule=S.Interleaved1F1B(2))
    v, _g = mm.jit(step, mesh=mmesh)(ws, x)
    assert float(v) == pytest.approx(float(jax.jit(step)(ws, x)[0]))


def test_a_stuck_order_names_its_real_blocker():
    """A backward before its forward on submesh 2 was reported as a deadlock on submesh
    0 (the first stuck submesh scanned); a real cycle names every step in it."""
    good = S.OneFOneB().build(4, 4, 1)
    bad = [list(r) for r in good]
    i, j = bad[2].index(S.Action(2, 0, "F")), bad[2].index(S.Action(2, 0, "B"))
    bad[2][i], bad[2][j] = bad[2][j], bad[2][i]
    with pytest.raises(ValueError, match=r"submesh 2 \(B0@s2\).*needs F0@s2, which the same"):
        S.validate(bad, 4, 4)
    # a cycle: submesh 0 runs B0 before F1, submesh 1 wants F1 before B0
    cyc = [
        [(0, 0, "F"), (0, 0, "B"), (0, 1, "F"), (0, 1, "B")],
        [(1, 0, "F"), (1, 1, "F"), (1, 0, "B"), (1, 1, "B")],
    ]
    with pytest.raises(
        ValueError, match=r"deadlock: .*\(B0@s0\) needs B0@s1.*\(F1@s1\) needs F1@s0"
    ):
        S.validate(cyc, 2, 2)


def test_an_order_for_other_stage_or_microbatch_counts_says_so():
    """An order made for more stages (or microbatches) than the loop has: the error says
    which count it names (it said "F0@s2 does not belong there (stage 2 runs on submesh
    0 ...)" for an action placed on submesh 0)."""
    order = S.Interleaved1F1B().order(2, 4, 2)  # 4 virtual stages, 4 microbatches
    with pytest.raises(ValueError, match=r"F0@s2 names stage 2, but the loop has 2 stages"):
        S.validate(order, 2, 4)
    with pytest.raises(ValueError, match=r"F2@s0 names microbatch 2, but the loop has 2"):
        S.validate(S.OneFOneB().build(2, 4, 1), 2, 2)


@pytest.mark.parametrize("stages,m", [(2, 3), (4, 6), (4, 16)])
def test_interleaving_with_one_chunk_is_1f1b(stages, m):
    """One stage per submesh: interleaved 1F1B's warm-up held twice 1F1B's activations
    (peak [7, 5, 3, 1] for 4 stages) for the same makespan, and needed M divisible by S."""
    one = S.OneFOneB().build(stages, m)
    assert S.Interleaved1F1B().build(stages, m, 1) == one
    assert S.Interleaved1F1B(num_chunks=1).build(stages, m, 1) == one
    tl = S.simulate(S.Interleaved1F1B(num_chunks=1), stages, m)
    assert tl.peak_in_flight == S.simulate("1f1b", stages, m).peak_in_flight


@pytest.mark.parametrize("chunks", [2, 4])
def test_gpipe_with_chunks_runs_chunk_by_chunk(chunks):
    """Every microbatch through a submesh's first stage before any goes through its next:
    with chunks GPipe's bubble shrinks (it was nearly serial, microbatch by microbatch)."""
    stages, m = 4, 8
    row = S.GPipe().build(stages, m, chunks)[0]
    assert [(a.stage, a.microbatch) for a in row[:m]] == [(0, k) for k in range(m)]
    assert row[m] == S.Action(stages, 0, "F")
    base = S.simulate("gpipe", stages, m)
    tl = S.simulate("gpipe", stages, m, num_chunks=chunks)
    assert tl.makespan < base.makespan
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (chunks * m + stages - 1))


def test_peak_in_flight_with_zero_costs():
    """Every action at time 0: counted in each submesh's order (was [0, 0, 0, 0])."""
    for name, want in [("gpipe", [8] * 4), ("1f1b", [4, 3, 2, 1])]:
        tl = S.simulate(name, 4, 8, forward_cost=0, backward_cost=0)
        assert tl.peak_in_flight == want


def test_forward_only_orders():
    """A loop without a backward takes an order of F steps only (or a full order's F
    steps); a training loop still needs every B."""
    only_f = S.Custom([[(0, 0, "F"), (0, 1, "F")], [(1, 0, "F"), (1, 1, "F")]])
    assert only_f.build(2, 2, backward=False) == [
        [S.Action(0, 0, "F"), S.Action(0, 1, "F")],
        [S.Action(1, 0, "F"), S.Action(1, 1, "F")],
    ]
    assert S.OneFOneB().build(2, 2, backward=False) == S.GPipe().build(2, 2, backward=False)
    with pytest.raises(ValueError, match=r"submesh 0 is missing 2 action\(s\), e\.g\. B0@s0"):
        only_f.build(2, 2)
    with pytest.raises(ValueError, match="appears twice"):
        S.Custom([[(0, 0, "F"), (0, 0, "F")], [(1, 0, "F"), (1, 1, "F")]]).build(
            2, 2, backward=False
        )

"""The GPT examples (NNX and Linen) trained with PP x DP x TP equal the jax.jit reference."""

import jax
import optax
import pytest
from conftest import assert_close, stage_of
from flax import nnx

import multimesh as mm
from multimesh.examples import gpt


def run(step, state, mmesh, tokens, steps):
    mstep = mm.jit(step, mesh=mmesh)
    jstep = jax.jit(step)
    ms, rs, losses = state, state, []
    for _ in range(steps):
        ms, ml = mstep(ms, tokens)
        with mmesh:
            rs, rl = jstep(rs, tokens)
        assert_close(ml, rl, rtol=2e-5, atol=1e-6)
        losses.append(float(ml))
    assert_close(ms, rs, rtol=1e-4, atol=1e-5)
    compiled = list(mstep._cache.values())[-1]  # the steps' program (after call 1's)
    return ms, losses, compiled.compile_stats


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            dict(
                mesh=((4, 2), ("stage", "data")),
                stages=4,
                layers=4,
                dp=True,
                schedule="1f1b",
                m=2,
                steps=20,
            ),
            id="pp4-dp2",
        ),
        pytest.param(
            dict(
                mesh=((2, 2, 2), ("stage", "data", "model")),
                stages=2,
                layers=4,
                tp=True,
                schedule="zero-bubble-h1",
                m=2,
                steps=3,
            ),
            id="pp2-tp2-dp2",
            marks=pytest.mark.slow,  # the same layout runs in test_run (multimesh-run)
        ),
        pytest.param(
            dict(
                mesh=((4, 2), ("stage", "data")),
                stages=8,
                layers=8,
                dp=True,
                schedule="interleaved-1f1b",
                m=4,
                steps=3,
            ),
            id="interleaved-v2",
            marks=pytest.mark.slow,  # the same layout runs in test_run (multimesh-run)
        ),
    ],
)
def test_nnx_gpt(layout):
    mmesh = mm.make_mesh(*layout["mesh"])
    cfg = gpt.Config(
        stages=layout["stages"],
        layers=layout["layers"],
        dp=layout.get("dp", False),
        tp=layout.get("tp", False),
    )
    model = gpt.GPT(cfg, nnx.Rngs(0))
    step, state = gpt.nnx_train_step(
        cfg, model, optax.sgd(0.3, momentum=0.9), layout["m"], layout["schedule"]
    )
    tokens = gpt.synthetic_batch(cfg, 8)
    final, losses, stats = run(step, state, mmesh, tokens, layout["steps"])
    if layout["steps"] >= 20:
        assert losses[-1] < 0.8 * losses[0]
    if layout["stages"] == mmesh.num_stages == 4:
        # the middle stages' layers run the same programs on other devices: compiled
        # once and relocated (jnp.take's nested jit once kept every stage compiling)
        assert stats["relocated"] >= 4, stats
    params = final[0]
    s = mmesh.num_stages
    assert stage_of(params["embed"]["tok"]["embedding"].get_value(), mmesh) == 0
    for i in range(cfg.layers):
        assert (
            stage_of(params["blocks"][i]["up"]["kernel"].get_value(), mmesh)
            == cfg.stage_of_layer(i) % s
        )
    assert stage_of(params["head"]["logits"]["kernel"].get_value(), mmesh) == (cfg.stages - 1) % s


@pytest.mark.parametrize("tied", [False, True])
def test_linen_gpt_with_rules(tied):
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    cfg = gpt.Config(stages=4, layers=4, dp=True, tied=tied)
    model = gpt.LinenGPT(cfg)
    tokens = gpt.synthetic_batch(cfg, 8)
    init = mm.jit(model.init, mesh=mmesh, task_rules=gpt.linen_rules(cfg))
    params = init(jax.random.key(0), tokens)
    assert init.lower(jax.random.key(0), tokens).plan.transfers == []
    assert stage_of(params["params"]["layers_3"]["Dense_0"]["kernel"], mmesh) == 3
    opt = optax.sgd(0.3, momentum=0.9)
    step = gpt.linen_train_step(cfg, model, opt, 2, "1f1b")

    def rules_step(state, tokens):
        return step(state, tokens)

    mstep = mm.jit(rules_step, mesh=mmesh, task_rules=gpt.linen_rules(cfg))
    jstep = jax.jit(rules_step)
    ms = (params, opt.init(params))
    rs = jax.device_get(ms)  # plain jax.jit wants its inputs on one device set
    for _ in range(3):
        ms, ml = mstep(ms, tokens)
        with mmesh:
            rs, rl = jstep(rs, tokens)
        assert_close(ml, rl, rtol=2e-5, atol=1e-6)
    assert_close(ms, rs, rtol=1e-4, atol=1e-5)


def test_end_stages_run_shared_blocks_apart_from_embedding_and_head():
    """The first and last stages run their block as its own fragment (the middle stages'
    program: loaded, not compiled), apart from the embedding and the head, whether the
    stages' data is replicated or sharded over "data"."""
    for dp in (False, True):  # dp: the batch sharded over "data"
        cfg = gpt.Config(stages=4, layers=4, dp=dp)
        step, state = gpt.nnx_train_step(cfg, gpt.GPT(cfg, nnx.Rngs(0)), optax.sgd(0.1), 2)
        mesh = mm.make_mesh((4, 2), ("stage", "data"))
        lowered = mm.jit(step, mesh=mesh).lower(state, gpt.synthetic_batch(cfg, 4))
        names = {f.name for f in lowered.plan.fragments}
        assert {"embed:F0", "layers_0:F0", "layers_3:F0", "head:F0+B0"} <= names, sorted(names)
        assert not any("+" in n.split(":")[0] for n in names), sorted(names)  # no mixes

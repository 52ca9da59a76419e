"""Remat inside pipelined microbatches: every policy, Flax Linen/NNX remat, FSDP."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_close, reference, stage_of
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import multimesh as mm
from multimesh.examples import gpt

POLICIES = {
    "full": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_named": jax.checkpoint_policies.save_only_these_names("hidden"),
}


def remat_loss(policy):
    def block(w, h):
        z = checkpoint_name(h @ w, "hidden")
        return h + jnp.tanh(z)

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jax.checkpoint(block, policy=policy)(w, h)
        return (h**2).mean()

    return loss


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_remat_policies_in_microbatches(policy, schedule):
    mmesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    ws = [jax.random.normal(jax.random.key(i), (8, 8)) / 3 for i in range(2)]
    x = jax.random.normal(jax.random.key(5), (8, 8))
    g = mm.microbatch(
        jax.value_and_grad(remat_loss(POLICIES[policy])), 2, argnums=1, schedule=schedule
    )
    f = mm.jit(g, mesh=mmesh)
    got = f(ws, x)
    assert_close(got, reference(g, mmesh, ws, x), rtol=1e-5, atol=1e-6)
    assert [stage_of(gw, mmesh) for gw in got[1]] == [0, 1]
    plan = f.lower(ws, x).plan
    # the backward recomputes on its task's submesh: only the boundary activation
    # (forward) and its cotangent (backward) cross, per microbatch
    assert len(plan.transfers) == 2 * 2, plan.as_text()
    for fr in plan.fragments:
        assert set(fr.tasks) <= {f"s{fr.stage}"}


def test_linen_remat_decoder_with_adam_on_1f1b():
    mmesh = mm.make_mesh((2, 2), ("stage", "data"))
    cfg = gpt.Config(stages=2, layers=4, dp=True, remat=True)
    model = gpt.LinenGPT(cfg)
    tokens = gpt.synthetic_batch(cfg, 8)
    rules = gpt.linen_rules(cfg)
    params = mm.jit(model.init, mesh=mmesh, task_rules=rules)(jax.random.key(0), tokens)
    # eps: attention's key bias has a zero gradient (softmax is shift invariant); a tiny
    # eps would turn rounding noise there into +-lr steps in both runs
    opt = optax.adam(1e-2, eps=1e-4)
    step = gpt.linen_train_step(cfg, model, opt, 2, "1f1b")
    mstep = mm.jit(step, mesh=mmesh, task_rules=rules)
    ms = (params, opt.init(params))
    rs = jax.device_get(ms)
    for _ in range(3):
        ms, ml = mstep(ms, tokens)
        with mmesh:
            rs, rl = jax.jit(step)(rs, tokens)
        assert_close(ml, rl, rtol=2e-5, atol=1e-6)
    assert_close(ms, rs, rtol=1e-4, atol=1e-5)
    assert stage_of(ms[0]["params"]["layers_3"]["Dense_0"]["kernel"], mmesh) == 1


def test_remat_fsdp_gpt_interleaved_on_four_submeshes():
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    cfg = gpt.Config(stages=8, layers=8, dp=True, fsdp=True, remat=True)
    model = mm.flax.create(lambda k: gpt.GPT(cfg, nnx.Rngs(k)), jax.random.key(0), mesh=mmesh)
    kernel = model.blocks[5].up.kernel.get_value()
    assert stage_of(kernel, mmesh) == 5 % 4
    fsdp = jax.sharding.NamedSharding(mmesh.submesh(1), jax.P("data", None))
    assert kernel.sharding.is_equivalent_to(fsdp, 2)  # FSDP: created sharded, in place
    step, state = gpt.nnx_train_step(
        cfg, model, optax.sgd(0.3, momentum=0.9), 4, "interleaved-1f1b"
    )
    tokens = gpt.synthetic_batch(cfg, 8)
    mstep = mm.jit(step, mesh=mmesh)
    ms, rs = state, jax.device_get(state)
    ms, ml = mstep(ms, tokens)
    with mmesh:
        rs, rl = jax.jit(step)(rs, tokens)
    assert_close(ml, rl, rtol=2e-5, atol=1e-6)
    assert_close(ms, rs, rtol=1e-4, atol=1e-5)
    new_kernel = ms[0]["blocks"][5]["up"]["kernel"].get_value()
    assert new_kernel.sharding.is_equivalent_to(fsdp, 2)

"""Implicit tasks: task_rules place an unmodified (Flax Linen) model's layers."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close, reference, stage_of

import multimesh as mm


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(8)(x))


class Model(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="embed")(x)
        for i in range(self.layers):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(2, name="logits")(x)


RULES = {r"layers_(\d+)": lambda m: int(m[1]) // 2 + 1, r"embed": 0, r"(final_norm|logits)": 3}


def setup():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return (model.apply(p, x) ** 2).mean()

    return model, params, x, loss


def test_rules_match_reference_and_place_params(mesh4x2):
    _, params, x, loss = setup()
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2, task_rules=RULES)(params, x)
    assert_close(got, reference(f, mesh4x2, params, x))
    g = got[1]["params"]
    assert stage_of(g["embed"]["kernel"], mesh4x2) == 0
    assert stage_of(g["layers_0"]["Dense_0"]["kernel"], mesh4x2) == 1
    assert stage_of(g["layers_3"]["Dense_0"]["kernel"], mesh4x2) == 2
    assert stage_of(g["logits"]["kernel"], mesh4x2) == 3
    text = mm.jit(f, mesh=mesh4x2, task_rules=RULES).lower(params, x).as_text()
    assert "'layers_2' -> stage 2" in text and "'embed' -> stage 0" in text


def test_rules_equal_explicit_tasks(mesh4x2):
    model, params, x, _ = setup()

    def explicit(p, x):
        pp = p["params"]
        with mm.task("embed", stage=0):
            h = nn.Dense(8).apply({"params": pp["embed"]}, x)
        for i in range(4):
            with mm.task(f"layers_{i}", stage=i // 2 + 1):
                h = Block().apply({"params": pp[f"layers_{i}"]}, h)
        with mm.task("logits", stage=3):
            y = nn.Dense(2).apply({"params": pp["logits"]}, h)
        return (y**2).mean()

    def implicit(p, x):
        return (model.apply(p, x) ** 2).mean()

    a = mm.jit(jax.value_and_grad(implicit), mesh=mesh4x2, task_rules=RULES)
    b = mm.jit(jax.value_and_grad(explicit), mesh=mesh4x2)
    pa, pb = a.lower(params, x).plan, b.lower(params, x).plan
    assert [(f.stage, f.devices) for f in pa.fragments] == [
        (f.stage, f.devices) for f in pb.fragments
    ]
    assert [(t.src_stage, t.dst_stage, t.nbytes) for t in pa.transfers] == [
        (t.src_stage, t.dst_stage, t.nbytes) for t in pb.transfers
    ]
    assert_close(a(params, x), b(params, x))


def test_explicit_task_overrides_rule(mesh4x2):
    def f(x):
        with jax.named_scope("layers_0"):
            a = x * 2  # rule: stage 1
            with mm.task("pinned", stage=3):
                b = a + 1
        return a, b

    a, b = mm.jit(f, mesh=mesh4x2, task_rules={r"layers_0": 1})(jnp.ones(4))
    assert stage_of(a, mesh4x2) == 1 and stage_of(b, mesh4x2) == 3


def test_rule_only_under_explicit_tasks_says_so(mesh4x2):
    """A rule whose scopes all sit in (or around) explicit tasks placed nothing: the
    warning says the tasks won, not that the scope does not exist."""

    def f(x):
        with jax.named_scope("enc"):
            with mm.task("explicit", stage=1):
                h = x * 2
        with mm.task("inner", stage=2), jax.named_scope("dec"):
            return h + 1

    with pytest.warns(UserWarning) as rec:
        out = mm.jit(f, mesh=mesh4x2, task_rules={"enc": 0, "dec": 0})(jnp.ones(4))
    msgs = [str(w.message) for w in rec]
    assert any("task_rules['enc'] matched only scopes inside explicit tasks ('explicit')" in m for m in msgs), msgs
    assert any("task_rules['dec'] matched only scopes inside explicit tasks ('inner')" in m for m in msgs), msgs
    assert not any("matched no named scope" in m for m in msgs), msgs
    assert stage_of(out, mesh4x2) == 2


def test_explicit_task_in_a_scan_body_wins_over_a_rule(mesh4x2):
    """Inside a scan body too, an explicit task takes precedence over a rule matching its
    scopes (it was refused as two submeshes' code in one scan body)."""

    def f(x):
        def body(c, _):
            with mm.task("t", stage=1), jax.named_scope("enc"):
                return jnp.sin(c), None

        return jax.lax.scan(body, x, None, length=2)[0]

    with pytest.warns(UserWarning, match=r"task_rules\['enc'\] matched only scopes inside"):
        out = mm.jit(f, mesh=mesh4x2, task_rules={"enc": 2})(jnp.ones(4))
    assert stage_of(out, mesh4x2) == 1
    assert_close(out, jnp.sin(jnp.sin(jnp.ones(4))))


def test_precompiled_regex_rules(mesh4x2):
    """``re.compile`` keys work as their pattern strings do (they crashed on ``in``)."""

    def f(x):
        with jax.named_scope("enc"):
            h = x * 2
        with jax.named_scope("layers_3"):
            return h + 1

    rules = {re.compile(r"^enc$"): 1, re.compile(r"layers_(\d+)"): lambda m: int(m[1])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered = mm.jit(f, mesh=mesh4x2, task_rules=rules).lower(jnp.ones(4))
    assert sorted(fr.stage for fr in lowered.plan.fragments) == [1, 3]
    out = mm.jit(f, mesh=mesh4x2, task_rules=rules)(jnp.ones(4))
    assert stage_of(out, mesh4x2) == 3
    assert_close(out, jnp.ones(4) * 2 + 1)
    with pytest.raises(TypeError, match="task_rules keys are regexes"):
        mm.jit(f, mesh=mesh4x2, task_rules={re.compile(rb"enc"): 1})


def test_rules_sharing_a_pattern_text_are_two_rules(mesh4x2):
    """``"enc"`` and ``re.compile("enc", re.I)`` are two rules: the second, shadowed by
    the first on every scope, is reported in the overlap (named with its flags), and an
    unused one is reported on its own (their bookkeeping was shared by pattern text)."""

    def f(x):
        with jax.named_scope("enc"):
            h = x * 2
        with jax.named_scope("ENC2"):
            return h + 1

    rules = {"enc": 1, re.compile("enc", re.I): 2}
    with pytest.warns(UserWarning) as rec:
        out = mm.jit(f, mesh=mesh4x2, task_rules=rules)(jnp.ones(4))
    assert_close(out, jnp.ones(4) * 2 + 1)
    msgs = " ".join(str(w.message) for w in rec)
    assert "'enc': ['enc', re.compile('enc', re.IGNORECASE)] (first wins)" in msgs, msgs
    assert "matched no named scope" not in msgs, msgs  # both rules matched something
    rules = {"enc": 1, re.compile("ENC", re.I): 2, re.compile("xyz", re.I): 0}
    with pytest.warns(UserWarning) as rec:
        mm.jit(f, mesh=mesh4x2, task_rules=rules).lower(jnp.ones(4))
    msgs = " ".join(str(w.message) for w in rec)
    assert "no named scope: [re.compile('xyz', re.IGNORECASE)]" in msgs, msgs
    assert "'enc': ['enc', re.compile('ENC', re.IGNORECASE)]" in msgs, msgs
    rules = {"enc": 1, re.compile("enc"): 2}  # a compiled pattern is named by its repr
    with pytest.warns(UserWarning, match=r"'enc': \['enc', re.compile\('enc'\)\]"):
        mm.jit(f, mesh=mesh4x2, task_rules=rules).lower(jnp.ones(4))
    with pytest.raises(TypeError, match=r"task_rules\[re.compile\('enc', re.IGNORECASE\)\]"):
        mm.jit(f, mesh=mesh4x2, task_rules={re.compile("enc", re.I): "0"})


def test_unmatched_and_overlapping_rules_warn(mesh4x2):
    _, params, x, loss = setup()
    rules = {**RULES, r"decoder_\d+": 1, r"layers_1": 2}
    with pytest.warns(UserWarning) as rec:
        mm.jit(loss, mesh=mesh4x2, task_rules=rules).lower(params, x)
    msgs = " ".join(str(w.message) for w in rec)
    assert "matched no named scope" in msgs and "decoder_" in msgs
    assert "overlap" in msgs and "layers_1" in msgs
    # the rule that loses an overlap matched a scope: not reported as unused
    unused = next(str(w.message) for w in rec if "matched no named scope" in str(w.message))
    assert "layers_1" not in unused
    assert {w.filename for w in rec} == {__file__}  # the warnings point at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.jit(loss, mesh=mesh4x2, task_rules=RULES).lower(params, x)


def test_overlapping_by_layer_rules_warn_as_overlaps(mesh4x2):
    """Two by-layer rules matching a scanned body's scope: the loser was reported as
    matching no scope (found by a probe); it is an overlap, as for stage rules."""
    ws = jnp.ones((4, 4, 4)) / 4

    def loss(ws, x):
        def body(h, w):
            with jax.named_scope("decoder_layers"):
                return h + jnp.tanh(h @ w), None

        return jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2)

    rules = {"decoder": mm.by_layer(), "layers": mm.by_layer(lambda i, n: n - 1 - i)}
    with pytest.warns(UserWarning) as rec:
        lo = mm.jit(jax.grad(loss), mesh=mesh4x2, task_rules=rules).lower(ws, jnp.ones((2, 4)))
    msgs = [str(w.message) for w in rec]
    assert any("overlap" in m and "'decoder', 'layers'" in m for m in msgs), msgs
    assert not any("matched no named scope" in m for m in msgs), msgs
    assert sorted({f.stage for f in lo.plan.fragments}) == [0, 1, 2, 3]  # the first wins


def test_rule_errors(mesh4x2):
    _, params, x, loss = setup()
    with pytest.raises(
        ValueError, match=r"task_rules\['embed'\] maps scope 'embed' to stage 7.*out of range"
    ):
        mm.jit(loss, mesh=mesh4x2, task_rules={"embed": 7}).lower(params, x)
    with pytest.raises(TypeError, match="must be a stage"):
        mm.jit(loss, mesh=mesh4x2, task_rules={"embed": "0"})
    with pytest.raises(ValueError, match="not a valid regex"):
        mm.jit(loss, mesh=mesh4x2, task_rules={"(": 0})


def test_rules_inside_a_loop_body(mesh4x2):
    def model(ws, x):
        def body(h, w):
            with jax.named_scope("layers"):
                return jnp.tanh(h @ w), None

        with jax.named_scope("stack"):
            h, _ = jax.lax.scan(body, x, ws)
        with jax.named_scope("head"):
            return (h**2).mean()

    ws = jnp.stack([jnp.eye(4) * 0.5] * 4)
    x = jnp.ones((2, 4))
    # the whole scan on one stage: placed there, not silently on stage 0
    f = mm.jit(model, mesh=mesh4x2, task_rules={"layers": 2, "head": 3})
    got = f(ws, x)
    assert_close(got, reference(model, mesh4x2, ws, x))
    plan = f.lower(ws, x).plan
    assert sorted({fr.stage for fr in plan.fragments}) == [2, 3]

    # a loop body that would need two submeshes is a clear error, never a silent run
    def model2(ws, x):
        def body(h, w):
            with jax.named_scope("attn"):
                h = jnp.tanh(h @ w)
            with jax.named_scope("mlp"):
                return h * 2, None

        return jax.lax.scan(body, x, ws)[0].sum()

    with pytest.raises(ValueError, match=r"inside a `scan` body together with code for another"):
        mm.jit(model2, mesh=mesh4x2, task_rules={"attn": 0, "mlp": 1})(ws, x)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(8, name="proj")(x))


class _Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = _Block(name=f"layers_{i}")(x)
        return x


class _Top(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Decoder(name="decoder")(nn.Dense(8, name="embed")(x))


def test_path_rules_match_the_scope_path(mesh4x2):
    """A rule with ``/`` is searched in the scope path (``decoder/layers_(\\d+)`` in
    ``_Top/decoder/layers_2/proj``): it matched nothing (each scope name was searched
    alone) and every layer ran on stage 0 after an "unmatched rule" warning. One task per
    matched layer; component rules keep their meaning next to it."""
    model = _Top()
    x = jax.random.normal(jax.random.key(0), (4, 8))
    params = model.init(jax.random.key(1), x)
    f = jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
    rules = {r"decoder/layers_(\d+)": lambda m: int(m[1]), r"^embed$": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rule goes unmatched
        lowered = mm.jit(f, mesh=mesh4x2, task_rules=rules).lower(params, x)
    v, g = lowered.compile()(params, x)
    assert_close((v, g), reference(f, mesh4x2, params, x))
    for i in range(4):
        assert stage_of(g["params"]["decoder"][f"layers_{i}"]["proj"]["kernel"], mesh4x2) == i
    assert stage_of(g["params"]["embed"]["kernel"], mesh4x2) == 0
    tasks = {t for fr in lowered.plan.fragments for t in fr.tasks}
    assert {t for t in tasks if "layers" in t} == {f"_Top/decoder/layers_{i}" for i in range(4)}


def test_path_rules_keep_inner_scopes_first(mesh4x2):
    """Scopes are tried innermost first for path rules too: a rule for ``proj`` inside a
    layer a path rule places wins there (the path rule matched the whole path at every
    depth, so rule order decided, and ``proj``'s rule was reported as matching nothing);
    overlap warnings name only scopes both rules match."""
    model = _Top()
    x = jax.random.normal(jax.random.key(0), (4, 8))
    params = model.init(jax.random.key(1), x)
    f = jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
    rules = {r"decoder/layers_(\d+)": lambda m: int(m[1]), r"^proj$": 3, r"^embed$": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v, g = mm.jit(f, mesh=mesh4x2, task_rules=rules)(params, x)
    assert_close((v, g), reference(f, mesh4x2, params, x))
    for i in range(4):
        assert stage_of(g["params"]["decoder"][f"layers_{i}"]["proj"]["kernel"], mesh4x2) == 3
    # a path rule reaching into an inner scope is matched there, groups and all
    rules = {r"decoder/layers_(\d+)(/proj)?": lambda m: 0 if m[2] else int(m[1])}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        v, g = mm.jit(f, mesh=mesh4x2, task_rules=rules)(params, x)
    assert not [w for w in rec if "task_rules" in str(w.message)], [str(w.message) for w in rec]
    for i in range(4):
        assert stage_of(g["params"]["decoder"][f"layers_{i}"]["proj"]["kernel"], mesh4x2) == 0
    assert_close((v, g), reference(f, mesh4x2, params, x))

"""Property test: random programs of tasks and untagged glue match plain ``jax.jit``.

A Hypothesis strategy draws a *program description* (plain data: lists, dicts, ints,
strings); :func:`build` turns it into a JAX function. For every drawn program we check
that ``mm.jit`` equals the reference (``jax.jit`` on the global mesh, tasks transparent)

* for the forward program (a scalar loss plus several intermediate values),
* for ``jax.value_and_grad`` of the loss (with the intermediates as ``has_aux``), and
* for a second gradient step on parameters updated from the first step's gradients
  (so committed to the submeshes the gradients live on),

with tight float32 tolerances, and that arrays live where they should: a task's output
on the task's stage, and the gradient of a weight used by exactly one task (whose output
reaches the loss) on that task's stage.

Programs are chains/DAGs of at most 6 nodes over a (4, 2) ("stage", "data") mesh or an
(8,) ("stage",) mesh, with stages drawn at random (repeats and going back included).

Reproducing a failure: the failing description is printed (``note``) as a Python
literal; paste it into ``check_program(<description>)``. Runs are derandomized by default
(the same 15 programs every run); set ``MULTIMESH_PROPERTY_RANDOM=1`` to explore new
programs, ``MULTIMESH_PROPERTY_EXAMPLES=N`` to draw more of them and
``MULTIMESH_PROPERTY_NODES=N`` for longer programs.
"""

from __future__ import annotations

import os
import pprint

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close, reference, stage_of, to_np
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import multimesh as mm

BATCH, WIDTH = 4, 8
RTOL, ATOL = 1e-5, 1e-6

# Meshes are built once: building them is cheap, but reusing them keeps the test honest
# about caching across differently shaped programs on the same MultiMesh.
_MESHES: dict[str, mm.MultiMesh] = {}


def get_mesh(layout: str) -> mm.MultiMesh:
    if layout not in _MESHES:
        if layout == "4x2":
            _MESHES[layout] = mm.make_mesh((4, 2), ("stage", "data"))
        elif layout == "8":
            _MESHES[layout] = mm.make_mesh((8,), ("stage",))
        else:  # pragma: no cover
            raise ValueError(layout)
    return _MESHES[layout]


NUM_STAGES = {"4x2": 4, "8": 8}

# -- operations ----------------------------------------------------------------------
# Every value in a program has shape (BATCH, WIDTH). ``a``/``b`` are the node's inputs,
# ``w`` its weight (WIDTH, WIDTH), ``c`` a constant, ``p`` the parameters (for "bias").

# Task ops: (number of value inputs, uses a weight, function).
TASK_OPS = {
    "tanh_mm": (1, True, lambda a, b, w, c: jnp.tanh(a @ w)),
    "sin_mm_mul": (2, True, lambda a, b, w, c: jnp.sin(a @ w) * b),
    "res_mm": (1, True, lambda a, b, w, c: a + c * jnp.tanh(a) @ w),
    "center_mm": (1, True, lambda a, b, w, c: (a - a.mean(axis=0, keepdims=True)) @ w),
    "sin_mul": (2, False, lambda a, b, w, c: jnp.sin(a) * b),
    "rms": (1, False, lambda a, b, w, c: a * jax.lax.rsqrt((a * a).mean(-1, keepdims=True) + 1.0)),
    "cos_add_sum": (2, False, lambda a, b, w, c: jnp.cos(a) + c * b.sum(axis=0, keepdims=True)),
    # a sharding constraint on the task's submesh (only drawn for the ("stage", "data") mesh)
    "shard_tanh": (
        1,
        False,
        lambda a, b, w, c: jnp.tanh(jax.lax.with_sharding_constraint(a * c, jax.P("data", None))),
    ),
}
MESH_ONLY_TASK_OPS = {"shard_tanh": "4x2"}

# Untagged glue ops: (number of value inputs, function).
GLUE_OPS = {
    "add": (2, lambda a, b, c, p: a + b),
    "sub": (2, lambda a, b, c, p: a - b),
    "mul": (2, lambda a, b, c, p: a * b),
    "scale": (1, lambda a, b, c, p: a * c),
    "add_const": (1, lambda a, b, c, p: a + c),
    "sub_mean": (1, lambda a, b, c, p: a - a.mean(axis=0, keepdims=True)),
    "mul_sum": (2, lambda a, b, c, p: a * (0.05 * jnp.sum(b))),
    "mul_mean": (2, lambda a, b, c, p: a * jnp.mean(b, axis=-1, keepdims=True)),
    # concatenation of two earlier values, then a window that takes from both
    "concat1": (
        2,
        lambda a, b, c, p: jnp.concatenate([a, b], axis=1)[:, WIDTH // 2 : WIDTH // 2 + WIDTH],
    ),
    "concat0": (
        2,
        lambda a, b, c, p: jnp.concatenate([a, b], axis=0)[BATCH // 2 : BATCH // 2 + BATCH],
    ),
    "bias": (1, lambda a, b, c, p: a + p["bias"]),
    # an untagged matmul with a task's weight (so that weight is no longer private)
    "mm_w": (1, lambda a, b, c, p, w=None: a @ w),
}

CONSTS = (0.5, -1.5, 2.0, 0.25)

# -- strategy ------------------------------------------------------------------------


@st.composite
def programs(draw, max_nodes: int = 6):
    """Draw a program description (plain data)."""
    layout = draw(st.sampled_from(["4x2", "8"]))
    num_stages = NUM_STAGES[layout]
    n_nodes = draw(st.integers(1, max_nodes))
    nodes: list[dict] = []
    n_values = 2  # value 0: batch x, value 1: batch y; node k produces value 2 + k
    task_values: list[int] = []
    n_weights = 0
    weight_of: list[int] = []  # weight index of each weight-using task so far
    prev_stage = None

    def pick_arg(prefer_tasks: bool = False) -> int:
        if prefer_tasks and len(task_values) >= 1 and draw(st.booleans()):
            return draw(st.sampled_from(task_values))
        # bias towards the newest value, so chains are common
        if draw(st.booleans()):
            return n_values - 1
        return draw(st.integers(0, n_values - 1))

    for k in range(n_nodes):
        # at least one task in every program: force the last node if none so far
        is_task = draw(st.booleans()) or (k == n_nodes - 1 and not task_values)
        c = draw(st.sampled_from(CONSTS))
        if is_task:
            op = draw(
                st.sampled_from(
                    sorted(o for o in TASK_OPS if MESH_ONLY_TASK_OPS.get(o, layout) == layout)
                )
            )
            nargs, uses_w, _ = TASK_OPS[op]
            # stage: repeat the previous one, step forward, or anything (incl. going back)
            how = draw(st.sampled_from(["any", "any", "same", "next"]))
            if prev_stage is None or how == "any":
                stage = draw(st.integers(0, num_stages - 1))
            elif how == "same":
                stage = prev_stage
            else:
                stage = (prev_stage + 1) % num_stages
            prev_stage = stage
            args = [pick_arg() for _ in range(nargs)]
            weight = None
            if uses_w:
                if weight_of and draw(st.integers(0, 4)) == 0:
                    weight = draw(st.sampled_from(weight_of))  # shared with an earlier task
                else:
                    weight = n_weights
                    n_weights += 1
                weight_of.append(weight)
            nodes.append(
                {"kind": "task", "op": op, "stage": stage, "args": args, "weight": weight, "c": c}
            )
            task_values.append(n_values)
        else:
            op = draw(st.sampled_from(sorted(o for o in GLUE_OPS if o != "mm_w" or weight_of)))
            nargs, _ = GLUE_OPS[op]
            # binary glue often combines values from two tasks on different stages
            on_stage = {v: nodes[v - 2]["stage"] for v in task_values}
            pairs = [(a, b) for a in task_values for b in task_values if on_stage[a] != on_stage[b]]
            if nargs == 2 and pairs and draw(st.booleans()):
                args = list(draw(st.sampled_from(pairs)))
            else:
                args = [pick_arg(prefer_tasks=nargs == 2) for _ in range(nargs)]
            node = {"kind": "glue", "op": op, "args": args, "c": c}
            if op == "mm_w":
                node["weight"] = draw(st.sampled_from(weight_of))
            nodes.append(node)
        n_values += 1

    last = n_values - 1
    loss_terms = sorted({last} | set(draw(st.lists(st.integers(2, last), max_size=2))))
    loss = [(v, draw(st.sampled_from(CONSTS))) for v in loss_terms]
    outputs = draw(st.lists(st.integers(0, last), max_size=3))  # intermediates (dups ok)
    return_bias = draw(st.integers(0, 5)) == 5  # a parameter passed straight through
    seed = draw(st.integers(0, 2**16))
    return {
        "layout": layout,
        "nodes": nodes,
        "n_weights": n_weights,
        "loss": loss,
        "outputs": outputs,
        "return_bias": return_bias,
        "seed": seed,
    }


# -- building and checking -----------------------------------------------------------


def build(desc: dict):
    """The program as ``f(params, x, y) -> (loss, [intermediate values])``."""

    def f(params, x, y):
        vals = [x, y]
        for k, node in enumerate(desc["nodes"]):
            args = [vals[i] for i in node["args"]]
            a = args[0]
            b = args[1] if len(args) > 1 else None
            c = node["c"]
            if node["kind"] == "task":
                fn = TASK_OPS[node["op"]][2]
                w = params["w"][node["weight"]] if node["weight"] is not None else None
                with mm.task(f"n{k}", stage=node["stage"]):
                    v = fn(a, b, w, c)
            elif node["op"] == "mm_w":
                v = GLUE_OPS["mm_w"][1](a, b, c, params, w=params["w"][node["weight"]])
            else:
                v = GLUE_OPS[node["op"]][1](a, b, c, params)
            vals.append(v)
        loss = sum(coef * jnp.mean(vals[i] ** 2) for i, coef in desc["loss"])
        outs = [vals[i] for i in desc["outputs"]]
        if desc.get("return_bias"):
            outs.append(params["bias"])
        return loss, outs

    return f


def make_inputs(desc: dict):
    rng = np.random.RandomState(desc["seed"])
    w = [
        jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
        for _ in range(desc["n_weights"])
    ]
    params = {"w": w, "bias": jnp.asarray(rng.normal(size=(WIDTH,)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(BATCH, WIDTH)) * 0.5, jnp.float32)
    y = jnp.asarray(rng.normal(size=(BATCH, WIDTH)) * 0.5, jnp.float32)
    return params, x, y


def reaches_loss(desc: dict) -> set[int]:
    """Values that the loss depends on (the loss terms and their ancestors)."""
    live = {i for i, _ in desc["loss"]}
    for k in reversed(range(len(desc["nodes"]))):
        if 2 + k in live:
            live.update(desc["nodes"][k]["args"])
    return live


def task_stage_of_value(desc: dict) -> dict[int, int]:
    return {2 + k: n["stage"] for k, n in enumerate(desc["nodes"]) if n["kind"] == "task"}


def private_weights(desc: dict) -> dict[int, int]:
    """weight index -> stage, for weights used by exactly one task that reaches the loss."""
    uses: dict[int, list[int]] = {}
    for k, n in enumerate(desc["nodes"]):
        if n.get("weight") is not None:
            uses.setdefault(n["weight"], []).append(k)
    live = reaches_loss(desc)
    return {
        w: desc["nodes"][ks[0]]["stage"]
        for w, ks in uses.items()
        if len(ks) == 1 and desc["nodes"][ks[0]]["kind"] == "task" and 2 + ks[0] in live
    }


def check_outputs_placed(outs, desc: dict, mmesh) -> None:
    stages = task_stage_of_value(desc)
    for i, o in zip(desc["outputs"], outs):
        if i in stages:
            assert stage_of(o, mmesh) == stages[i], (
                f"output value {i} (task on stage {stages[i]}) lives on {stage_of(o, mmesh)}"
            )


def check_program(desc: dict) -> None:
    """Run one program description through mm.jit and the reference; assert they agree."""
    mmesh = get_mesh(desc["layout"])
    f = build(desc)
    params, x, y = make_inputs(desc)

    # forward: loss and intermediates
    got = mm.jit(f, mesh=mmesh)(params, x, y)
    want = reference(f, mmesh, params, x, y)
    assert_close(got, want, rtol=RTOL, atol=ATOL)
    check_outputs_placed(got[1], desc, mmesh)

    # value_and_grad of the loss wrt the parameters and the batch x, intermediates as aux
    vg = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    step = mm.jit(vg, mesh=mmesh)
    got = step(params, x, y)
    want = reference(vg, mmesh, params, x, y)
    assert_close(got, want, rtol=RTOL, atol=ATOL)
    (_, outs), (grads, _gx) = got
    check_outputs_placed(outs, desc, mmesh)
    for w, s in private_weights(desc).items():
        got_stage = stage_of(grads["w"][w], mmesh)
        assert got_stage == s, f"grad of w[{w}] (used only on stage {s}) lives on {got_stage}"

    # a second step on parameters updated eagerly from those gradients: the new
    # parameters are committed to whatever submeshes the gradients live on
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    got = step(new_params, x, y)
    want = reference(vg, mmesh, to_np(new_params), x, y)
    assert_close(got, want, rtol=RTOL, atol=ATOL)


_RANDOM = os.environ.get("MULTIMESH_PROPERTY_RANDOM", "") not in ("", "0")
_EXAMPLES = int(os.environ.get("MULTIMESH_PROPERTY_EXAMPLES", "15"))
_MAX_NODES = int(os.environ.get("MULTIMESH_PROPERTY_NODES", "6"))


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize=not _RANDOM,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(programs(max_nodes=_MAX_NODES))
def test_random_programs_match_jit(desc):
    note(
        "program description (reproduce with check_program(desc)):\n"
        + pprint.pformat(desc, width=100, sort_dicts=False)
    )
    check_program(desc)


def test_strategy_covers_features():
    """The strategy can produce what the property is meant to exercise (cheap: no jit)."""
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(programs())
    def collect(desc):
        nodes = desc["nodes"]
        stages = [n["stage"] for n in nodes if n["kind"] == "task"]
        if any(b < a for a, b in zip(stages, stages[1:])):
            seen.add("back")
        if any(b == a for a, b in zip(stages, stages[1:])):
            seen.add("repeat")
        if desc["layout"] == "8":
            seen.add("mesh8")
        task_vals = task_stage_of_value(desc)
        for n in nodes:
            if n["kind"] == "glue" and len(n["args"]) == 2:
                a, b = n["args"]
                if a in task_vals and b in task_vals and task_vals[a] != task_vals[b]:
                    seen.add("glue_two_stages")
            if n["kind"] == "glue" and n["op"].startswith("concat"):
                seen.add("concat")
        if any(n["kind"] == "task" and n["weight"] is not None for n in nodes) and len(
            {n["weight"] for n in nodes if n["kind"] == "task" and n["weight"] is not None}
        ) < sum(1 for n in nodes if n["kind"] == "task" and n["weight"] is not None):
            seen.add("shared_weight")
        if private_weights(desc):
            seen.add("private_weight")
        if len(desc["outputs"]) >= 2:
            seen.add("several_outputs")
        seen.update(n["op"] for n in nodes if n["op"] in ("mm_w", "shard_tanh"))

    collect()
    want = {
        "back",
        "repeat",
        "mesh8",
        "glue_two_stages",
        "concat",
        "shared_weight",
        "private_weight",
        "several_outputs",
        "mm_w",
        "shard_tanh",
    }
    assert want <= seen, want - seen

"""Write the tutorial notebooks in docs/notebooks/ (stored without outputs).

Run: python tools/make_notebooks.py   (then the test suite executes them)
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

OUT = Path(__file__).resolve().parents[1] / "docs" / "notebooks"

SETUP = """import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import multimesh as mm
print(jax.__version__, jax.devices())"""

WHERE = '''def where(x, mmesh):
    """Which submesh an array lives on."""
    ids = sorted(d.id for d in x.sharding.device_set)
    for i in range(mmesh.num_stages):
        if ids == sorted(d.id for d in mmesh.submesh(i).devices.flat):
            return f"submesh {i} {ids}"
    return f"devices {ids}"'''


def nb(cells):
    out = []
    for c in cells:
        if c.startswith("#md\n"):
            out.append(new_markdown_cell(c[4:]))
        else:
            out.append(new_code_cell(c))
    for i, cell in enumerate(out):  # stable ids: regenerating changes only what changed
        cell["id"] = f"cell-{i:02d}"
    book = new_notebook(cells=out)
    book.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return book


NOTEBOOKS = {
    "01-hello-multimesh.ipynb": [
        "#md\n# Hello, MultiMesh\n\nTwo functions on two submeshes inside **one** `mm.jit`: "
        "each task (and its gradient) runs on its own devices, and MultiMesh moves the data "
        "between them. We run on 8 virtual CPU devices.",
        SETUP,
        "#md\nA `MultiMesh` is a global mesh whose `stage` axis indexes submeshes.",
        'mmesh = mm.make_mesh((2, 4), ("stage", "data"))\nprint(mmesh)\n'
        "for i in range(mmesh.num_stages):\n    print(i, mmesh.submesh(i))",
        "#md\n`mm.task` marks where code runs. Untagged code (the loss here) is placed next "
        "to its data.",
        """def loss(params, x):
    with mm.task("encoder", stage=0):
        h = jnp.tanh(x @ params["w0"])
    with mm.task("decoder", stage=1):
        y = h @ params["w1"]
    return jnp.mean(y ** 2)

k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
params = {"w0": jax.random.normal(k0, (16, 32)) / 4, "w1": jax.random.normal(k1, (32, 8)) / 6}
x = jax.random.normal(k2, (8, 16))
step = mm.jit(jax.value_and_grad(loss), mesh=mmesh)
val, grads = step(params, x)""",
        WHERE,
        'print("loss   ", where(val, mmesh))\nfor k, g in grads.items():\n'
        '    print("grad", k, where(g, mmesh))\n'
        'assert where(grads["w0"], mmesh).startswith("submesh 0")\n'
        'assert where(grads["w1"], mmesh).startswith("submesh 1")',
        "#md\nOutside `mm.jit` tasks are transparent: the same function under plain "
        "`jax.jit` (on the global mesh) is the reference, and MultiMesh matches it.",
        """with mmesh:
    ref_val, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x)
np.testing.assert_allclose(np.asarray(val), np.asarray(ref_val), rtol=1e-6)
for k in grads:
    np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]), rtol=1e-5, atol=1e-7)
print("matches jax.jit")""",
        "#md\nThe plan: which fragment runs where, and what moves between submeshes.",
        "lowered = step.lower(params, x)\nprint(lowered.as_text())\n"
        "plan = lowered.plan\nassert [f.stage for f in plan.fragments] == [0, 1, 0]\n"
        "assert [(t.src_stage, t.dst_stage) for t in plan.transfers] == [(0, 1), (1, 0)]",
    ],
    "02-spmd-inside-a-task.ipynb": [
        "#md\n# SPMD inside a task\n\nInside a task, ordinary JAX sharding works on the "
        "task's submesh: bare `PartitionSpec` constraints, `NamedSharding`s on the global "
        "mesh (without the stage axis), `shard_map`, nested `jax.jit`.",
        SETUP,
        'mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))\nprint(mmesh.submesh(0))',
        """def mlp(params, x):
    with mm.task("mlp", stage=1):
        h = jax.lax.with_sharding_constraint(x @ params["w1"], jax.P("data", "model"))  # DP x TP
        h = jax.nn.gelu(h)
        return jax.lax.with_sharding_constraint(h @ params["w2"], jax.P("data", None))

params = {"w1": jnp.ones((8, 16)) * 0.1, "w2": jnp.ones((16, 8)) * 0.1}
x = jnp.arange(32.0).reshape(4, 8) / 32
f = mm.jit(mlp, mesh=mmesh)
y = f(params, x)
print(y.sharding)
assert tuple(y.sharding.spec)[:1] == ("data",) and y.sharding.spec[1:] in ((), (None,))
assert sorted(d.id for d in y.sharding.device_set) == sorted(d.id for d in mmesh.submesh(1).devices.flat)""",
        "#md\nThe constraint was resolved on submesh 1 (devices 4–7): rows split over `data`.",
        "jax.debug.visualize_array_sharding(y)",
        "#md\nA hidden activation sharded over both axes of the submesh:",
        """def hidden(params, x):
    with mm.task("mlp", stage=1):
        return jax.lax.with_sharding_constraint(x @ params["w1"], jax.P("data", "model"))

h = mm.jit(hidden, mesh=mmesh)(params, x)
jax.debug.visualize_array_sharding(h)
assert h.sharding.spec == jax.P("data", "model")""",
        "#md\n`shard_map` over the non-stage axes, with or without the global mesh:",
        """def collective(x):
    with mm.task("reduce", stage=0):
        return jax.shard_map(lambda a: jax.lax.psum(a, "model"), mesh=mmesh.mesh,
                             in_specs=jax.P("data", "model"), out_specs=jax.P("data"))(x)

got = mm.jit(collective, mesh=mmesh)(x)
with mmesh:
    want = jax.jit(collective)(x)
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
print(got.shape, got.sharding)""",
        "#md\nValues match plain `jax.jit` on the global mesh:",
        """with mmesh:
    ref = jax.jit(mlp)(params, x)
np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6)
print("matches jax.jit")""",
    ],
    "03-mpmd-and-resharding.ipynb": [
        "#md\n# MPMD and resharding\n\nTwo tasks on submeshes of different sizes and "
        "shapes (`mesh=` tasks), each with its own sharding. MultiMesh plans the transfers "
        "between them and reshards on the way.",
        SETUP,
        """from jax.sharding import AxisType, Mesh
devs = jax.devices()
big = Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
small = Mesh(np.array(devs[4:6]), ("data",), axis_types=(AxisType.Auto,))

def f(w, x):
    with mm.task("wide", mesh=big):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w[0]), jax.P("data", "model"))
    with mm.task("narrow", mesh=small):
        y = jax.lax.with_sharding_constraint(h @ w[1], jax.P("data"))
    return y

w = [jnp.ones((8, 32)) * 0.1, jnp.ones((32, 4)) * 0.1]
x = jnp.ones((8, 8))
fn = mm.jit(f)
lowered = fn.lower(w, x)
print(lowered.as_text())""",
        "#md\nThe activation `h` (8×32 float32 = 1 KiB) moves from the 2×2 submesh to the "
        "2-device submesh:",
        """plan = lowered.plan
for t in plan.transfers:
    print(f"stage {t.src_stage} -> stage {t.dst_stage}: {t.nbytes} bytes")
assert [(t.src_stage, t.dst_stage, t.nbytes) for t in plan.transfers] == [(0, 1, 8 * 32 * 4)]
assert sorted(f.devices for f in plan.fragments) == [(0, 1, 2, 3), (4, 5)]""",
        """y = fn(w, x)
print(y.sharding)
assert sorted(d.id for d in y.sharding.device_set) == [4, 5]
np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.tanh(x @ w[0]) @ w[1]), rtol=1e-6)
print("values match")""",
        "#md\nWith gradients, the cotangent travels back the other way:",
        """g = mm.jit(jax.grad(lambda w, x: f(w, x).sum()))
print(g.lower(w, x).as_text())
assert [(t.src_stage, t.dst_stage) for t in g.lower(w, x).plan.transfers] == [(0, 1), (1, 0)]""",
    ],
    "04-flax-pipeline.ipynb": [
        "#md\n# A Flax NNX model, pipelined\n\nA small GPT-style decoder in Flax NNX "
        "(`multimesh.examples.gpt`), its blocks placed with `mm.flax.task`, trained with "
        "`mm.microbatch` and the 1F1B schedule on 4 stages × 2-way data parallelism.",
        SETUP,
        """import optax
from flax import nnx
from multimesh.examples import gpt

mmesh = mm.make_mesh((4, 2), ("stage", "data"))
cfg = gpt.Config(stages=4, layers=4, dp=True)
model = gpt.GPT(cfg, nnx.Rngs(0))
print([(type(b).__name__, b.mm_stage) for b in model.blocks])""",
        """step, state = gpt.nnx_train_step(cfg, model, optax.sgd(0.3, momentum=0.9), num_microbatches=4, schedule="1f1b")
tokens = gpt.synthetic_batch(cfg, 16)
mstep = mm.jit(step, mesh=mmesh)
print(mstep.lower(state, tokens).as_text()[:1500])""",
        """jstep = jax.jit(step)
ms, rs, losses = state, state, []
for _ in range(20):
    ms, loss = mstep(ms, tokens)
    with mmesh:
        rs, ref = jstep(rs, tokens)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-4)
    losses.append(float(loss))
print([round(l, 3) for l in losses])
assert losses[-1] < 0.8 * losses[0]""",
        """import matplotlib.pyplot as plt
plt.plot(losses, marker="o")
plt.xlabel("step"); plt.ylabel("loss"); plt.title("GPT on 4 pipeline stages x 2 data-parallel")
plt.show()""",
        "#md\nEvery parameter stays on its stage's submesh:",
        """params = ms[0]
for i in range(cfg.layers):
    ids = sorted(d.id for d in params["blocks"][i]["up"]["kernel"].get_value().sharding.device_set)
    print(f"layer {i}: devices {ids}")
    assert ids == sorted(d.id for d in mmesh.submesh(i).devices.flat)""",
    ],
    "05-implicit-tasks.ipynb": [
        "#md\n# Implicit tasks: place an unmodified Linen model\n\nFlax Linen puts module "
        "paths (`layers_3`, `embed`, …) in JAX's name stacks. `task_rules` map them to "
        "stages without touching the model code.",
        SETUP,
        """import flax.linen as nn

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(16)(nn.LayerNorm()(x)))

class Model(nn.Module):   # no MultiMesh anywhere in here
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embed")(x)
        for i in range(4):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(4, name="logits")(x)

model = Model()
x = jax.random.normal(jax.random.key(0), (8, 8))
mmesh = mm.make_mesh((4, 2), ("stage", "data"))
rules = {r"layers_(\\d+)": lambda m: int(m[1]), r"embed": 0, r"logits": 3}""",
        "#md\nInitialise the parameters directly on their submeshes (nothing moves):",
        """init = mm.jit(model.init, mesh=mmesh, task_rules=rules)
params = init(jax.random.key(1), x)
assert init.lower(jax.random.key(1), x).plan.transfers == []
for name in ["embed", "layers_0", "layers_2", "logits"]:
    leaf = jax.tree.leaves(params["params"][name])[0]
    print(name, sorted(d.id for d in leaf.sharding.device_set))""",
        "#md\nA model that declares how its kernels are sharded (here: split over `data`, "
        "FSDP-style) gets them created that way, in place, on each stage's submesh, with "
        "`mm.flax.init`:",
        """class ShardedBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = nn.with_partitioning(nn.initializers.lecun_normal(), ("data", None))
        return x + jnp.tanh(nn.Dense(16, kernel_init=k)(x))

class ShardedModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embed")(x)
        for i in range(4):
            x = ShardedBlock(name=f"layers_{i}")(x)
        return nn.Dense(4, name="logits")(x)

sparams = mm.flax.init(ShardedModel().init, mesh=mmesh, task_rules=rules)(jax.random.key(1), x)
for i in range(4):
    k = sparams["params"][f"layers_{i}"]["Dense_0"]["kernel"].unbox()
    print(f"layers_{i} kernel: devices {sorted(d.id for d in k.sharding.device_set)}, spec {k.sharding.spec}")
    assert k.sharding.spec[0] == "data" and not k.sharding.is_fully_replicated""",
        """def loss(p, x):
    return (model.apply(p, x) ** 2).mean()

f = mm.jit(jax.value_and_grad(loss), mesh=mmesh, task_rules=rules)
print(f.lower(params, x).as_text())""",
        """val, grads = f(params, x)
with mmesh:
    rv, rg = jax.jit(jax.value_and_grad(loss))(jax.device_get(params), x)
np.testing.assert_allclose(float(val), float(rv), rtol=1e-5)
for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(rg)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
print("matches jax.jit")""",
    ],
    "06-pipeline-schedules.ipynb": [
        "#md\n# Pipeline schedules\n\nGPipe, 1F1B, interleaved 1F1B and zero-bubble H1: "
        "simulated timelines and bubbles, then a measured run and its peak memory.",
        SETUP,
        """import matplotlib.pyplot as plt
from multimesh import schedules as S

S_, M = 4, 8
sims = {
    "gpipe": S.simulate("gpipe", S_, M),
    "1f1b": S.simulate("1f1b", S_, M),
    "interleaved (V=2)": S.simulate(S.Interleaved1F1B(num_chunks=2), S_, M),
    "zero-bubble-h1": S.simulate("zero-bubble-h1", S_, M),
}
for name, tl in sims.items():
    print(f"{name:18s} bubble {tl.bubble_fraction:.3f}  peak in-flight {tl.peak_in_flight}")""",
        "#md\nThe closed forms hold: GPipe and 1F1B have bubble (S−1)/(M+S−1); 1F1B holds "
        "at most S − s microbatches on stage s (GPipe: M); interleaving with V chunks cuts "
        "the bubble by about V; zero-bubble H1 is below 1F1B at the same memory.",
        """assert abs(sims["gpipe"].bubble_fraction - (S_ - 1) / (M + S_ - 1)) < 1e-9
assert abs(sims["1f1b"].bubble_fraction - (S_ - 1) / (M + S_ - 1)) < 1e-9
assert sims["1f1b"].peak_in_flight == [4, 3, 2, 1] and sims["gpipe"].peak_in_flight == [8] * 4
assert abs(sims["interleaved (V=2)"].bubble_fraction - (S_ - 1) / (2 * M + S_ - 1)) < 1e-9
assert sims["zero-bubble-h1"].bubble_fraction < sims["1f1b"].bubble_fraction
assert sims["zero-bubble-h1"].peak_in_flight == sims["1f1b"].peak_in_flight""",
        """fig, axes = plt.subplots(4, 1, figsize=(12, 10))
for ax, (name, tl) in zip(axes, sims.items()):
    tl.plot(ax=ax, title=f"{name}: bubble {tl.bubble_fraction:.1%}")
plt.tight_layout(); plt.show()""",
        "#md\nA real run: a 4-stage residual MLP, one device per stage, M = 8. `record` "
        "measures each fragment and the live buffers per submesh.",
        """mesh4 = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
ws = [jax.random.normal(k, (64, 64)) / 8 for k in jax.random.split(jax.random.key(0), 4)]
x = jax.random.normal(jax.random.key(1), (16, 64))

def loss(ws, x):
    h = x
    for i, w in enumerate(ws):
        with mm.task(f"s{i}", stage=i):
            h = h + jnp.tanh(h @ w)
    return (h ** 2).mean()

measured = {}
for name in ["gpipe", "1f1b", "zero-bubble-h1"]:
    g = mm.microbatch(jax.value_and_grad(loss), M, argnums=1, schedule=name)
    f = mm.jit(g, mesh=mesh4)
    f(ws, x)  # compile
    out, tl = f.record(ws, x)
    measured[name] = tl
    print(f"{name:15s} peak live microbatches per stage {tl.peak_in_flight}, "
          f"stage-0 peak bytes {tl.peak_live_bytes[0]}")
assert measured["1f1b"].peak_in_flight[0] <= S_ + 1 < measured["gpipe"].peak_in_flight[0] + 1""",
        """fig, axes = plt.subplots(3, 1, figsize=(12, 7))
for ax, (name, tl) in zip(axes, measured.items()):
    tl.plot(ax=ax, title=f"measured {name}")
plt.tight_layout(); plt.show()
measured["1f1b"].to_chrome_trace("trace-1f1b.json")  # open in ui.perfetto.dev""",
    ],
    "07-multi-process.ipynb": [
        "#md\n# Multi-process: one script, one process or many\n\n"
        "`mm.distributed.initialize()` joins a `jax.distributed` job when there is one "
        "(the launcher, SLURM, Open MPI) and does nothing otherwise, so the same script runs "
        "as one process or as several. Here we run `multimesh.examples.train_multiprocess` both "
        "ways "
        "and compare the losses.",
        """import os
import re
import subprocess
import sys

script = ["-m", "multimesh.examples.train_multiprocess"]
env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
env["JAX_PLATFORMS"] = "cpu"

def losses(text):
    return [float(v) for v in re.findall(r"step \\d+ loss ([0-9.]+)", text)]""",
        "#md\nOne process with 8 virtual CPU devices:",
        """one = subprocess.run([sys.executable, *script, "--steps", "3"], env=env,
                     capture_output=True, text=True, timeout=300)
print(one.stdout)""",
        "#md\nTwo processes with 4 devices each, started by the launcher (each output line "
        "carries its rank; stages 0-1 live in process 0, stages 2-3 in process 1):",
        """two = subprocess.run([sys.executable, "-m", "multimesh.launch", "--nproc", "2",
                      "--devices-per-process", "4", *script, "--steps", "3"],
                     env=env, capture_output=True, text=True, timeout=300)
print("\\n".join(l for l in two.stdout.splitlines() if "step" in l or "process 0:" in l))
assert two.returncode == 0, two.stderr[-2000:]
assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 3
print("same losses:", losses(two.stdout))""",
    ],
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        nbformat.write(nb(cells), OUT / name)
        print("wrote", OUT / name)


if __name__ == "__main__":
    main()

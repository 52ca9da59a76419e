"""Pipeline-parallel training that runs unchanged on 1 process or many.

    python examples/train_multiprocess.py                      # 1 process, 8 CPU devices
    python -m multimesh.launch --nproc 2 --devices-per-process 4 \\
        examples/train_multiprocess.py                         # 2 processes x 4 devices
    sbatch scripts/slurm.sbatch examples/train_multiprocess.py  # a cluster, 1 per GPU
"""

import argparse

import multimesh as mm

multi = mm.distributed.initialize()  # a no-op in a plain single process

import jax  # noqa: E402

if not multi:  # 8 virtual CPU devices when no GPU (no effect on GPU runs)
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    n = jax.device_count()
    mmesh = mm.make_mesh((4, n // 4), ("stage", "data"))  # over every process's devices
    print(mm.distributed.process_map(mmesh))

    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"layer{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    grad_fn = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2), reduce="mean")
    opt = optax.adam(1e-2)

    def train_step(state, x, y):
        ws, o = state
        val, g = grad_fn(ws, x, y)
        u, o = opt.update(g, o, ws)
        return (optax.apply_updates(ws, u), o), val

    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(16, 16)).astype(np.float32) / 4 for _ in range(4)]
    x = rng.normal(size=(32, 16)).astype(np.float32)
    y = np.sin(x)
    step = mm.jit(train_step, mesh=mmesh)
    state = (ws, opt.init(ws))
    for i in range(args.steps):
        state, loss_value = step(state, x, y)
        if jax.process_index() == 0:  # works wherever the loss lives
            print(f"step {i} loss {float(mm.distributed.to_host(loss_value)):.6f}")


if __name__ == "__main__":
    main()

"""MultiMesh demo: two tasks on two submeshes inside one jitted training step.

Run: python examples/demo.py  (uses 8 virtual CPU devices; no GPU needed)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import multimesh as mm  # noqa: E402


def loss(params, x):
    with mm.task("embed", stage=0):
        h = jnp.tanh(x @ params["w0"])
        h = jax.lax.with_sharding_constraint(h, jax.P("data", "model"))  # SPMD inside the task
    with mm.task("head", stage=1):
        y = h @ params["w1"]
    return jnp.mean(y**2)  # untagged: placed next to its data


def where(x, mmesh):
    ids = sorted(d.id for d in x.sharding.device_set)
    for i in range(mmesh.num_stages):
        if ids == sorted(d.id for d in mmesh.submesh(i).devices.flat):
            return f"submesh {i} (devices {ids})"
    return f"devices {ids}"


def main() -> None:
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {"w0": jax.random.normal(k0, (16, 32)) / 4, "w1": jax.random.normal(k1, (32, 8)) / 6}
    x = jax.random.normal(k2, (8, 16))

    step = mm.jit(jax.value_and_grad(loss), mesh=mmesh)
    print(step.lower(params, x).as_text(), "\n")
    val, grads = step(params, x)

    with mmesh:  # the reference: the same function under plain jax.jit
        ref_val, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x)

    print(f"loss      {float(val):.6f} on {where(val, mmesh)}")
    for name, g in grads.items():
        print(f"grad {name:4s} shape {g.shape} on {where(g, mmesh)}, spec {g.sharding.spec}")
    np.testing.assert_allclose(np.asarray(val), np.asarray(ref_val), rtol=1e-6)
    for name in grads:
        np.testing.assert_allclose(
            np.asarray(grads[name]), np.asarray(ref_grads[name]), rtol=1e-5, atol=1e-7
        )
    print("\nmatches jax.jit: loss and gradients agree (rtol 1e-5)")


if __name__ == "__main__":
    main()

"""A small GPT-style decoder in Flax NNX and in Flax Linen, pipelined with MultiMesh.

Token + position embedding, ``layers`` pre-norm attention + MLP blocks, final norm,
tied or untied logits, next-token cross-entropy. The NNX model places its parts with
``mm.flax.task``; the Linen model is unmodified and placed with ``task_rules`` on its
module names (``embed``, ``layers_<i>``, ``head``). Tensor parallelism inside a stage:
with ``tp=True`` the MLP hidden activations and attention heads are sharded over the
``model`` axis (and the batch over ``data``) with ordinary sharding constraints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import multimesh as mm


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    d: int = 32
    heads: int = 4
    layers: int = 4
    stages: int = 4  # pipeline stages (task stages; with interleaving, > submeshes)
    tied: bool = False
    tp: bool = False  # shard heads / MLP hidden over "model", batch over "data"
    dp: bool = False  # shard the batch over "data"
    fsdp: bool = False  # also shard each block's kernels over fsdp_axis (ZeRO-3 style)
    remat: bool = False  # recompute each block in the backward pass (jax.checkpoint)
    mlp: int = 0  # MLP hidden width (0: 4 x d)
    batch_axes: tuple[str, ...] = ("data",)  # mesh axes the batch is split over
    fsdp_axis: str = "data"  # the mesh axis FSDP shards kernels over

    def stage_of_layer(self, i: int) -> int:
        return i * self.stages // self.layers


def _constrain(x: jax.Array, cfg: Config, last: str | None) -> jax.Array:
    if not (cfg.tp or cfg.dp):
        return x
    batch = cfg.batch_axes[0] if len(cfg.batch_axes) == 1 else tuple(cfg.batch_axes)
    spec = [batch] + [None] * (x.ndim - 1)
    if cfg.tp and last is not None:
        spec[-1] = last
    return jax.lax.with_sharding_constraint(x, jax.P(*spec))


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    b, t, d = q.shape
    hd = d // heads

    def split(z: jax.Array) -> jax.Array:
        return z.reshape(b, t, heads, hd)

    att = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(hd)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(b, t, d)


def cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (predict tokens[:, 1:] from positions [:, :-1])."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tgt = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))


def train_step(loss: Any, optimizer: Any, num_microbatches: int, schedule: Any = "1f1b") -> Any:
    """``step((params, opt_state), tokens) -> ((params, opt_state), loss)``: gradients
    accumulated over microbatches in ``schedule``'s order, then one optimizer update."""
    grad_fn = mm.microbatch(
        jax.value_and_grad(loss), num_microbatches, argnums=1, schedule=schedule, reduce="mean"
    )

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        p, o = state
        val, grads = grad_fn(p, tokens)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), val

    return step


# --- NNX ------------------------------------------------------------------------------


class Embed(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.tok = nnx.Embed(cfg.vocab, cfg.d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq, cfg.d)) * 0.02)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return _constrain(self.tok(tokens) + self.pos[...][None], self.cfg, None)


def _kernel_init(cfg: Config) -> Any:
    init = nnx.initializers.lecun_normal()
    # FSDP: kernels stored sharded over fsdp_axis on their stage's submesh (declared as NNX
    # sharding metadata, so mm.flax.create makes them sharded in place)
    return nnx.with_partitioning(init, (cfg.fsdp_axis, None)) if cfg.fsdp else init


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        k = _kernel_init(cfg)
        self.ln1 = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.qkv = nnx.Linear(cfg.d, 3 * cfg.d, kernel_init=k, rngs=rngs)
        self.out = nnx.Linear(cfg.d, cfg.d, kernel_init=k, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d, rngs=rngs)
        hidden = cfg.mlp or 4 * cfg.d
        self.up = nnx.Linear(cfg.d, hidden, kernel_init=k, rngs=rngs)
        self.down = nnx.Linear(hidden, cfg.d, kernel_init=k, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        q, k, v = jnp.split(_constrain(self.qkv(self.ln1(x)), cfg, "model"), 3, axis=-1)
        x = x + self.out(_attention(q, k, v, cfg.heads))
        h = _constrain(jax.nn.gelu(self.up(self.ln2(x))), cfg, "model")
        return _constrain(x + self.down(h), cfg, None)


class Head(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.logits = None if cfg.tied else nnx.Linear(cfg.d, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, table: jax.Array | None = None) -> jax.Array:
        h = self.ln(x)
        return h @ table.T if self.logits is None else self.logits(h)


class GPT(nnx.Module):
    """The NNX decoder; each part wrapped in ``mm.flax.task`` for its stage."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = mm.flax.task(Embed(cfg, rngs), stage=0, name="embed")
        self.blocks = nnx.List(
            [
                mm.flax.task(Block(cfg, rngs), stage=cfg.stage_of_layer(i), name=f"layers_{i}")
                for i in range(cfg.layers)
            ]
        )
        self.head = mm.flax.task(Head(cfg, rngs), stage=cfg.stages - 1, name="head")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for b in self.blocks:
            x = nnx.remat(lambda blk, y: blk(y))(b, x) if self.cfg.remat else b(x)
        return self.head(x, self.embed.tok.embedding[...] if self.cfg.tied else None)


def nnx_train_step(
    cfg: Config, model: GPT, optimizer: Any, num_microbatches: int, schedule: Any = "1f1b"
) -> tuple[Any, Any]:
    """(step, state): ``step(state, tokens) -> (state, loss)`` for ``mm.jit`` or
    ``jax.jit``; ``state = (params, opt_state)``."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        return cross_entropy(nnx.merge(graphdef, p)(tokens), tokens)

    step = train_step(loss, optimizer, num_microbatches, schedule)
    return step, (params, optimizer.init(params))


# --- Linen ----------------------------------------------------------------------------


class LinenBlock(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = nn.LayerNorm()(x)
        q, k, v = jnp.split(_constrain(nn.Dense(3 * cfg.d)(h), cfg, "model"), 3, axis=-1)
        x = x + nn.Dense(cfg.d)(_attention(q, k, v, cfg.heads))
        h = _constrain(jax.nn.gelu(nn.Dense(4 * cfg.d)(nn.LayerNorm()(x))), cfg, "model")
        return _constrain(x + nn.Dense(cfg.d)(h), cfg, None)


class LinenGPT(nn.Module):
    """The Linen decoder, unmodified: place it with :func:`linen_rules`."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.d))
        x = _constrain(embed(tokens) + pos[None], cfg, None)
        block = nn.remat(LinenBlock) if cfg.remat else LinenBlock
        for i in range(cfg.layers):
            x = block(cfg, name=f"layers_{i}")(x)
        x = nn.LayerNorm(name="final_norm")(x)
        if cfg.tied:  # the shared table is used on the first and the last stage
            with jax.named_scope("logits"):
                return x @ embed.embedding.T
        return nn.Dense(cfg.vocab, use_bias=False, name="logits")(x)


def linen_rules(cfg: Config) -> dict[str, Any]:
    """task_rules placing LinenGPT: embedding on stage 0, layers by index, head last."""
    return {
        r"^layers_(\d+)$": lambda m: cfg.stage_of_layer(int(m[1])),
        r"^(embed|pos)$": 0,
        r"^(final_norm|logits)$": cfg.stages - 1,
    }


def linen_train_step(
    cfg: Config, model: LinenGPT, optimizer: Any, num_microbatches: int, schedule: Any = "1f1b"
) -> Any:
    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        return cross_entropy(model.apply(p, tokens), tokens)

    return train_step(loss, optimizer, num_microbatches, schedule)


def synthetic_batch(cfg: Config, batch: int, seed: int = 0) -> jax.Array:
    """Token sequences with structure to learn (each token is the previous plus one)."""
    start = jax.random.randint(jax.random.key(seed), (batch, 1), 0, cfg.vocab)
    return (start + jnp.arange(cfg.seq)[None]) % cfg.vocab

"""The pure training step: next-token loss plus DeepSeek-V3's MTP loss, AdamW, clipping.

The model runs exactly as it does when serving: one ragged paged step over B rows of L tokens
(`StepBatch`), with fresh zero caches allocated inside the loss, so gradients flow through the
paged K/V writes and gathers and the SSM scan. The batch's index arrays are static: built once
on the host, only `token_ids` changes.

MTP alignment (DeepSeek-V3, section 2.2): for a window `x[0 .. L+D]`, the main model reads
`x[0:L]` and predicts `x[1:L+1]`; depth k (0-based) combines the previous depth's output at
position t with the embedding of `x[t+k+1]` and predicts `x[t+k+2]`. The loss is
`main + (lambda / D) * sum_k mtp_k`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from metrale_jax.model.batch import StepBatch
from metrale_jax.model.caches import allocate_caches
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static shape of a training batch: B rows of L tokens in paged caches."""

    batch_size: int  # B rows
    seq_len: int     # L tokens per row
    block_size: int = 16

    @property
    def blocks_per_row(self) -> int:
        return -(-self.seq_len // self.block_size)

    def step_batch(self) -> StepBatch:
        """Row r owns KV blocks 1 + r*bpr .. and SSM slot r + 1 (block 0, slot 0 are null)."""
        bpr = self.blocks_per_row
        rows = [RowChunk([0] * self.seq_len, 0, list(range(1 + r * bpr, 1 + (r + 1) * bpr)),
                         r + 1) for r in range(self.batch_size)]
        shape = StepShape(self.batch_size * self.seq_len, self.batch_size, self.seq_len, bpr)
        return jax.tree.map(jnp.asarray, build_step_batch(rows, shape, self.block_size))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))


def forward_losses(model: HybridLM, batch: StepBatch, tokens: jax.Array, geom: Geometry,
                   ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """Main and per-depth MTP losses on `tokens [B, L + 1 + D]`; also every head's greedy
    tokens [B*L] (main first), for acceptance statistics."""
    cfg, L = model.cfg, geom.seq_len
    caches = allocate_caches(cfg, 1 + geom.batch_size * geom.blocks_per_row, geom.block_size,
                             geom.batch_size + 1, with_mtp=True)
    flat = lambda a: a.reshape(-1)  # noqa: E731
    batch = dataclasses.replace(batch, token_ids=flat(tokens[:, :L]))
    hidden, caches = model(batch, caches)
    logits = model.logits(hidden)
    losses = [cross_entropy(logits, flat(tokens[:, 1:L + 1]))]
    greedy = [jnp.argmax(logits, -1)]
    h = hidden
    for k in range(cfg.num_mtp_modules):
        h, normed, caches = model.mtp_forward(k, h, flat(tokens[:, k + 1:k + 1 + L]), batch,
                                              caches)
        logits = model.logits(normed)
        losses.append(cross_entropy(logits, flat(tokens[:, k + 2:k + 2 + L])))
        greedy.append(jnp.argmax(logits, -1))
    return losses[0], losses[1:], greedy


def total_loss(main: jax.Array, mtp: list[jax.Array], mtp_weight: float) -> jax.Array:
    if not mtp:
        return main
    return main + (mtp_weight / len(mtp)) * sum(mtp)


def make_optimizer(lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                   weight_decay: float, grad_clip: float) -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay to `min_lr_ratio * lr`, after clipping the
    global gradient norm. Matrices decay; norms, biases and SSM scalars do not."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1), lr * min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                   mask=decay_mask))


class Steps:
    """The split model and its jitted train and eval steps over flat parameter leaves."""

    def __init__(self, model: HybridLM, geom: Geometry, optimizer: optax.GradientTransformation,
                 mtp_weight: float):
        self.graphdef, state = nnx.split(model)
        leaves, self.treedef = jax.tree.flatten(state)
        self.init_leaves = leaves
        self.geom, self.optimizer, self.mtp_weight = geom, optimizer, mtp_weight
        self.batch = geom.step_batch()
        self.train = jax.jit(self._train, donate_argnums=(0, 1))
        self.eval = jax.jit(self._eval)

    def model(self, leaves: list[jax.Array]) -> HybridLM:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

    def _loss(self, leaves, batch, tokens):
        main, mtp, _ = forward_losses(self.model(leaves), batch, tokens, self.geom)
        return total_loss(main, mtp, self.mtp_weight), jnp.stack([main, *mtp])

    def _train(self, leaves, opt_state, batch, tokens):
        (loss, parts), grads = jax.value_and_grad(self._loss, has_aux=True)(leaves, batch, tokens)
        updates, opt_state = self.optimizer.update(grads, opt_state, leaves)
        return optax.apply_updates(leaves, updates), opt_state, loss, parts, \
            optax.tree.norm(grads)

    def _eval(self, leaves, batch, tokens):
        """Per-head losses [1 + D]; acceptance counts [D, 2]: MTP draft == true token, and
        draft == the greedy token the previous heads imply (main model's greedy next)."""
        main, mtp, greedy = forward_losses(self.model(leaves), batch, tokens, self.geom)
        L, b = self.geom.seq_len, self.geom.batch_size
        counts = []
        for k in range(len(mtp)):
            draft = greedy[k + 1].reshape(b, L)
            truth = tokens[:, k + 2:k + 2 + L]
            # The main model's greedy token for the same target position (t + k + 2) is its
            # prediction at position t + k + 1, teacher-forced on the true prefix.
            main_next = greedy[0].reshape(b, L)[:, k + 1:]
            counts.append(jnp.stack([jnp.sum(draft == truth),
                                     jnp.sum(draft[:, :L - k - 1] == main_next)]))
        counts = jnp.stack(counts) if counts else jnp.zeros((0, 2), jnp.int32)
        return jnp.stack([main, *mtp]), counts


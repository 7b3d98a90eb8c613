"""The training loop: sample, step, evaluate, checkpoint, resume.

A run's whole state is (parameters, optimiser state, step, data position); the data order is
a pure function of (seed, position) (see `data.py`) and the model has no dropout, so those
four restore a run exactly: N steps straight and N/2 + restore + N/2 give bit-identical
parameters. Checkpoints are orbax step directories holding every array of the state as one
flat pytree plus a JSON record (step, position, seed, configs).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from metrale_jax.config import ModelConfig
from metrale_jax.loader.checkpoint import config_to_json
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.train.config import TrainConfig
from metrale_jax.train.data import WindowSampler, eval_windows
from metrale_jax.train.step import Geometry, Steps, make_optimizer


@dataclasses.dataclass
class Evaluation:
    losses: list[float]      # [1 + D] mean cross-entropy: main head, then each MTP depth
    accept_true: list[float]  # [D] fraction of MTP greedy drafts equal to the true token
    accept_main: list[float]  # [D] ... equal to the main model's greedy token there
    tokens: int               # target tokens scored per head

    @property
    def loss(self) -> float:
        return self.losses[0]

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.losses[0]))


def evaluate(steps: Steps, leaves: list[jax.Array], batches: list[np.ndarray]) -> Evaluation:
    """Teacher-forced losses and MTP acceptance over `batches` of windows."""
    total, counts = None, None
    for tokens in batches:
        losses, c = steps.eval(leaves, steps.batch, jnp.asarray(tokens, jnp.int32))
        losses, c = np.asarray(losses, np.float64), np.asarray(c, np.int64)
        total = losses if total is None else total + losses
        counts = c if counts is None else counts + c
    n = len(batches)
    b, length = steps.geom.batch_size, steps.geom.seq_len
    depths = counts.shape[0]
    return Evaluation(
        losses=[float(x) for x in total / n],
        accept_true=[float(counts[k, 0] / (n * b * length)) for k in range(depths)],
        accept_main=[float(counts[k, 1] / (n * b * (length - k - 1))) for k in range(depths)],
        tokens=n * b * length)


class Trainer:
    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, train_stream: np.ndarray,
                 val_stream: np.ndarray, checkpoint_dir: str | pathlib.Path | None = None):
        self.model_cfg, self.cfg = model_cfg, cfg
        window = cfg.window(model_cfg)
        self.sampler = WindowSampler(train_stream, window, cfg.seed)
        self.val_batches = eval_windows(val_stream, window, cfg.batch_size)
        if not self.val_batches:
            raise ValueError(f"validation stream of {len(val_stream)} tokens holds no batch of "
                             f"{cfg.batch_size} windows of {window}")
        optimizer = make_optimizer(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio,
                                   cfg.weight_decay, cfg.grad_clip)
        model = HybridLM(model_cfg, nnx.Rngs(cfg.seed))
        self.steps = Steps(model, Geometry(cfg.batch_size, cfg.seq_len, cfg.block_size),
                           optimizer, cfg.mtp_weight)
        self.leaves = self.steps.init_leaves
        self.opt_state = optimizer.init(self.leaves)
        self.step, self.position = 0, 0
        self.history: list[dict] = []
        self.manager = None
        if checkpoint_dir is not None:
            self.manager = ocp.CheckpointManager(
                pathlib.Path(checkpoint_dir).absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    # ------------------------------------------------------------------ state and checkpoints
    def _arrays(self) -> dict[str, jax.Array]:
        flat = jax.tree.leaves((self.leaves, self.opt_state))
        return {f"{i:05d}": x for i, x in enumerate(flat)}

    def save(self) -> None:
        if self.manager is None:
            raise ValueError("checkpoint_dir: the trainer was built without one")
        meta = {"step": self.step, "position": self.position, "seed": self.cfg.seed,
                "train_config": dataclasses.asdict(self.cfg),
                "model_config": config_to_json(self.model_cfg), "history": self.history}
        self.manager.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._arrays()), meta=ocp.args.JsonSave(meta)),
            force=True)
        self.manager.wait_until_finished()  # the next step donates these buffers

    def restore(self, step: int | None = None) -> bool:
        """Resume from `step` (default: the latest checkpoint); False when there is none."""
        if self.manager is None:
            return False
        step = self.manager.latest_step() if step is None else step
        if step is None:
            return False
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._arrays())
        got = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        meta = got["meta"]
        if meta["model_config"] != config_to_json(self.model_cfg):
            raise ValueError(f"checkpoint step {step}: saved for another model config")
        if meta["seed"] != self.cfg.seed:
            raise ValueError(f"seed: checkpoint step {step} used seed {meta['seed']}, "
                             f"this run {self.cfg.seed}")
        treedef = jax.tree.structure((self.leaves, self.opt_state))
        arrays = [got["state"][k] for k in sorted(got["state"])]
        self.leaves, self.opt_state = jax.tree.unflatten(treedef, arrays)
        self.step, self.position = meta["step"], meta["position"]
        self.history = meta.get("history", [])
        return True

    def model(self) -> HybridLM:
        return self.steps.model(self.leaves)

    # ------------------------------------------------------------------ the loop
    def evaluate(self, max_batches: int | None = None) -> Evaluation:
        return evaluate(self.steps, self.leaves, self.val_batches[:max_batches])

    def train(self, until: int | None = None, progress: bool = True) -> None:
        """Run steps until `until` (default: the configured total), evaluating and
        checkpointing at their intervals and at the end."""
        cfg = self.cfg
        until = cfg.steps if until is None else min(until, cfg.steps)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        bar = tqdm(total=until, initial=self.step, disable=not progress, unit="step",
                   dynamic_ncols=True, mininterval=5.0)
        last = time.perf_counter()
        while self.step < until:
            tokens = jnp.asarray(self.sampler.batch(self.position, cfg.batch_size), jnp.int32)
            self.leaves, self.opt_state, loss, parts, gnorm = self.steps.train(
                self.leaves, self.opt_state, self.steps.batch, tokens)
            self.step += 1
            self.position += cfg.batch_size
            now = time.perf_counter()
            if progress:
                parts = np.asarray(parts)
                bar.set_postfix(loss=f"{float(loss):.3f}", main=f"{parts[0]:.3f}",
                                tok_s=f"{tokens_per_step / (now - last):.0f}", refresh=False)
                bar.update(1)
            last = now
            if self.step % cfg.eval_every == 0 or self.step == until:
                self._log_eval(bar, float(loss), float(gnorm))
            if self.manager is not None and (self.step % cfg.checkpoint_every == 0
                                             or self.step == until):
                self.save()
        bar.close()

    def _log_eval(self, bar, loss: float, gnorm: float) -> None:
        ev = self.evaluate(self.cfg.eval_batches)
        record = {"step": self.step, "train_loss": loss, "grad_norm": gnorm,
                  "val_losses": ev.losses, "val_accept_true": ev.accept_true}
        self.history.append(record)
        bar.write(f"step {self.step}: train {loss:.4f} val {ev.loss:.4f} "
                  f"mtp {[round(x, 4) for x in ev.losses[1:]]} "
                  f"accept {[round(x, 3) for x in ev.accept_true]} |g| {gnorm:.2f}")

"""The demo: a real digits classifier trained with checkpoints kept by checkpoint-store.

Data: scikit-learn's digits set (1,797 real 8x8 images shipped inside the
package, no download), split 60/20/20 into train/validation/test with a
fixed seed. Model: a one-hidden-layer MLP in numpy trained by mini-batch SGD
with momentum. Each epoch reports the validation accuracy and a checkpoint
(weights, optimizer state, epoch, RNG state); retention keeps the best
``num_to_keep`` by ``val_accuracy``. ``train_digits`` is a plain function
trainable, so it runs the same under ``session.start`` or a ``TrialRunner``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpoint_store import Checkpoint, session

DEFAULTS: dict[str, Any] = {
    "lr": 0.05,
    "momentum": 0.9,
    "hidden": 64,
    "batch_size": 32,
    "epochs": 15,
    "seed": 0,
    "epoch_delay_s": 0.0,
    "verbose": False,
}


@dataclass(frozen=True)
class Digits:
    """Standardised features (N x 64 float64) and labels (N int64) per split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(seed: int = 0) -> Digits:
    """The digits data, shuffled with ``seed`` and split 60/20/20."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = data.data.astype(np.float64) / 16.0
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_train, n_val = int(0.6 * len(x)), int(0.2 * len(x))
    mean = x[:n_train].mean(axis=0)
    std = x[:n_train].std(axis=0) + 1e-6
    x = (x - mean) / std
    return Digits(
        x[:n_train], y[:n_train],
        x[n_train : n_train + n_val], y[n_train : n_train + n_val],
        x[n_train + n_val :], y[n_train + n_val :],
    )


def init_params(rng: np.random.Generator, hidden: int, n_in: int = 64, n_out: int = 10) -> dict:
    return {
        "w1": rng.normal(0, np.sqrt(2.0 / n_in), (n_in, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0, np.sqrt(1.0 / hidden), (hidden, n_out)),
        "b2": np.zeros(n_out),
    }


def _forward(params: Mapping[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    logits = h @ params["w2"] + params["b2"]
    return h, logits


def predict(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return _forward(params, x)[1].argmax(axis=1)


def accuracy(params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((predict(params, x) == y).mean())


def train_epoch(
    params: dict, velocity: dict, x: np.ndarray, y: np.ndarray, *,
    lr: float, momentum: float, batch_size: int, rng: np.random.Generator,
) -> float:
    """One pass of SGD with momentum over shuffled mini-batches; returns the mean loss."""
    order = rng.permutation(len(x))
    losses = []
    for start in range(0, len(x), batch_size):
        idx = order[start : start + batch_size]
        xb, yb = x[idx], y[idx]
        h, logits = _forward(params, xb)
        logits = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        losses.append(-np.log(p[np.arange(len(yb)), yb] + 1e-12).mean())
        d = p
        d[np.arange(len(yb)), yb] -= 1.0
        d /= len(yb)
        grads = {"w2": h.T @ d, "b2": d.sum(axis=0)}
        dh = (d @ params["w2"].T) * (h > 0)
        grads["w1"] = xb.T @ dh
        grads["b1"] = dh.sum(axis=0)
        for k in params:
            velocity[k] = momentum * velocity[k] - lr * grads[k]
            params[k] += velocity[k]
    return float(np.mean(losses))


def save_state(directory: str, params: Mapping, velocity: Mapping, epoch: int,
               rng: np.random.Generator) -> None:
    """Write weights, optimizer state, epoch and RNG state as ``model.npz`` + ``trainer.json``."""
    np.savez(
        os.path.join(directory, "model.npz"),
        **{f"param_{k}": v for k, v in params.items()},
        **{f"velocity_{k}": v for k, v in velocity.items()},
    )
    import json

    with open(os.path.join(directory, "trainer.json"), "w") as f:
        json.dump({"epoch": epoch, "rng": rng.bit_generator.state}, f)


def load_state(directory: str) -> tuple[dict, dict, int, np.random.Generator]:
    """Inverse of :func:`save_state`: ``(params, velocity, epoch, rng)``."""
    import json

    with np.load(os.path.join(directory, "model.npz")) as z:
        params = {k[len("param_"):]: z[k] for k in z.files if k.startswith("param_")}
        velocity = {k[len("velocity_"):]: z[k] for k in z.files if k.startswith("velocity_")}
    with open(os.path.join(directory, "trainer.json")) as f:
        trainer = json.load(f)
    rng = np.random.default_rng()
    rng.bit_generator.state = trainer["rng"]
    return params, velocity, int(trainer["epoch"]), rng


def train_digits(config: Mapping[str, Any] | None = None) -> None:
    """Function trainable: train the MLP, reporting every epoch to the active session.

    Resumes from ``session.get_checkpoint()`` when there is one. Reported
    metrics: ``epoch`` (1-based), ``train_loss``, ``val_accuracy``.
    """
    cfg = {**DEFAULTS, **(config or {})}
    data = load_digits(int(cfg["seed"]))
    start = session.get_checkpoint()
    if start is not None:
        with start.as_directory() as d:
            params, velocity, done, rng = load_state(d)
        print(f"Resumed from epoch {done} ({start.uri})", flush=True)
    else:
        rng = np.random.default_rng(int(cfg["seed"]))
        params = init_params(rng, int(cfg["hidden"]))
        velocity = {k: np.zeros_like(v) for k, v in params.items()}
        done = 0
    for epoch in range(done + 1, int(cfg["epochs"]) + 1):
        loss = train_epoch(
            params, velocity, data.x_train, data.y_train,
            lr=float(cfg["lr"]), momentum=float(cfg["momentum"]),
            batch_size=int(cfg["batch_size"]), rng=rng,
        )
        val = accuracy(params, data.x_val, data.y_val)
        with tempfile.TemporaryDirectory(prefix="digits-ckpt-") as tmp:
            save_state(tmp, params, velocity, epoch, rng)
            checkpoint = Checkpoint.from_directory(tmp)
            checkpoint.set_metadata(
                {"model": "mlp", "framework": "numpy", "hidden": int(cfg["hidden"]),
                 "epoch": epoch}
            )
            session.report(
                {"epoch": epoch, "train_loss": loss, "val_accuracy": val},
                checkpoint=checkpoint,
            )
        if cfg["verbose"]:
            print(f"epoch {epoch:>3}  train_loss {loss:.4f}  val_accuracy {val:.4f}", flush=True)
        if cfg["epoch_delay_s"]:
            time.sleep(float(cfg["epoch_delay_s"]))


def test_accuracy_of(checkpoint: Checkpoint, seed: int = 0) -> float:
    """Load the model from ``checkpoint`` and measure it on the held-out test split."""
    data = load_digits(seed)
    with checkpoint.as_directory() as d:
        params, _, _, _ = load_state(d)
    return accuracy(params, data.x_test, data.y_test)

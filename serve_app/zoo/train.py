"""Brief training loops for the demo presets, on generated data."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from serve_app.padding import pad_right
from serve_app.presets import TrainConfig
from serve_app.tokenization import TextTokenizer
from serve_app.zoo import data
from serve_app.zoo.bert import BertClassifier
from serve_app.zoo.gpt import GPT
from serve_app.zoo.resnet import ResNet

Progress = Callable[[int], None]


def pad_batch(seqs: list[list[int]], pad_id: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Truncate to max_len, then pad exactly as serving does."""
    return pad_right([s[:max_len] for s in seqs], pad_id)


def _optimizer(
    model: torch.nn.Module, tc: TrainConfig, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=tc.lr, total_steps=max(steps, 1), pct_start=0.1)
    return opt, sched


def train_bert(model: BertClassifier, tok: TextTokenizer, tc: TrainConfig, progress: Progress) -> None:
    texts, labels = data.sentiment_dataset(tc.n_train, data.TRAIN_SEED)
    seqs = tok.encode_batch(texts)
    rng = np.random.default_rng(tc.seed)
    opt, sched = _optimizer(model, tc, tc.steps)
    model.train()
    for _ in range(tc.steps):
        idx = rng.integers(0, len(seqs), tc.batch_size)
        ids, mask = pad_batch([seqs[i] for i in idx], tok.pad_id, model.cfg.max_len)
        loss = F.cross_entropy(model(torch.from_numpy(ids), torch.from_numpy(mask)), torch.from_numpy(labels[idx]))
        _step(loss, opt, sched, progress)
    model.eval()


def train_gpt(model: GPT, tok: TextTokenizer, tc: TrainConfig, progress: Progress) -> None:
    stream: list[int] = []
    for line in data.corpus(tc.n_train, data.TRAIN_SEED).split("\n"):
        stream.extend([*tok.encode(line), tok.eos_id])
    tokens = torch.tensor(stream, dtype=torch.long)
    T = min(model.cfg.block_size, 64)
    rng = np.random.default_rng(tc.seed)
    opt, sched = _optimizer(model, tc, tc.steps)
    model.train()
    for _ in range(tc.steps):
        starts = rng.integers(0, len(tokens) - T - 1, tc.batch_size)
        x = torch.stack([tokens[s : s + T] for s in starts])
        y = torch.stack([tokens[s + 1 : s + T + 1] for s in starts])
        B = x.shape[0]
        pos = torch.arange(T).expand(B, T)
        logits, *_ = model(x, pos, torch.ones(B, T, dtype=torch.long), *model.empty_past(B))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        _step(loss, opt, sched, progress)
    model.eval()


def train_resnet(model: ResNet, tc: TrainConfig, progress: Progress) -> None:
    images, labels = data.shapes_dataset(tc.n_train, data.TRAIN_SEED, model.cfg.image_size)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    rng = np.random.default_rng(tc.seed)
    opt, sched = _optimizer(model, tc, tc.steps)
    model.train()
    for _ in range(tc.steps):
        idx = torch.from_numpy(rng.integers(0, len(x_all), tc.batch_size))
        x = x_all[idx]
        if rng.random() < 0.5:  # horizontal flip: every shape here is mirror-symmetric
            x = x.flip(-1)
        loss = F.cross_entropy(model(x), y_all[idx])
        _step(loss, opt, sched, progress)
    model.eval()


@torch.no_grad()
def accuracy_bert(model: BertClassifier, tok: TextTokenizer, n: int, seed: int) -> float:
    texts, labels = data.sentiment_dataset(n, seed)
    ids, mask = pad_batch(tok.encode_batch(texts), tok.pad_id, model.cfg.max_len)
    pred = model(torch.from_numpy(ids), torch.from_numpy(mask)).argmax(-1).numpy()
    return float((pred == labels).mean())


@torch.no_grad()
def accuracy_resnet(model: ResNet, n: int, seed: int) -> float:
    images, labels = data.shapes_dataset(n, seed, model.cfg.image_size)
    pred = model(torch.from_numpy(images)).argmax(-1).numpy()
    return float((pred == labels).mean())


@torch.no_grad()
def gpt_loss(model: GPT, tok: TextTokenizer, n: int, seed: int) -> float:
    stream: list[int] = []
    for line in data.corpus(n, seed).split("\n"):
        stream.extend([*tok.encode(line), tok.eos_id])
    T = min(model.cfg.block_size, 64)
    x = torch.tensor(stream[: (len(stream) - 1) // T * T]).view(-1, T)
    y = torch.tensor(stream[1 : (len(stream) - 1) // T * T + 1]).view(-1, T)
    B = x.shape[0]
    logits, *_ = model(x, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.long), *model.empty_past(B))
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))


def _step(
    loss: torch.Tensor, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, progress: Progress
) -> None:
    """One optimisation step, the same for every family."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    progress(1)

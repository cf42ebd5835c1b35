"""Data the project generates itself: no data set is downloaded.

- Sentiment: templated reviews whose label hinges on negation and on contrast
  ("X but Y" takes Y's polarity), so word counting alone is not enough and a
  deeper encoder earns its accuracy.
- Shapes: procedurally drawn shapes on noisy, cluttered 32x32 images, small
  ones included, so a wider CNN earns its accuracy.
- Corpus: the same review grammar as running text for the GPT.
"""

from __future__ import annotations

import numpy as np

SENTIMENT_LABELS = ["negative", "positive"]
SHAPE_LABELS = ["circle", "square", "triangle", "cross", "ring", "diamond"]

_NOUNS = [
    "food",
    "service",
    "movie",
    "plot",
    "hotel",
    "room",
    "staff",
    "music",
    "price",
    "phone",
    "battery",
    "screen",
    "camera",
    "book",
    "ending",
    "pizza",
    "coffee",
    "game",
    "show",
    "trip",
]
_POS = ["good", "great", "excellent", "lovely", "superb", "fantastic", "pleasant", "solid", "brilliant", "nice"]
_NEG = ["bad", "awful", "terrible", "poor", "horrible", "dull", "boring", "weak", "mediocre", "nasty"]
_ADV = ["", "", "really ", "very ", "quite ", "truly ", "rather ", "pretty "]
_FILLER = ["", "", "honestly , ", "overall , ", "to be fair , ", "i think ", "in short , "]


def _clause(rng: np.random.Generator) -> tuple[str, int]:
    positive = bool(rng.integers(2))
    adj = str(rng.choice(_POS if positive else _NEG))
    noun, adv = str(rng.choice(_NOUNS)), str(rng.choice(_ADV))
    if rng.random() < 0.3:  # negation flips the polarity
        return f"the {noun} was not {adv}{adj}", int(not positive)
    return f"the {noun} was {adv}{adj}", int(positive)


def sentiment_example(rng: np.random.Generator) -> tuple[str, int]:
    """One review and its label (1 = positive)."""
    kind = rng.random()
    a, la = _clause(rng)
    filler = str(rng.choice(_FILLER))
    if kind < 0.35:
        return filler + a, la
    b, lb = _clause(rng)
    if kind < 0.7:
        return f"{filler}{a} but {b}", lb  # contrast: the second clause wins
    if kind < 0.85:
        return f"although {a} , {b}", lb  # concession: the main clause wins
    return f"{b} , although {a}", lb


def sentiment_dataset(n: int, seed: int) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    pairs = [sentiment_example(rng) for _ in range(n)]
    return [t for t, _ in pairs], np.array([y for _, y in pairs], dtype=np.int64)


def corpus(n_sentences: int, seed: int) -> str:
    """Running text for the GPT: reviews joined into short paragraphs."""
    texts, _ = sentiment_dataset(n_sentences, seed)
    return "\n".join(t + " ." for t in texts)


def _shape_mask(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    r = rng.uniform(3.5, size * 0.36)
    cx, cy = rng.uniform(r + 1, size - r - 1, 2)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dx, dy = xx - cx, yy - cy
    theta = rng.uniform(-0.3, 0.3)  # small rotations keep square and diamond apart
    rx, ry = dx * np.cos(theta) - dy * np.sin(theta), dx * np.sin(theta) + dy * np.cos(theta)
    dist = np.hypot(dx, dy)
    if kind == "circle":
        return dist <= r
    if kind == "ring":
        return (dist <= r) & (dist >= r * 0.55)
    if kind == "square":
        return np.maximum(np.abs(rx), np.abs(ry)) <= r * 0.8
    if kind == "diamond":
        return (np.abs(dx) + np.abs(dy)) <= r
    if kind == "cross":
        w = max(1.0, r * 0.3)
        return ((np.abs(rx) <= w) & (np.abs(ry) <= r)) | ((np.abs(ry) <= w) & (np.abs(rx) <= r))
    if kind == "triangle":
        # Upward triangle: inside if below the two slanted edges and above the base.
        return (ry <= r * 0.6) & (ry >= -r + 2 * np.abs(rx) * 0.9)
    raise ValueError(f"unknown shape {kind!r}")


def shape_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (3, size, size) float32 image in [0, 1] showing SHAPE_LABELS[label]."""
    bg = rng.uniform(0.0, 1.0, 3).astype(np.float32)
    fg = rng.uniform(0.0, 1.0, 3).astype(np.float32)
    while np.abs(fg - bg).sum() < 0.6:  # keep the shape visible against the background
        fg = rng.uniform(0.0, 1.0, 3).astype(np.float32)
    img = np.broadcast_to(bg[:, None, None], (3, size, size)).copy()
    mask = _shape_mask(SHAPE_LABELS[label], size, rng)
    img[:, mask] = fg[:, None]
    for _ in range(int(rng.integers(0, 3))):  # clutter: random thin lines
        c = rng.uniform(0.0, 1.0, 3).astype(np.float32)
        if rng.random() < 0.5:
            img[:, int(rng.integers(size)), :] = c[:, None]
        else:
            img[:, :, int(rng.integers(size))] = c[:, None]
    img += rng.normal(0.0, 0.08, img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0)


def shapes_dataset(n: int, seed: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(SHAPE_LABELS), n)
    images = np.stack([shape_image(int(y), size, rng) for y in labels])
    return images, labels.astype(np.int64)


# Seeds: training, validation (calibration) and test splits never overlap.
TRAIN_SEED, VAL_SEED, TEST_SEED = 1, 2, 3

"""Write a small MNIST look-alike in the real IDX format.

The images are rendered digits (Pillow's built-in font at random sizes,
positions and angles, plus noise), so torchvision's own MNIST class reads the
files and a CNN has real shapes to learn. Nothing is downloaded.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049  # IDX headers: unsigned bytes, 3 and 1 dimensions


def render_digit(digit: int, rng: random.Random, noise_rng: np.random.Generator) -> np.ndarray:
    font = ImageFont.load_default(size=rng.randint(18, 24))
    canvas = Image.new("L", (28, 28), 0)
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
    x = (28 - (right - left)) / 2 - left + rng.uniform(-2, 2)
    y = (28 - (bottom - top)) / 2 - top + rng.uniform(-2, 2)
    draw.text((x, y), str(digit), fill=255, font=font, stroke_width=rng.choice([0, 1]), stroke_fill=255)
    canvas = canvas.rotate(rng.uniform(-10, 10), resample=Image.Resampling.BILINEAR)
    pixels = np.asarray(canvas, dtype=np.float32)
    noise = noise_rng.normal(0, 20, size=(28, 28)).astype(np.float32)
    return np.clip(pixels + noise, 0, 255).astype(np.uint8)


def write_idx(images: np.ndarray, labels: np.ndarray, image_path: Path, label_path: Path) -> None:
    with image_path.open("wb") as file:
        file.write(struct.pack(">IIII", IMAGE_MAGIC, len(images), 28, 28))
        file.write(images.tobytes())
    with label_path.open("wb") as file:
        file.write(struct.pack(">II", LABEL_MAGIC, len(labels)))
        file.write(labels.astype(np.uint8).tobytes())


def write_fake_mnist(root: Path, train_count: int, test_count: int, seed: int = 0) -> Path:
    """Create ``root/MNIST/raw`` with the four files torchvision expects; return ``root``."""
    rng, noise_rng = random.Random(seed), np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train_count), ("t10k", test_count)):
        labels = np.array([rng.randrange(10) for _ in range(count)], dtype=np.uint8)
        images = np.stack([render_digit(int(label), rng, noise_rng) for label in labels])
        write_idx(images, labels, raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte")
    return root

"""What the built-in tiny models share: the registry entry type, deterministic building, a byte-level CLIP
tokenizer built in memory, and the training of a tiny VAE on coloured shapes."""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dstune.data.synthetic import SHAPES_NUM_SAMPLES, render_shape
from dstune.hf import quiet_hf_libraries

# The thread count changes float summation order; one thread gives the same bytes whatever the core count (and
# cannot be starved by busy-waiting OpenMP threads when ranks share the cores).
BUILD_THREADS = 1
VAE_SEED = 0
_CLIP_BOS, _CLIP_EOS = 517, 518


class BuiltinError(ValueError):
    """A built-in model that cannot be made: unknown name, or a cache folder that cannot be written."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # as written after `builtin:`
    folder_name: str  # cache folder; carries a version, bumped whenever the build's output changes
    family: str  # the model.family it is meant for
    description: str
    # Writes the pipeline into the (empty) folder; returns facts for the marker. Called with the folders of the
    # built-in models named in `needs` (built first), by name: build(out, needs={name: folder}).
    build: Callable[..., dict]
    needs: tuple[
        str, ...
    ] = ()  # other built-in models whose files this one reuses (e.g. another tiny model's trained VAE)
    # built in a child process with ATen's kernels pinned (dstune.builtin.PINNED_ISA_ENV), so that its random
    # initialisation is the same on every CPU; False builds in the calling process (a test's stand-in build)
    pinned_process: bool = True
    # the trained parts its build gives to the modules it initialises (dstune.builtin.trained: stored with dstune,
    # trained only when `python -m dstune.builtin.trained` regenerates them)
    trained_parts: tuple[str, ...] = ()


@contextmanager
def deterministic_cpu(seed: int, threads: int):
    """Seed torch without disturbing the caller's RNG, and fix the thread count (it changes float sums)."""
    old_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(old_threads)


def save_pipeline(pipeline, out, transformer, facts: dict | None = None) -> dict:
    """Write a built-in's pipeline folder (safetensors, libraries quiet) and return its build facts with the
    transformer's parameter count."""
    with quiet_hf_libraries():
        pipeline.save_pretrained(out, safe_serialization=True)
    return {**(facts or {}), "transformer_parameters": sum(p.numel() for p in transformer.parameters())}


def bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-level alphabet: one printable character per byte value."""
    byte_values = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = byte_values[:], 0
    for value in range(256):
        if value not in byte_values:
            byte_values.append(value)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A byte-level CLIP BPE tokenizer built in memory (519 ids; every string is encodable, nothing downloaded)."""
    from transformers import CLIPTokenizer

    chars = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for suffix in ("", "</w>"):
        for char in chars:
            vocab[char + suffix] = len(vocab)
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("c", "a"), ("ca", "t</w>")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    assert (vocab["<|startoftext|>"], vocab["<|endoftext|>"]) == (_CLIP_BOS, _CLIP_EOS)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_clip_config(hidden_size: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=_CLIP_EOS + 1,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=hidden_size,
        bos_token_id=_CLIP_BOS,
        eos_token_id=_CLIP_EOS,
        pad_token_id=_CLIP_EOS,
        hidden_act="quick_gelu",
    )


# ------------------------------------------------------------------------------------------ tiny VAE training

VAE_TRAIN_STEPS = 500
VAE_BATCH = 32
VAE_CROP_PX = 16  # most steps see random crops: 4x cheaper than whole 32 px images
VAE_FULL_FRACTION = 0.2  # the last steps see whole images, so borders decode cleanly
VAE_LR = 5e-3
VAE_IMAGE_PX = 32
VAE_EXTRA_SHAPES = 768  # random shapes in any colour beside the built-in set, so other colours decode too
_LATENT_LOOKS_LIKE_IMAGE = 1.0  # weight of "first 3 latent channels = 2x2-averaged RGB"
_KL_WEIGHT = 1e-4  # keeps latents bounded; small enough not to blur


def to_tensor(images: list) -> torch.Tensor:
    import numpy as np

    array = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0


def shapes_images(resolution: int = VAE_IMAGE_PX) -> torch.Tensor:
    """All images of the built-in shapes dataset, (N, 3, R, R) in [-1, 1]."""
    return to_tensor([render_shape(i, resolution)[0] for i in range(SHAPES_NUM_SAMPLES)])


def _random_shape(rng: random.Random, resolution: int):
    """A random-colour circle/square/triangle on a random-colour background (drawn at 4x, box-filtered down)."""
    from PIL import Image, ImageDraw

    side = resolution * 4
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))  # noqa: E731
    canvas = Image.new("RGB", (side, side), colour())
    draw = ImageDraw.Draw(canvas)
    for _ in range(rng.randint(1, 2)):
        r = rng.uniform(0.15, 0.4) * side
        cx, cy = rng.uniform(r, side - r), rng.uniform(r, side - r)
        kind = rng.randrange(3)
        if kind == 0:
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour())
        elif kind == 1:
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour())
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour())
    return canvas.resize((resolution, resolution), Image.Resampling.BOX)


def _vae_training_images() -> torch.Tensor:
    rng = random.Random(VAE_SEED)
    extra = to_tensor([_random_shape(rng, VAE_IMAGE_PX) for _ in range(VAE_EXTRA_SHAPES)])
    return torch.cat([shapes_images(), extra])


def _vae_batch(images: torch.Tensor, step: int, generator: torch.Generator) -> torch.Tensor:
    batch = images[torch.randint(0, len(images), (VAE_BATCH,), generator=generator)]
    if step >= VAE_TRAIN_STEPS * (1 - VAE_FULL_FRACTION):
        return batch[: VAE_BATCH // 2]  # whole images cost 4x: halve the batch
    x, y = torch.randint(0, VAE_IMAGE_PX - VAE_CROP_PX + 1, (2,), generator=generator).tolist()
    return batch[:, :, y : y + VAE_CROP_PX, x : x + VAE_CROP_PX]


def train_tiny_vae(vae) -> dict:
    """Train `vae` in place to reconstruct shapes; returns its scaling factor and reconstruction error.
    Deterministic given the global torch seed and thread count (the caller fixes both)."""
    images = _vae_training_images()
    generator = torch.Generator().manual_seed(VAE_SEED)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    optimizer = torch.optim.Adam(vae.parameters(), lr=VAE_LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=VAE_LR, total_steps=VAE_TRAIN_STEPS, pct_start=0.15
    )
    vae.train()
    for step in range(VAE_TRAIN_STEPS):
        x = _vae_batch(images, step, generator)
        posterior = vae.encode(x).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(latents).sample
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        image_like = F.mse_loss(posterior.mean[:, :3], F.avg_pool2d(x, factor))
        loss = F.l1_loss(reconstruction, x) + _LATENT_LOOKS_LIKE_IMAGE * image_like + _KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    vae.eval().requires_grad_(False)
    shapes = shapes_images()
    with torch.no_grad():
        _center_latents(vae, vae.encode(shapes).latent_dist.mean.mean(dim=(0, 2, 3)))
        means = vae.encode(shapes).latent_dist.mean
        error = F.mse_loss(vae.decode(means).sample, shapes).item()
    return {
        "vae_scaling_factor": round(1.0 / means.std().item(), 5),
        "vae_reconstruction_mse": round(error, 6),
        "vae_train_steps": VAE_TRAIN_STEPS,
    }


def _center_latents(vae, channel_means: torch.Tensor) -> None:
    """Shift the latent space so each channel has mean 0 over the shapes set, without changing what decodes:
    quant_conv's mean outputs lose m, post_quant_conv (1x1, linear) adds W @ m back. Off-centre latents are what
    the noise schedule handles worst: sampling starts from zero-mean noise, so the images' mean colour drifts."""
    channels = channel_means.numel()
    vae.quant_conv.bias[:channels] -= channel_means
    vae.post_quant_conv.bias += vae.post_quant_conv.weight[:, :, 0, 0] @ channel_means

"""The image tokens per sample that `dstune validate` counts for a sequence-parallel split (each rank holds exactly
tokens / N) are the sequence the real transformer receives: the pixels per token come from the model's own configs
(its VAE's spatial factor x the 2x2 latent patch a token packs), and an edit model's sequence holds its target's
and its source's tokens. Checked against the tokens that reach the first transformer block in training, for
builtin:tiny-flux2 (a 2x VAE: 4 px per token, where the 16 px of a real FLUX.2 would say 16 times fewer tokens) and
builtin:tiny-qwen-image-edit (an 8x VAE: 16 px per token, target and source)."""

from __future__ import annotations

import pytest
import torch

from dstune.pretrained import build_model
from dstune.sequence_parallel import bucket_tokens
from dstune.spec.models import FlowModelSpec, Spec
from loaded_models import CACHE_DIR
from tiny_batches import shape_batch


def _spec(pretrained: str, side: int) -> Spec:
    return Spec.model_validate(
        {
            "model": {"family": "flow", "pretrained": pretrained},
            "data": {"resolution": side},
            "train": {"micro_batch_size": 1, "max_steps": 1},
            "deepspeed": {"zero_stage": 2, "sequence_parallel_size": 2},
        }
    )


def _transformer_tokens(model: str, batch: dict) -> int:
    """The image tokens the transformer's first block receives in a training forward of `batch` (the text stream
    is its own argument)."""
    loaded = build_model(FlowModelSpec(family="flow", pretrained=f"builtin:{model}"), CACHE_DIR, "cpu")
    seen = []
    first_block = loaded.trainable.transformer_blocks[0]
    hook = first_block.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            loaded.loss(loaded.trainable, loaded.encode_batch(batch), 0, 1)
    finally:
        hook.remove()
    return seen[0]


def test_flux2_tokens_follow_its_vae_and_patch():
    side = 48  # tiny-flux2: 2x VAE, 2x2 patches: 12 x 12 tokens
    tokens = bucket_tokens(_spec("builtin:tiny-flux2", side), None)
    assert tokens[f"{side}x{side}"] == _transformer_tokens("tiny-flux2", shape_batch([0, 3], side)) == 144
    assert tokens["text"] == 512  # the text stream, padded to max_sequence_length, is split with it


def test_an_edit_models_tokens_are_its_target_and_its_source():
    from dstune.builtin.common import to_tensor
    from dstune.data.synthetic import render_shape

    side = 64  # tiny-qwen-image-edit: 8x VAE, 2x2 patches: 4 x 4 tokens per picture, two pictures
    batch = shape_batch([1, 2], side)
    batch["control_values"] = to_tensor([render_shape(i + 100, side)[0] for i in (1, 2)])
    batch["caption"] = [f"turn it into {caption}" for caption in batch["caption"]]
    tokens = bucket_tokens(_spec("builtin:tiny-qwen-image-edit", side), None)
    assert tokens == {f"{side}x{side} (target and source)": _transformer_tokens("tiny-qwen-image-edit", batch)}
    assert tokens[f"{side}x{side} (target and source)"] == 32  # no text row: the split pads the instruction


def test_bucket_sides_other_than_the_resolution_count_at_the_same_geometry():
    spec = _spec("builtin:tiny-flux2", 32)
    assert bucket_tokens(spec, None, {"48x32": 5, "32x64": 3}) == {"48x32": 12 * 8, "32x64": 8 * 16, "text": 512}


@pytest.mark.parametrize(
    "pretrained, side, tokens",
    [
        ("black-forest-labs/FLUX.2-klein-4B", 1024, 64 * 64),  # 8x VAE, 2x2 patches: 16 px
        ("Qwen/Qwen-Image-Edit", 1024, 2 * 64 * 64),  # 16 px, target and source
    ],
)
def test_real_models_count_from_their_stored_configs(pretrained, side, tokens):
    counted = bucket_tokens(_spec(pretrained, side), None)
    assert sum(count for label, count in counted.items() if label != "text") == tokens

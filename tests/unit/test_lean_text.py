"""The text encoders run lean (dstune.families.lean_text): the pipelines' calls keep only the hidden states they read,
compute the logits of one position and no key/value cache, and the text tensors are bit for bit those of the plain
calls, through every flow and video model's own text path (its encode_text) on its built-in model's real encoder classes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dstune.families.lean_text import lean_kwargs
from dstune.pretrained import build_model
from dstune.spec.model_sections import FlowModelSpec
from dstune.spec.video_models import VideoModelSpec

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
CAPTIONS = ["a red circle", 'a sign that reads "OPEN" on a grey wall, two words long']
FLOW = ("tiny-qwen-image", "tiny-krea2", "tiny-z-image", "tiny-flux2", "tiny-flux2-dev", "tiny-qwen-image-21")
MODELS = [("flow", name) for name in FLOW + ("tiny-ernie-image", "tiny-flux", "tiny-flow")] + [
    ("video", name) for name in ("tiny-hunyuan-video15", "tiny-ltx2", "tiny-wan")
]


def _built(family: str, name: str):
    section = FlowModelSpec if family == "flow" else VideoModelSpec
    return build_model(section(family=family, pretrained=f"builtin:{name}"), CACHE_DIR, "cpu")


def encode_captions(model, captions: list[str]) -> dict:
    with torch.no_grad():
        return model.encode_text(captions)


@pytest.mark.parametrize("family,name", MODELS, ids=[name for _, name in MODELS])
def test_lean_text_encoders_give_the_plain_calls_tensors_bit_for_bit(family, name):
    built = _built(family, name)
    encoders = [encoder for encoder in built.text_encoders.values() if encoder is not None]
    assert encoders and all(getattr(encoder, "dstune_lean", None) is not None for encoder in encoders)
    lean = encode_captions(built, CAPTIONS)
    for encoder in encoders:  # the plain calls, as the pipeline makes them
        encoder.dstune_lean.remove()
    plain = encode_captions(built, CAPTIONS)
    assert sorted(lean) == sorted(plain)
    for key in plain:
        assert torch.equal(lean[key], plain[key]), (name, key)


def test_lean_calls_keep_the_hidden_states_read_and_one_position_of_logits():
    built = _built("flow", "tiny-qwen-image")
    encoder = built.text_encoders["text_encoder"]
    asked = {"input_ids": torch.tensor([[5, 6, 7]]), "output_hidden_states": True}
    kwargs = lean_kwargs(encoder, asked, (-1,))
    assert kwargs["output_hidden_states"] == [-1] and kwargs["logits_to_keep"] == 1 and kwargs["use_cache"] is False
    with torch.no_grad():
        out = encoder(**asked)  # through the pre-hook
    assert out.logits.shape[1] == 1  # one position's logits, not the caption's
    assert out.hidden_states[-1] is not None and all(state is None for state in out.hidden_states[:-1])
    # what the caller sets itself stays; a caller that asks for no hidden states gets none
    assert lean_kwargs(encoder, {"output_hidden_states": False, "use_cache": True}, (-1,)) == {
        "output_hidden_states": False,
        "use_cache": True,
        "logits_to_keep": 1,
    }

"""Text encoders once per node (dstune.text_once): with the text cache, only the first rank of a node loads them,
and after the cache every rank renders its samples from the prompts' cached text.

- Samples rendered from cached text are the samples the pipeline renders from the prompt with its own encoders
  (each video model, with guidance, so the negative prompt's cached text is used too), on a model built without
  text encoders.
- The rule: which spec settings keep the text encoders on every rank, and the reason the plan gives.
- The memory plan counts them once per node in host RAM and leaves them out of the sample phase (the real LTX-2
  configs: Gemma 3 12B and the connectors).
- The cache deals text entries only to the ranks that loaded the encoders.
The 2-rank runs (tests/dist/test_wan.py) check which ranks loaded them. Which models' samples read cached text is
their card's (one declaration, read by the plan and the start-up alike).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dstune.cache.entries import Entry
from dstune.cache.latents import chunks_of_rank
from dstune.pretrained import build_model
from dstune.spec.models import SampleSpec, VideoModelSpec
from loaded_models import CACHE_DIR, REPO

PROMPT = "a red circle moving left"
EXAMPLE = REPO / "launch" / "ltx2-lora-zero3-8gpu.yaml"


def _frames(clip) -> np.ndarray:
    return np.stack([np.asarray(frame, dtype=np.float32) for frame in clip])


@pytest.mark.parametrize(
    "name, guidance",
    [("tiny-wan", 3.0), ("tiny-hunyuan-video15", 4.0), ("tiny-ltx2", 3.0)],
)
def test_samples_from_cached_text_equal_the_pipelines_own_encoding(name, guidance):
    model = VideoModelSpec(family="video", pretrained=f"builtin:{name}", max_sequence_length=32)
    built = build_model(model, CACHE_DIR, "cpu")
    lean = build_model(model, CACHE_DIR, "cpu", text_encoders=False)
    assert set(lean.text_encoders) == set(built.text_encoders) and all(e is None for e in lean.text_encoders.values())
    assert not set(lean.frozen) & set(built.text_encoders)  # nothing of the text side was loaded
    lean.trainable.load_state_dict(built.trainable.state_dict())
    with torch.no_grad():  # what the text cache stores for the prompt and for "" (dstune.text_once.sample_captions)
        tensors = built.encode_text([PROMPT, ""])
    lean.prompt_text = {caption: {k: v[i] for k, v in tensors.items()} for i, caption in enumerate([PROMPT, ""])}
    sample_spec = SampleSpec(steps=2, guidance=guidance)
    expected = built.sample(built.trainable, [PROMPT], sample_spec, 32)[0]
    rendered = lean.sample(lean.trainable, [PROMPT], sample_spec, 32)[0]
    np.testing.assert_array_equal(_frames(rendered), _frames(expected))
    if getattr(expected, "sound", None) is not None:  # LTX-2: the sound too
        np.testing.assert_array_equal(np.asarray(rendered.sound), np.asarray(expected.sound))
    lean.prompt_text = {}
    with pytest.raises(ValueError, match="no cached text"):
        lean.sample(lean.trainable, [PROMPT], sample_spec, 32)


IMAGE_MODELS = [  # every flow image built-in whose text can be cached (an edit model's cannot), with guidance on
    ("tiny-flow", 3.0),
    ("tiny-flux", 3.0),
    ("tiny-qwen-image", 3.0),
    ("tiny-z-image", 3.0),
    ("tiny-flux2", 3.0),
    ("tiny-flux2-dev", 3.0),
    ("tiny-krea2", 3.0),
    ("tiny-krea2-turbo", 0.0),
    ("tiny-qwen-image-21", 3.0),
    ("tiny-ernie-image", 3.0),
]


@pytest.mark.parametrize("name, guidance", IMAGE_MODELS)
def test_image_samples_from_cached_text_equal_the_pipelines_own_encoding(name, guidance):
    """Two prompts in one pipeline call, as the flow core renders images: from the cached text of each (and of the
    model's negative prompt), on a model built without text encoders, the images the pipeline renders from the
    prompt strings. Equal bit for bit but for Qwen-Image 2.1, whose Qwen3-VL encoder gives other roundings (1e-7) to
    a caption encoded in another batch (the cache's [prompts, negative] against the pipeline's prompts, then the
    negative): one of its 4096 values is 1 level of 255 apart."""
    from dstune.spec.models import FlowModelSpec

    prompts = [PROMPT, "a blue square"]
    model = FlowModelSpec(family="flow", pretrained=f"builtin:{name}")
    built = build_model(model, CACHE_DIR, "cpu")
    assert built.card.samples_from_cached_text
    lean = build_model(model, CACHE_DIR, "cpu", text_encoders=False)
    assert all(encoder is None for encoder in lean.text_encoders.values())
    assert not set(lean.frozen) & set(built.text_encoders)  # nothing of the text side was loaded
    lean.trainable.load_state_dict(built.trainable.state_dict())
    captions = [*prompts, built.card.negative_caption()]  # what dstune.text_once.sample_captions caches
    with torch.no_grad():
        tensors = built.encode_text(captions)
    lean.prompt_text = {caption: {k: v[i] for k, v in tensors.items()} for i, caption in enumerate(captions)}
    sample_spec = SampleSpec(steps=2, guidance=guidance)
    expected = built.sample(built.trainable, prompts, sample_spec, 32)
    rendered = lean.sample(lean.trainable, prompts, sample_spec, 32)
    for got, want in zip(rendered, expected, strict=True):
        difference = np.abs(np.asarray(got, dtype=np.int16) - np.asarray(want, dtype=np.int16))
        assert difference.max() <= 1 and (difference > 0).mean() < 1e-3


@pytest.mark.parametrize("name", [name for name, _ in IMAGE_MODELS] + ["tiny-ideogram4", "tiny-qwen-image-edit"])
def test_the_image_models_whose_samples_need_their_encoders(name):
    """Ideogram4Pipeline takes no prompt embeddings, so its samples need its encoders; an edit model's text is
    never cached (its text reads the source image). The plan and the start-up both read the card."""
    from dstune.builtin import ensure_builtin_model
    from dstune.families import card_of

    card = card_of("flow", ensure_builtin_model(name, CACHE_DIR))
    assert card.samples_from_cached_text == (name not in ("tiny-ideogram4", "tiny-qwen-image-edit"))


def _validate(capsys, monkeypatch, tmp_path, *sets: str) -> dict:
    import huggingface_hub.constants

    from dstune.cli import main

    monkeypatch.chdir(REPO)  # the stored Lightricks/LTX-2 configs
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    args = ["validate", str(EXAMPLE.relative_to(REPO)), "--num-gpus", "8", "--num-samples", "2000", "--json"]
    assert main([*args, *[arg for value in sets for arg in ("--set", value)]]) == 0
    return json.loads(capsys.readouterr().out)["memory"]


def test_the_plan_counts_the_text_encoders_once_per_node_and_not_in_samples(capsys, monkeypatch, tmp_path):
    """LTX-2's example (8 ranks on a node, the text cache, samples): Gemma 3 and the connectors are loaded by one
    rank, so the node holds one copy instead of eight, and the sample phase holds none of them. Their bytes are
    the frozen parts' bf16 copies."""
    once = _validate(capsys, monkeypatch, tmp_path)
    counts = once["parameters"]
    assert counts["once_per_node_companions"] == ["text_encoder", "connectors"]
    text_bytes = 2 * (counts["companions"]["text_encoder"] + counts["companions"]["connectors"])
    assert once["host_once_per_node_bytes"] == text_bytes
    assert counts["text_on_every_rank"] is None
    every = _validate(capsys, monkeypatch, tmp_path, "data.cache.dir=/tmp/cache-{rank}")
    assert every["parameters"]["once_per_node_companions"] == [] and every["host_once_per_node_bytes"] == 0
    assert "{rank}" in every["parameters"]["text_on_every_rank"]  # validate's "text encoders" row says why
    assert every["host_per_node_bytes"] - once["host_per_node_bytes"] == pytest.approx(7 * text_bytes, abs=8)
    sample_once, sample_every = once["phases"]["sample"], every["phases"]["sample"]
    assert sample_every["per_gpu_bytes"] - sample_once["per_gpu_bytes"] == pytest.approx(text_bytes, abs=8)
    assert once["phases"]["load"] == every["phases"]["load"]  # the loading rank's GPU holds them
    # past the host warning (ZeRO-2: every rank reads the 19 B transformer in fp32), it names the text encoders
    whole = _validate(capsys, monkeypatch, tmp_path, "data.cache.dir=/tmp/cache-{rank}", "deepspeed.zero_stage=2")
    assert "the text encoders once per node" in whole["host_warning"] and "{rank}" in whole["host_warning"]


@pytest.mark.parametrize(
    "setting, why",
    [
        ("data.cache.text_embeddings=false", "data.cache.text_embeddings is off"),
        ("data.cache.dir=/tmp/c-{rank}", "a cache folder of its own"),
    ],
)
def test_the_rule_keeps_them_on_every_rank_where_the_cache_cannot_replace_them(setting, why):
    from dstune.families.denoiser_facts import text_once_per_node
    from dstune.spec.load import load_spec

    def spec(*overrides: str):
        return load_spec(EXAMPLE, overrides)[0]

    assert why in text_once_per_node(spec(setting), samples_from_cached_text=True)
    assert text_once_per_node(spec(), samples_from_cached_text=True) is None
    assert "samples encode their prompts" in text_once_per_node(spec(), samples_from_cached_text=False)
    assert text_once_per_node(spec("sample.prompts=[]"), samples_from_cached_text=False) is None


def _entry(kind: str, number: int) -> Entry:
    return Entry(kind, f"{kind}-{number}", f"{kind}-{number}")


def test_text_chunks_go_only_to_the_ranks_that_loaded_the_encoders():
    chunks = [[_entry("latent", n)] for n in range(4)] + [[_entry("text", n)] for n in range(3)]
    group = [0, 1, 2, 3]
    dealt = {rank: chunks_of_rank(chunks, group, [0, 2], rank) for rank in group}
    assert sorted(c[0].name for rank in group for c in dealt[rank]) == sorted(c[0].name for c in chunks)
    assert [c[0].name for c in dealt[1] + dealt[3]] == ["latent-1", "latent-3"]  # no text for them
    assert [c[0].name for c in dealt[0] if c[0].kind == "text"] == ["text-0", "text-2"]
    assert [c[0].name for c in dealt[2] if c[0].kind == "text"] == ["text-1"]


def test_a_family_without_the_rule_is_planned_with_its_text_encoders_on_every_rank():
    """The SD families always load their CLIP encoders on every rank (their card's text_once is off), so the plan
    counts them on every rank whatever the cache and the samples (no spec setting changes that, so validate has
    nothing to say about it)."""
    from dstune.families import get_facts
    from dstune.spec.load import load_spec
    from dstune.text_once import once_per_node

    spec = load_spec(REPO / "launch" / "sdxl-zero2-8gpu.yaml", ["sample.prompts=[]"])[0]
    card = get_facts(spec.model.family).card(spec)
    assert spec.data.cache.text_embeddings and not card.text_once and not once_per_node(spec, card)
    counts = get_facts(spec.model.family).count(spec, 1000)
    assert counts.once_per_node == () and counts.text_on_every_rank == ""

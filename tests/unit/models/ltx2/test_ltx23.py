"""LTX-2.3 and LTX-2.5 (the LTX-2 unit, dstune.models.ltx2, on builtin:tiny-ltx2-3 and builtin:tiny-ltx2-5): the
folder's text encoder (Gemma 3, or Gemma 4 for 2.5) and its connectors with per-modality projections, the video and
the audio+video losses against ltx-trainer's loss lines (ltx_trainer.py: TextToVideoStrategy, the same lines as
LTX-2.0's; the model differs), the denoiser's inputs (the prompt modulation's sigma), the 2.5 export with its
duration head, and `dstune validate` on each kind of folder with its text cache counted at the projections'
widths."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dstune.families import card_of
from loaded_models import CACHE_DIR
from tiny_batches import clip_batch

from .ltx_trainer import (
    FRAMES,
    INDICES,
    SEED,
    STEP,
    TEXT_TOKENS,
    load_tiny_ltx2,
    reference_av_loss,
    reference_sigmas,
    reference_video_loss,
    sound_batch,
    validate_example,
)

VERSIONS = {"tiny-ltx2-3": "Gemma3ForConditionalGeneration", "tiny-ltx2-5": "Gemma4UnifiedForConditionalGeneration"}


@pytest.fixture(scope="module", params=sorted(VERSIONS))
def built(request):
    return load_tiny_ltx2(f"builtin:{request.param}")


def recording(module, calls: list):
    """`module`'s forward, recording the keyword arguments of each call."""

    def forward(**kwargs):
        calls.append(kwargs)
        return module(**kwargs)

    return forward


def test_the_folders_text_encoder_and_connectors_make_the_cached_text(built):
    """The folder's Gemma (3 for 2.3, 4 for 2.5) and its connectors with per-modality projections: the cached video
    text is the transformer's cross-attention width (16), the audio text the audio stream's (8), as the pipeline's
    own connectors give them."""
    name = built.model_spec.pretrained.removeprefix("builtin:")
    assert type(built.text_encoders["text_encoder"]).__name__ == VERSIONS[name]
    connectors = built.text_encoders["connectors"]
    assert connectors.config.per_modality_projections and not built.transformer_config["use_prompt_embeddings"]
    encoded = built.encode_text(["a red circle moving left"])
    assert encoded["encoder_hidden_states"].shape == (1, TEXT_TOKENS, 16)
    assert encoded["audio_encoder_hidden_states"].shape == (1, TEXT_TOKENS, 8)
    pipeline = built.pipeline()
    with torch.no_grad():
        embeds, mask, _, _ = pipeline.encode_prompt(
            ["a red circle moving left"], do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS
        )
        video, audio, _ = connectors(embeds, mask)
    assert torch.equal(video, encoded["encoder_hidden_states"]) and torch.equal(
        audio, encoded["audio_encoder_hidden_states"]
    )


def test_video_loss_equals_ltx_trainers_loss_lines_and_the_prompt_modulation_gets_sigma(built):
    """Text-to-video, video only: ltx-trainer's loss lines at 1e-5; the denoiser is given the clip's sigma x 1000
    for 2.3's sigma-modulated prompt attention (Modality.sigma, which ltx-core scales by the timestep multiplier),
    and every video token at that timestep (one per clip, which the transformer gives each token)."""
    encoded = built.encode_batch(clip_batch(INDICES, SEED, frames=FRAMES))
    calls = []
    with torch.no_grad():
        ours = built.loss(recording(built.trainable, calls), encoded, SEED, STEP)
    assert ours.item() == pytest.approx(reference_video_loss(built, encoded, "shifted_logit_normal").item(), rel=1e-5)
    (given,) = calls
    sigmas = reference_sigmas("shifted_logit_normal", 48)
    assert torch.allclose(given["sigma"], sigmas * 1000, atol=1e-3)
    assert torch.allclose(given["timestep"], sigmas * 1000, atol=1e-3)  # one per clip: every token's
    assert given["isolate_modalities"] and given["encoder_hidden_states"].shape[-1] == 16


def test_audio_video_loss_equals_ltx_trainers_loss_lines(built):
    """Clips with sound: both streams in one call (the audio text 8 wide into the 8-wide audio stream), the summed
    per-sample loss of ltx-trainer at 1e-5."""
    batch = sound_batch(INDICES, built.parts["audio_vae"].config.sample_rate)
    encoded = built.encode_batch(batch)
    assert encoded["has_sound"].tolist() == [True, True]
    with torch.no_grad():
        ours = built.loss(built.trainable, encoded, SEED, STEP)
    reference = reference_av_loss(built, encoded, batch["sound"], INDICES)
    assert ours.item() == pytest.approx(reference.mean().item(), rel=1e-5)


def test_the_25_export_keeps_its_duration_head_and_renders(tmp_path):
    """LTX-2.5's export is a whole LTX2Pipeline folder with its Gemma 4 and duration head (not trained, copied):
    the pipeline loads it and, given no frame count, lets the head choose one."""
    from diffusers import LTX2Pipeline

    model = load_tiny_ltx2("builtin:tiny-ltx2-5")
    state = {name: value + 0.01 for name, value in model.trainable.state_dict().items()}
    out = model.export(state, tmp_path / "full")
    pipeline = LTX2Pipeline.from_pretrained(out)
    assert type(pipeline.duration_head).__name__ == "LTX2DurationHead"
    assert type(pipeline.text_encoder).__name__ == "Gemma4UnifiedForConditionalGeneration"
    result = pipeline(
        "a red circle moving left",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=TEXT_TOKENS,
        min_seconds=0.2,
        max_seconds=0.5,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    frames = result.frames.shape[1]
    assert (frames - 1) % 4 == 0 and 5 <= frames <= 13 and result.audio.shape[:2] == (1, 2)


def _validate(capsys, tmp_path, pretrained: str) -> tuple[int, dict]:
    from dstune.cli import main

    spec = {
        "model": {
            "family": "video",
            "pretrained": pretrained,
            "train": "lora",
            "max_sequence_length": 64,
            "timestep_sampling": "shifted_logit_normal",
            "sample_frames": 9,
        },
        "data": {
            "path": "builtin:moving-shapes-av",
            "resolution": 32,
            "video": {"frames": 9},
            "cache": {"latents": True, "text_embeddings": True},
        },
        "train": {"micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec))
    code = main(["validate", str(path), "--num-gpus", "2", "--num-samples", "10", "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_validate_takes_each_folder_and_counts_its_connectors_and_text_widths(capsys, tmp_path, name):
    """Each kind validates (model.family video chooses LTX-2 by the folder): Gemma (4 for 2.5) and the connectors
    with their projections frozen beside the transformer, the text cache at the connectors' video and audio widths
    (16 and 8 per token, where LTX-2.0's are caption_channels each); a folder whose connectors and transformer
    disagree about who projects the text is refused, saying so."""
    from dstune.families.denoiser_facts import pipeline_folder
    from dstune.models.ltx2.card import text_tokens_and_width
    from dstune.spec.load import load_spec

    code, out = _validate(capsys, tmp_path, f"builtin:{name}")
    assert code == 0, out["errors"]
    counts = out["memory"]["parameters"]
    assert {"text_encoder", "connectors", "vae", "audio_vae"} <= set(counts["companions"])
    assert counts["companions"]["connectors"] > 0
    spec, _ = load_spec(str(tmp_path / "spec.yaml"), [])
    assert text_tokens_and_width(spec, pipeline_folder(f"builtin:{name}")) == [(64, 16), (64, 8)]

    built = CACHE_DIR / "builtin" / f"{name}-v1"
    folder = tmp_path / "folder"
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "connectors" / "config.json").read_text())
    (folder / "connectors" / "config.json").write_text(json.dumps({**config, "per_modality_projections": False}))
    card = card_of("video", folder)
    problems = "\n".join(card.folder_problems(folder, spec.model))
    assert "connectors per_modality_projections False with transformer use_prompt_embeddings False" in problems


def test_validate_plans_ltx23_from_its_stored_configs(capsys, monkeypatch, tmp_path):
    """The 8-GPU example on Lightricks/LTX-2.3 (its configs stored with dstune, as diffusers' conversion script
    writes them: dstune/model_configs/hub/Lightricks/LTX-2.3): the connectors with their per-modality projections
    (3,840 x 49 in, to 4,096 and 2,048) are counted, 1.7 B more than LTX-2.0's; the vocoder with bandwidth extension
    joins for samples; the text cache is 1,024 tokens x (4,096 + 2,048) per caption instead of x (3,840 + 3,840)."""
    code, ltx20 = validate_example(capsys, monkeypatch, tmp_path)
    assert code == 0, ltx20["errors"]
    code, ltx23 = validate_example(capsys, monkeypatch, tmp_path, "model.pretrained=Lightricks/LTX-2.3")
    assert code == 0, ltx23["errors"]
    old, new = (run["memory"]["parameters"] for run in (ltx20, ltx23))
    projections = 3840 * 49 * (4096 + 2048) + 4096 + 2048  # with their biases
    assert new["companions"]["connectors"] - old["companions"]["connectors"] > projections - 3840 * 49 * 3840
    assert set(new["sampling_companions"]) == {"vocoder"} and new["sampling_companions"]["vocoder"] > 1e8
    text = 2000 * 1024 * (2 * 3840 - (4096 + 2048)) * 2  # 2,000 captions, bf16
    assert ltx20["memory"]["cache_disk_bytes"] - ltx23["memory"]["cache_disk_bytes"] == text

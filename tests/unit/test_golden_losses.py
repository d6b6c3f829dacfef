"""Golden loss trajectories: 20 optimisation steps of every built-in model, in one process, against pinned losses.

Each built-in model (dstune.builtin.BUILTIN_MODELS) is built through the family API as training builds it
(`get_family(spec.family).build` on the folders dstune.pretrained resolves), fed a fixed sequence of batches of its
built-in data (builtin:shapes, source/target shape pairs, builtin:moving-shapes clips, builtin:tones clips), and its
trainable module is stepped by a plain torch.optim.AdamW on `family.loss` (fp32, one CPU thread, fixed seeds). The
20 losses must equal tests/data/golden_losses.json to 1e-6 relative. They are the numerics of the whole training
step (data, frozen encoders, noise and timestep draws, the denoiser or LM, the loss, its gradient), so a change that
moves any of them fails here, naming the model and the first step that moved.

The trajectories run in a child process with the CPU's instruction sets pinned to AVX2 (dstune.builtin.PINNED_ISA_ENV,
the pins every built-in model is built under), one thread: oneDNN's and MKL's AVX-512 kernels round differently from
their AVX2 ones, which 20 AdamW steps carry past 1e-6, so unpinned the values would belong to one CPU. Pinned, they
hold on every x86 CPU with AVX2 (checked on AVX-512 and AVX2 machines); another torch version may still differ. Regenerate ONLY for an intended numerics change (a new
torch, a fixed loss, a changed built-in model), and say so in the commit, with the models whose losses moved:

    make golden-losses        # = python tests/unit/test_golden_losses.py --regenerate

A refactor that claims "no behaviour change" must pass this file unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dstune.families import get_family
from dstune.pretrained import resolve_folders
from dstune.spec.models import DataSpec, FlowModel, WanModel
from dstune.models.csm.spec import TtsCodebooksModel
from dstune.models.sd.spec import SdModel, SdxlModel
from dstune.models.speecht5.spec import SpeechT5Model
from dstune.models.tts_lm.spec import TtsLmModel

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
GOLDEN = REPO / "tests" / "data" / "golden_losses.json"
STEPS = 20
BATCH = 2
SEED = 0  # the training seed handed to family.loss (noise and timestep draws) and to the datasets
RELATIVE_TOLERANCE = 1e-6
IMAGE_SIDE, EDIT_SIDE, CLIP_FRAMES = 32, 64, 5  # edit pairs: 8 px per latent, 8x8 latents
IMAGE_LR, SPEECH_LR = 1e-3, 1e-2
FLUX2_TEXT_TOKENS = 64  # the chat-templated captions fit; the default 512 makes the text encoder most of the time
HV15_TEXT_TOKENS = 48  # HunyuanVideo 1.5's default 1000 Qwen tokens would make the text side most of the time
LTX2_TEXT_TOKENS = 32  # LTX-2's default 1024 Gemma tokens likewise
ERNIE_TEXT_TOKENS = 64  # the shapes' captions fit; padding to the default 512 would make attention most of the time


def _model(model_class, family: str, **options):
    return lambda name: model_class(family=family, pretrained=f"builtin:{name}", **options)


# built-in model -> (its model spec section, its data, the AdamW learning rate)
CASES = {
    "tiny-sd": (_model(SdModel, "sd"), "shapes", IMAGE_LR),
    "tiny-sdxl": (_model(SdxlModel, "sdxl"), "shapes", IMAGE_LR),
    "tiny-flow": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-flux": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image-edit": (_model(FlowModel, "flow"), "edit-pairs", IMAGE_LR),
    "tiny-z-image": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-flux2": (_model(FlowModel, "flow", max_sequence_length=FLUX2_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-flux2-dev": (_model(FlowModel, "flow", max_sequence_length=FLUX2_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-ideogram4": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-krea2": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-krea2-turbo": (_model(FlowModel, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image-21": (_model(FlowModel, "flow", timestep_sampling="uniform"), "shapes", IMAGE_LR),
    "tiny-ernie-image": (_model(FlowModel, "flow", max_sequence_length=ERNIE_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-wan": (_model(WanModel, "wan"), "moving-shapes", IMAGE_LR),
    "tiny-wan-a14b": (_model(WanModel, "wan", expert="low_noise"), "moving-shapes", IMAGE_LR),
    "tiny-wan-i2v": (_model(WanModel, "wan"), "moving-shapes", IMAGE_LR),
    "tiny-wan22-ti2v": (_model(WanModel, "wan", image_to_video=True), "moving-shapes", IMAGE_LR),
    "tiny-tts-lm": (_model(TtsLmModel, "tts_lm"), "tones", SPEECH_LR),
    "tiny-orpheus": (_model(TtsLmModel, "tts_lm", codec="snac"), "tones", SPEECH_LR),
    "tiny-speecht5": (_model(SpeechT5Model, "speecht5"), "tones", SPEECH_LR),
    "tiny-csm": (_model(TtsCodebooksModel, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-dia": (_model(TtsCodebooksModel, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-vibevoice": (_model(TtsCodebooksModel, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-hunyuan-video15": (_model(WanModel, "wan", max_sequence_length=HV15_TEXT_TOKENS), "moving-shapes", IMAGE_LR),
    "tiny-hunyuan-video15-i2v": (
        _model(WanModel, "wan", max_sequence_length=HV15_TEXT_TOKENS),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-ltx2": (
        _model(WanModel, "wan", max_sequence_length=LTX2_TEXT_TOKENS, timestep_sampling="shifted_logit_normal"),
        "moving-shapes",
        IMAGE_LR,
    ),
}


# ------------------------------------------------------------------------------------------------ batches


def _image_samples(kind: str):
    """index -> one sample of the built-in images or clips, as the training datasets produce it."""
    from dstune.data.index import list_samples

    if kind == "moving-shapes":
        from dstune.data.video import VideoCaptionDataset

        data = DataSpec(path="builtin:moving-shapes", resolution=IMAGE_SIDE, video={"frames": CLIP_FRAMES})
        return VideoCaptionDataset(data, list_samples(data, video=True), SEED)
    from dstune.data.images import ImageCaptionDataset

    data = DataSpec(path="builtin:shapes", resolution=IMAGE_SIDE)
    return ImageCaptionDataset(data, list_samples(data), SEED)


def _edit_pair_batch(indices: list[int]) -> dict:
    """Targets are shapes with an instruction; each source is another shape (as tests/dist's edit pairs)."""
    from dstune.data.images import to_tensor
    from dstune.data.synthetic import render_shape

    targets = [render_shape(i, EDIT_SIDE) for i in indices]
    return {
        "pixel_values": torch.stack([to_tensor(image) for image, _ in targets]),
        "control_values": torch.stack([to_tensor(render_shape(i + 100, EDIT_SIDE)[0]) for i in indices]),
        "caption": [f"turn it into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def batches(kind: str, built) -> list[dict]:
    """STEPS collated batches of BATCH consecutive samples each (samples 0, 1 | 2, 3 | ...)."""
    steps = [list(range(BATCH * step, BATCH * (step + 1))) for step in range(STEPS)]
    if kind == "edit-pairs":
        return [_edit_pair_batch(indices) for indices in steps]
    if kind == "tones":
        from dstune.data.audio import SpeechDataset, collate_speech, speech_records

        records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.5))
        dataset = SpeechDataset(records, built.sample_rate)
        return [collate_speech([dataset[i % len(dataset)] for i in indices]) for indices in steps]
    dataset = _image_samples(kind)
    if kind == "moving-shapes":
        from dstune.data.video import collate_video as collate
    else:
        from dstune.data.images import collate
    return [collate([dataset[i % len(dataset)] for i in indices]) for indices in steps]


# ------------------------------------------------------------------------------------------- trajectory


def trajectory(name: str) -> list[float]:
    """The STEPS losses of `name`: family.loss on its batches, each followed by an AdamW step of the trainable."""
    make_spec, data, lr = CASES[name]
    spec = make_spec(name)
    family = get_family(spec.family)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction's order (and so its last bits) depends on the thread count
    try:
        torch.manual_seed(SEED)  # any draw outside the per-sample generators (dropout) starts the same
        built = family.build(spec, resolve_folders(spec, family, CACHE_DIR), "cpu", torch.float32)
        trainable = built.trainable
        optimizer = torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=lr)
        losses = []
        for step, batch in enumerate(batches(data, built)):
            loss = family.loss(built, trainable, family.encode_batch(built, batch, torch.float32), SEED, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses
    finally:
        torch.set_num_threads(threads)


def test_every_built_in_model_has_a_case():
    from dstune.builtin import BUILTIN_MODELS

    assert set(CASES) == set(BUILTIN_MODELS), "add the new built-in model to CASES and run `make golden-losses`"


_computed: dict[str, list[float]] = {}


def pinned_trajectories() -> dict[str, list[float]]:
    """Every case's trajectory, computed once in a child process under dstune.builtin.PINNED_ISA_ENV."""
    if not _computed:
        from dstune.builtin import pinned_child_env

        done = subprocess.run(
            [sys.executable, __file__, "--print"], env=pinned_child_env(), capture_output=True, text=True
        )
        assert done.returncode == 0, f"the pinned trajectories failed:\n{(done.stderr or done.stdout)[-3000:]}"
        _computed.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return _computed


@pytest.mark.parametrize("name", list(CASES))
def test_loss_trajectory_matches_the_pinned_one(name):
    pinned = json.loads(GOLDEN.read_text()).get(name)
    assert pinned is not None, f"{GOLDEN.relative_to(REPO)} has no {name}: run `make golden-losses`"
    losses = pinned_trajectories()[name]
    moved = [
        step for step, (got, want) in enumerate(zip(losses, pinned)) if abs(got - want) > RELATIVE_TOLERANCE * abs(want)
    ]
    assert len(losses) == len(pinned) == STEPS and not moved, (
        f"{name}: the loss moved from step {moved[0] + 1} of {STEPS} (pinned {pinned[moved[0]]!r}, now "
        f"{losses[moved[0]]!r}); all: {losses}. If the numerics change is intended, run `make golden-losses` and "
        "say so in the commit."
        if moved
        else f"{name}: {len(losses)} losses, {len(pinned)} pinned"
    )


def regenerate() -> None:
    """Rewrite GOLDEN from this code (every model), printing which models moved."""
    import dstune

    if not Path(dstune.__file__).resolve().is_relative_to(REPO):
        sys.exit(
            f"this would pin the losses of {Path(dstune.__file__).parent}, not of {REPO / 'dstune'}: run it as "
            "`make golden-losses` (PYTHONPATH is the repository)"
        )
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    new = pinned_trajectories()
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(new, indent=1) + "\n")
    for name, losses in new.items():
        print(
            f"{name}: {'unchanged' if old.get(name) == losses else 'NEW' if name not in old else 'changed'}; "
            f"loss {losses[0]:.5f} -> {losses[-1]:.5f}"
        )
    print(f"wrote {GOLDEN.relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:  # the child process of pinned_trajectories: one JSON line, last
        print(json.dumps({name: trajectory(name) for name in CASES}))
        sys.exit(0)
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(
            f"usage: python {Path(__file__).relative_to(REPO)} --regenerate   (rewrites "
            f"{GOLDEN.relative_to(REPO)}: only for an intended numerics change)"
        )
    regenerate()

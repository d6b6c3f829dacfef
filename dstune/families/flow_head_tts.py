"""What the flow-head TTS classes on the multi-codebook core share (their card type: dstune.families.flow_head_card):
a transformers class whose causal backbone reads one stream (a voice prompt, the text, the speech's continuous codec
latents) and whose LSD flow head samples each next latent from the backbone's state, with the processor of the
PocketTTSProcessor layout (a chat template, precomputed latents given as `audio_prompt_latents` and `labels`).

- `FlowHeadLossModule`: the trained module, the class's own loss from `labels` in its pieces so that each sample
  draws its own noise and times: the backbone on the normalised latents, the class's loss function (transformers' LSD
  loss) per sample weighted by its frames, as the class's one call averages over the batch's frames, and the class's
  end-of-speech loss over every audio position of the batch;
- `training_inputs` / `chat_prompt`: the processor's inputs for a batch from the chat template's prompts;
- `keep_references` / `voice_of`: each speaker's reference clips (start-up's `take_voices`) and the one a clip is
  conditioned on: the speaker's first, its second for that clip itself, so that a clip never hears itself;
- `encode_latents`, `generate_wave`, `codec_folder`: the audio tokenizer's latents of a clip as the processor encodes a
  training clip, the class's own generate decoded by the processor, the audio tokenizer's folder.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks import first_line
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_seed
from dstune.hf import NotAvailableLocally, hub_snapshot, quiet_hf_libraries

TRAIN_KEYS = (
    "input_ids",
    "attention_mask",
    "audio_prompt_latents",
    "audio_prompt_latents_mask",
    "labels",
    "labels_mask",
)


@contextmanager
def plain_linear():
    """torch's own linear while the LSD loss runs: ZeRO-3 replaces torch.nn.functional.linear process-wide by an
    autograd function of its own (memory_efficient_linear), which has no forward-mode rule, and the loss differentiates
    the flow head with a forward-mode JVP. The whole class is gathered here (a leaf module), so nothing is lost."""
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


class FlowHeadLossModule(torch.nn.Module):
    """The trained module: the whole class under `model.` (the core's export and LoRA code find its names)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # the class's loss hyperparameters without the end-of-speech term, which the batch's positions share
        self.flow_config = copy.deepcopy(model.config)
        self.flow_config.eos_loss_weight = 0.0

    def forward(self, anchor, input_ids, attention_mask, labels, labels_mask, seeds, distill_seed, **voice):
        """labels (B, F, D): each clip's latents right-padded, labels_mask (B, F); seeds (B,): each sample's draws;
        voice: audio_prompt_latents and its mask where some sample has a voice. The class's loss, sample by sample.

        `anchor` (a zero that requires grad, added to the latents; positional): ZeRO-3 reduces a leaf module's
        gradients in a full backward hook on the module, which fires once the gradients of its positional inputs are
        ready; without one that requires grad it fires at the start of the backward, before any gradient exists."""
        from transformers.loss.loss_lsd import end_of_speech_loss

        outer = self.model
        config = outer.config
        normalized = ((labels - outer.latent_mean) / outer.latent_std).to(labels.dtype) + anchor.to(labels.dtype)
        hidden = outer.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            audio_latents=normalized,
            audio_latents_mask=labels_mask,
            **voice,
        ).last_hidden_state
        logits = outer.eos_head(hidden)[..., 0]
        positions = (input_ids == config.audio_bos_token_id) | (input_ids == config.audio_latent_token_id)
        counts = labels_mask.sum(1).tolist()
        total, flow, eos_logits, eos_labels = sum(counts), 0, [], []
        for row, count in enumerate(counts):
            states = hidden[row][positions[row]]  # the audio BOS, then one per frame
            eos_logits.append(logits[row][positions[row]])
            eos_labels.append(torch.arange(count + 1, device=states.device) == count)  # the last one ends the speech
            flow = flow + self.flow_loss(states[:count], normalized[row, :count], int(seeds[row]), distill_seed) * (
                count / total
            )
        eos = end_of_speech_loss(torch.cat(eos_logits), torch.cat(eos_labels))
        return flow + config.eos_loss_weight * eos

    def flow_loss(self, conditions, targets, seed: int, distill_seed: int):
        """The class's loss function on one sample's frames, its noise and times from `seed` (the global RNG forked,
        as the class draws them) and the step's self-distillation coin from `distill_seed`."""
        outer = self.model
        device = targets.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), plain_linear():
            torch.manual_seed(seed)
            return outer.loss_function(
                flow_head=outer.flow_head,
                conditions=conditions,
                targets=targets,
                eos_logits=conditions.new_zeros(1),
                eos_labels=torch.zeros(1, dtype=torch.bool, device=device),
                config=self.flow_config,
                loss_weighting=outer.loss_weighting,
                distill_generator=torch.Generator().manual_seed(distill_seed),
                training=self.training,
            )


def leaf_module(whole) -> torch.nn.Module:
    """The class in a FlowHeadLossModule, which ZeRO-3 gathers whole for its forward and backward (a leaf module: no
    hooks inside it). The LSD loss runs the flow head inside a forward-mode JVP, which ZeRO-3's per-module hooks
    cannot pass through (their autograd functions have no jvp); gathering the whole class is what the card counts as
    its largest layer."""
    from deepspeed.utils import set_z3_leaf_module

    trainable = FlowHeadLossModule(whole).train().requires_grad_(True)
    set_z3_leaf_module(trainable, True)
    return trainable


def flow_head_loss(forward, encoded: dict, seed: int, step: int, purposes: tuple[str, str], device) -> torch.Tensor:
    """The class's loss from the labels: each sample's noise and times from (seed, step, its dataset index), the
    step's self-distillation coin from (seed, step); `purposes`: the model's (flow, distillation) draw names."""
    flow_purpose, distill_purpose = purposes
    seeds = torch.tensor([sample_seed(seed, step, int(i), flow_purpose) for i in encoded["indices"]])
    distill = sample_seed(seed, step, 0, distill_purpose)
    inputs = {k: encoded[k] for k in TRAIN_KEYS if k in encoded}
    anchor = torch.zeros((), device=device, requires_grad=True)
    return at_least_float32(forward(anchor, **inputs, seeds=seeds, distill_seed=distill))


# ------------------------------------------------------------------------------------------------ the batch


def chat_prompt(processor, text: str, voiced: bool, training: bool = False) -> str:
    """The chat template's prompt for `text`: after the voice where there is one, before the target audio in
    training."""
    user = ([{"type": "audio"}] if voiced else []) + [{"type": "text", "text": " ".join(text.split())}]
    messages = [{"role": "user", "content": user}]
    if training:
        messages.append({"role": "assistant", "content": [{"type": "audio"}]})
    rendered = processor.apply_chat_template(messages, tokenize=False)
    return rendered[0] if isinstance(rendered, list) else rendered


def training_inputs(processor, texts, voices: list, latents: list, device, dtype: torch.dtype) -> dict:
    """The processor's training inputs: `voices` one voice's latents or None per text, `latents` each clip's."""
    prompts = [chat_prompt(processor, text, voice is not None, training=True) for text, voice in zip(texts, voices)]
    given = [voice for voice in voices if voice is not None]
    with quiet_hf_libraries():
        inputs = processor(
            text=prompts, audio_prompt_latents=given or None, labels=latents, return_tensors="pt", padding=True
        )
    encoded = {k: inputs[k].to(device) for k in TRAIN_KEYS if k in inputs}
    for key in ("audio_prompt_latents", "labels"):
        if key in encoded:
            encoded[key] = encoded[key].to(dtype)
    return encoded


def keep_references(voices: dict, limit: int) -> dict:
    """Each speaker's reference clips (sample id, wave cut to `limit` samples), in the data's order."""
    return {speaker: [(sample_id, wave[:limit]) for sample_id, wave in clips] for speaker, clips in voices.items()}


def voice_of(references: dict, speaker: str, sample_id: str):
    """(sample id, wave) of the voice a clip of `speaker` is conditioned on: the speaker's first reference clip, its
    second for that clip itself (itself where the speaker has one clip); None for a speaker the training data lacks
    (a held-out clip's) or without references: the clip is then spoken without a voice prompt."""
    clips = references.get(speaker or "")
    if not clips:
        return None
    first = clips[0]
    return clips[1] if first[0] == sample_id and len(clips) > 1 else first


def batch_references(references: dict, batch: dict) -> list:
    """voice_of for each clip of a batch, from its speaker column (no column: one voice for all) and sample id."""
    speakers = batch.get("speakers") or [""] * len(batch["texts"])
    ids = batch.get("sample_ids") or [str(int(i)) for i in batch["index"]]
    return [voice_of(references, speaker, sample_id) for speaker, sample_id in zip(speakers, ids)]


# ------------------------------------------------------------------------------------------- codec and samples


def codec_folder(name_or_path: str, what: str) -> Path:
    """A codec's local folder (it keys the codec cache): the processor's path, or its hub id's snapshot."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        return hub_snapshot(name_or_path)
    except NotAvailableLocally as err:
        raise FamilyError(f"{what}: {err}") from None


def take_audio_tokenizer(processor, folder: Path, dtype: torch.dtype, what: str, latents_kind: str):
    """(codec, its local folder, the latents' layout) of a flow-head TTS folder: the processor's audio tokenizer,
    frozen in `dtype` (every rank whole: the clips' latents and the samples' decoding), `what` naming it in errors."""
    codec = processor.audio_tokenizer
    if codec is None or codec.config.encoder_config is None:
        raise FamilyError(f"{folder}: its processor has no audio tokenizer with an encoder to encode clips")
    codec = codec.to(dtype).eval().requires_grad_(False)
    layout = {
        "sampling_rate": int(processor.feature_extractor.sampling_rate),
        "frame_rate": float(codec.config.frame_rate),
        "num_codebooks": int(codec.config.latent_dim),  # values per latent frame
        "frame_order": [],
        "codec": latents_kind,
    }
    return codec, codec_folder(codec.name_or_path, what), layout


def encode_latents(codec, processor, wave) -> torch.Tensor:
    """(frames, D) float32 latents of one clip (1-D float at the processor's rate), as the processor encodes a
    training clip: the feature extractor without end-on-pause, then the audio tokenizer's encoder, the clip's own
    frames."""
    extractor = processor.feature_extractor
    with quiet_hf_libraries():
        values = extractor(
            np.asarray(wave, dtype=np.float32), sampling_rate=extractor.sampling_rate, end_on_pause=False
        )
    weight = next(codec.parameters())
    with torch.no_grad():
        encoded = codec.encode(
            values["input_values"].to(weight.device, weight.dtype), values["padding_mask"].to(weight.device)
        )
    return at_least_float32(encoded.latents[0][encoded.latents_mask[0].bool()]).cpu()


def generate_wave(
    model,
    processor,
    text: str,
    max_frames: int,
    temperature: float,
    seed: int,
    voice=None,
    voice_latents: Optional[torch.Tensor] = None,
):
    """The waveform (float32 numpy) the class's own generate makes for `text` and the processor decodes, from `seed`
    without touching the caller's random state; every rank runs the same calls. The voice: `voice` (a waveform the
    processor encodes) or `voice_latents` (a voice prompt encoded already), else none."""
    device = next(model.parameters()).device
    try:
        with quiet_hf_libraries():
            if voice_latents is not None:
                inputs = processor(
                    text=[chat_prompt(processor, text, voiced=True)],
                    audio_prompt_latents=[voice_latents.float().cpu()],
                    return_tensors="pt",
                )
            else:
                content = ([{"type": "audio", "audio": np.asarray(voice, np.float32)}] if voice is not None else []) + [
                    {"type": "text", "text": " ".join(text.split())}
                ]
                inputs = processor.apply_chat_template(
                    [{"role": "user", "content": content}], tokenize=True, return_dict=True, return_tensors="pt"
                )
    except ValueError as err:
        raise FamilyError(f"the processor cannot prepare {text[:40]!r} ({first_line(err)})") from None
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_hf_libraries():
        torch.manual_seed(seed)
        latents = model.generate(
            **inputs, max_new_tokens=max_frames, temperature=temperature, return_dict_in_generate=False
        )
    wave = processor.decode(latents[0].float().cpu())
    return wave.reshape(-1).float().numpy()


@contextmanager
def gathered(trainable_module):
    """The whole class gathered under ZeRO-3 (generate runs the class directly, inside the leaf module that gathers
    it for the training forward only); every rank makes the same calls. Without ZeRO-3 nothing happens."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(trainable_module.parameters()), modifier_rank=None):
        yield

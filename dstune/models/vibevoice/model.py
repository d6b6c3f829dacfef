"""VibeVoice's torch side (VibeVoiceForConditionalGeneration) in the tts_codebooks family: a Qwen2 LM over the
script's text and the speech's continuous acoustic latents (7.5 per second), whose hidden state conditions a
diffusion head that denoises the next latent. The family calls these for a VibeVoice folder (its recipe,
dstune.models.vibevoice.facts.CODEBOOKS_MODEL, names this module).

    build(model, folders, device, dtype) -> VibeVoiceBuilt
    encode_batch(built, batch) -> token ids, latents, labels and the diffusion's condition positions
    loss(built, forward, encoded, seed, step) -> the class's LM loss from labels and its own compute_diffusion_loss
    sample(built, module, prompts, sample_spec) / synthesize(folder, text, ...) -> Clips, through the class's generate

The "codec" is the class's own acoustic tokenizer (`model.audio_tower`): a frozen fp32 copy of it, outside the
trained module, encodes each clip alone (the processor's feature extractor first: -25 dB FS, zero-padded to the
hop) into its latents, which the codec cache holds (float32, one row per frame). The trained module keeps the
whole class, tokenizers included but frozen, so that generate and the export are the class's own.

One utterance is what the processor's chat template writes for a script, then the speech as generate produces it:
    system prompt, " Text input:\\n", " Speaker N: text\\n" per turn, " Speech output:\\n", <audio BOS>,
    one <audio> per latent, <audio EOS>, <|endoftext|>
The labels are the ids with -100 on padding only; the class shifts them. Two deliberate differences from what the
processor builds with output_labels=True (docs/tts.md, VibeVoice), both taken from what generate does:
- the <audio> placeholders stay targets. generate continues the speech while the LM's argmax is <audio> and stops
  at <audio EOS>; with the placeholders masked (the processor) the LM only ever learns <audio EOS> there, and after
  a few steps it ends every utterance at once (seen on builtin:tiny-vibevoice: silent samples after 4 steps).
- each latent is diffused from the LM's hidden state one position before its own placeholder (the audio BOS for the
  first), the state generate conditions the diffusion head on. The processor's acoustic_loss_mask marks the
  placeholders themselves: a state that has already seen, as its input, the latent it is asked to denoise.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.precision import at_least_float32, at_least_float32_dtype
from dstune.families.randomness import sample_seed
from dstune.families.speech import Clip, CodecTokensBuilt, checkpoint_activations
from dstune.hf import quiet_hf_libraries
from dstune.models.vibevoice.facts import ARCHITECTURE, CODEBOOKS_MODEL, LATENTS_KIND, config_problem
from dstune.resampling import resample

DDPM_BATCH_MULTIPLIER = 4  # noise draws per latent (the class's default, and the original trainer's)
DIFFUSION_PURPOSE = "vibevoice-diffusion"  # the per-sample draw of the diffusion's noise and timesteps
DEFAULT_SPEAKER = "0"
TURN = re.compile(r"^\s*Speaker\s+(\d+)\s*:\s*(.*)$")
FACTORS = ("latent_scaling_factor", "latent_bias_factor")  # the tokenizer's latent statistics: set with it, not learnt
# the class's tokenizers (never trained), and the semantic connector, which only generate uses (the class's training
# forward embeds the acoustic latents alone): no gradient reaches it
FROZEN = tuple("model." + part for part in CODEBOOKS_MODEL.frozen_parts if part.rsplit(".", 1)[-1] not in FACTORS)


def factors_as_buffers(model) -> None:
    """The class's latent scaling and bias (frozen scalars) become buffers of the same names: generate and the
    training step read them outside the forward of the module that holds them, where ZeRO-3 would have left each
    rank an empty share of a parameter; buffers stay whole on every rank. The state dict keeps their names."""
    inner = model.model
    for name in FACTORS:
        value = inner._parameters.pop(name).detach().clone()
        inner.register_buffer(name, value)


class VibeVoiceModule(torch.nn.Module):
    """The trained module: the whole class under `model.` (the family's export and LoRA code find its names)."""

    def __init__(self, model, scheduler, diffusion_steps: int):
        super().__init__()
        self.model = model
        self.scheduler = scheduler
        self.diffusion_steps = diffusion_steps

    def forward(self, input_ids, attention_mask, latents, labels, audio_mask, condition_mask, seeds):
        """latents (A, D): every <audio> placeholder's latent in row-major order; condition_mask (B, S): where each
        latent's condition is read; seeds (B,): each sample's draw. The class's loss: (1 - w) LM + w diffusion."""
        outer = self.model
        inner = outer.model
        # as VibeVoiceModel.forward does with input_values: the scaled latents, projected, replace the placeholders
        features = ((latents + inner.latent_bias_factor) * inner.latent_scaling_factor).to(latents.dtype)
        embeds = outer.get_input_embeddings()(input_ids)
        projected = inner.multi_modal_projector(features).to(embeds.dtype)
        embeds = embeds.masked_scatter(audio_mask.unsqueeze(-1).expand_as(embeds), projected)
        out = outer(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)
        weight = outer.config.diffusion_loss_weight
        if weight <= 0:
            return out.loss, out.loss, out.loss * 0
        diffusion = self.diffusion_loss(out.last_hidden_state, features, audio_mask, condition_mask, seeds)
        return (1 - weight) * out.loss + weight * diffusion, out.loss, diffusion

    def diffusion_loss(self, hidden, features, audio_mask, condition_mask, seeds):
        """The class's compute_diffusion_loss sample by sample, each with its own seeded noise and timesteps (so
        the draw does not depend on the micro batch or the rank), averaged over every latent of the batch as the
        class averages its one call over the batch."""
        counts = audio_mask.sum(1).tolist()
        starts = np.cumsum([0] + counts)
        total, weighted = sum(counts), 0
        device = features.device
        for row, count in enumerate(counts):
            if not count:
                continue
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(int(seeds[row]))
                part = type(self.model).compute_diffusion_loss(
                    self.model.model.diffusion_head,
                    features[starts[row] : starts[row + 1]],
                    hidden[row][condition_mask[row]],
                    self.scheduler,
                    DDPM_BATCH_MULTIPLIER,
                    self.diffusion_steps,
                )
            weighted = weighted + part * (count / total)
        return weighted if total else hidden.sum() * 0


@dataclass(kw_only=True)
class VibeVoiceBuilt(CodecTokensBuilt):
    architecture: str
    processor: object


def load(folder: Path):
    """(model, processor) of a VibeVoice folder, fp32; FamilyError naming the folder when either cannot be loaded."""
    from transformers import VibeVoiceForConditionalGeneration, VibeVoiceProcessor

    try:
        with quiet_hf_libraries():
            model = VibeVoiceForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32)
            processor = VibeVoiceProcessor.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as err:
        raise FamilyError(
            f"{folder}: cannot load it as {ARCHITECTURE} with its VibeVoiceProcessor "
            f"({(str(err).strip().splitlines() or [''])[0]})"
        ) from None
    return model, processor


def noise_scheduler(model):
    """The diffusion's training scheduler: the one the class builds from its generation_config (diffusers)."""
    return model._build_default_noise_scheduler(model.generation_config)


def build(model, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32) -> VibeVoiceBuilt:
    folder = folders["pretrained"]
    problem = config_problem(json.loads((folder / "config.json").read_text()))
    if problem:  # transformers would load it as a default-sized model with none of its weights
        raise FamilyError(f"{folder}: {problem}")
    whole, processor = load(folder)
    codec = copy.deepcopy(whole.model.audio_tower).to(at_least_float32_dtype(dtype_for_frozen))
    codec.eval().requires_grad_(False)
    rate, hop = int(processor.feature_extractor.sampling_rate), int(whole.config.audio_config.hop_length)
    layout = {
        "sampling_rate": rate,
        "frame_rate": rate / hop,
        "num_codebooks": int(whole.config.audio_config.hidden_size),  # values per latent frame
        "frame_order": [],
        "codec": LATENTS_KIND,
    }
    if model.gradient_checkpointing:
        checkpoint_activations(whole)
    factors_as_buffers(whole)
    scheduler = noise_scheduler(whole)
    trainable = VibeVoiceModule(whole, scheduler, int(scheduler.config.num_train_timesteps)).train()
    trainable.requires_grad_(True)
    for name in FROZEN:
        trainable.get_submodule(name).requires_grad_(False).eval()
    device = torch.device(device)
    return VibeVoiceBuilt(
        folder=folder,
        device=device,
        trainable=trainable,
        codec=codec.to(device),
        codec_folder=folder,
        codec_kind=LATENTS_KIND,
        architecture=ARCHITECTURE,
        processor=processor,
        layout=layout,
        max_sample_seconds=model.max_sample_seconds,
        temperature=model.sample_temperature,
        clip_encoder=lambda wave: encode_latents(codec, processor, wave),
    )


# --------------------------------------------------------------------------------------------- train step


def encode_latents(codec, processor, wave) -> torch.Tensor:
    """(frames, D) float32 (float64 from a float64 codec) latents of one clip (1-D float at the processor's rate), as the class's forward makes
    them from the processor's input_values with sample=False: the feature extractor's loudness normalisation and
    padding, then the acoustic tokenizer's encoder, one frame per started hop."""
    rate = processor.feature_extractor.sampling_rate
    values = processor.feature_extractor(
        np.asarray(wave, dtype=np.float32), sampling_rate=rate, return_tensors="pt", return_attention_mask=True
    )
    frames = math.ceil(int(values["padding_mask"].sum()) / codec.config.hop_length)
    with torch.no_grad():
        weight = next(codec.parameters())
        latents = codec.encode(values["input_values"].to(weight.device, weight.dtype), sample=False).latents
    return at_least_float32(latents[0, :frames]).cpu()


def turns(text: str, speaker: str = "") -> list[tuple[str, str]]:
    """(speaker number, text) turns of a transcript: its "Speaker N: ..." lines, else one turn of the clip's
    speaker when that is a number (VibeVoice's speakers are numbers), else of speaker 0."""
    found = [m.groups() for m in map(TURN.match, text.strip().splitlines()) if m]
    if found:
        return [(number, words.strip()) for number, words in found]
    role = speaker if speaker.isdigit() else DEFAULT_SPEAKER
    return [(role, " ".join(text.split()))]


def script_messages(text: str, speaker: str = "", voice=None) -> list[dict]:
    """The processor's chat messages for a script; `voice` (a waveform) is the first speaker's reference clip."""
    messages = [{"role": role, "content": [{"type": "text", "text": words}]} for role, words in turns(text, speaker)]
    if voice is not None:
        messages[0]["content"].append({"type": "audio", "audio": np.asarray(voice, np.float32)})
    return messages


def prompt_ids(processor, text: str, speaker: str = "") -> list[int]:
    """The chat template's ids up to and including the speech output's audio BOS."""
    rendered = processor.apply_chat_template(script_messages(text, speaker), tokenize=False)
    rendered = rendered[0] if isinstance(rendered, list) else rendered
    return processor.tokenizer(rendered, add_special_tokens=False).input_ids


def utterance(config, prompt: list[int], frames: int, end_id: int) -> list[int]:
    return prompt + [config.audio_token_id] * frames + [config.audio_eos_token_id, end_id]


def encode_batch(built: VibeVoiceBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The class's inputs for a batch, right-padded with <|endoftext|>. A cached batch holds each clip's latents
    as "codes"; otherwise each clip is encoded alone by the frozen acoustic tokenizer."""
    config, tokenizer = built.trainable.model.config, built.processor.tokenizer
    latents = batch.get("codes") or [built.clip_encoder(wave.numpy()) for wave in batch["audio"]]
    speakers = batch.get("speakers") or [""] * len(batch["texts"])
    end_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rows = [
        utterance(config, prompt_ids(built.processor, text, speaker), len(clip), end_id)
        for text, speaker, clip in zip(batch["texts"], speakers, latents)
    ]
    length = max(map(len, rows))
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = torch.tensor(ids), 1
    audio_mask = input_ids == config.audio_token_id
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # the placeholders are targets: "continue"
    condition_mask = torch.zeros_like(audio_mask)
    condition_mask[:, :-1] = audio_mask[:, 1:]  # the position before each latent's own
    device = built.device
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "latents": torch.cat([at_least_float32(c) for c in latents]).to(device, dtype),
        "labels": labels.to(device),
        "audio_mask": audio_mask.to(device),
        "condition_mask": condition_mask.to(device),
        "indices": torch.as_tensor(batch["index"], dtype=torch.long),
    }


TRAIN_KEYS = ("input_ids", "attention_mask", "latents", "labels", "audio_mask", "condition_mask")


def loss(built: VibeVoiceBuilt, trainable_forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """(1 - diffusion_loss_weight) x the class's LM loss from the labels + diffusion_loss_weight x its
    compute_diffusion_loss; each sample's noise and timesteps from (seed, step, its dataset index)."""
    seeds = torch.tensor([sample_seed(seed, step, int(i), DIFFUSION_PURPOSE) for i in encoded["indices"]])
    total, _, _ = trainable_forward(**{k: encoded[k] for k in TRAIN_KEYS}, seeds=seeds)
    return at_least_float32(total)


# ------------------------------------------------------------------------------------------------- sampling


def generate_wave(model, processor, text: str, max_frames: int, seed: int, voice=None) -> np.ndarray:
    """The waveform the class's own generate makes for `text` (after a reference voice when given), from `seed`
    without touching the caller's random state; every rank runs the same calls."""
    inputs = processor.apply_chat_template(
        script_messages(text, voice=voice), tokenize=True, return_dict=True, return_tensors="pt"
    )
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_hf_libraries():
        torch.manual_seed(seed)
        audio = model.generate(**inputs, max_new_tokens=max_frames + 2)
    wave = audio[0] if audio and audio[0] is not None else None
    return np.zeros(0, np.float32) if wave is None else wave.reshape(-1).float().cpu().numpy()


def voice_prompt(path, sample_rate: int) -> np.ndarray:
    """A reference clip at `sample_rate` (its transcript is not part of VibeVoice's voice input)."""
    import soundfile

    try:
        wave, rate = soundfile.read(str(Path(path).expanduser()), dtype="float32", always_2d=True)
    except (OSError, RuntimeError) as err:
        raise FamilyError(f"sample.voice_prompts: {path} cannot be read ({str(err).splitlines()[0]})") from None
    return resample(wave.mean(axis=1), rate, sample_rate)


def sample(built: VibeVoiceBuilt, lm_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
    """One clip per prompt, from sample_spec.seed, through the class's own generate (every rank: ZeRO-3); in the
    voice of its reference clip when sample.voice_prompts names one per prompt."""
    inner = getattr(lm_module, "model", lm_module)
    was_training = inner.training
    inner.eval()
    max_frames = max(1, int(built.max_sample_seconds * built.layout["frame_rate"]))
    voices = [voice_prompt(path, built.sample_rate) for path in getattr(sample_spec, "voice_prompts", None) or []]
    clips = []
    try:
        with torch.no_grad():
            for number, prompt in enumerate(prompts):
                wave = generate_wave(
                    inner,
                    built.processor,
                    prompt,
                    max_frames,
                    sample_spec.seed * 1000 + number,
                    voices[number] if voices else None,
                )
                clips.append(Clip(wave, built.sample_rate))
    finally:
        inner.train(was_training)
    return clips


def synthesize(folder, text: str, seconds: float = 2.0, temperature: float = 0.0, seed: int = 0, voice=None) -> Clip:
    """Speech for `text` from a VibeVoice folder with the class and its processor only (generate picks tokens by
    argmax; `temperature` is not used by VibeVoice's generate)."""
    model, processor = load(Path(folder))
    model.eval()
    rate = int(processor.feature_extractor.sampling_rate)
    frames = max(1, int(seconds * rate / model.config.audio_config.hop_length))
    with torch.no_grad():
        wave = generate_wave(model, processor, text, frames, seed, voice)
    return Clip(wave, rate)

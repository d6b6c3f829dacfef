"""Dia's torch side (DiaForConditionalGeneration) in the tts_codebooks family: a byte-level text encoder and an audio
decoder that predicts every DAC codebook of a frame at once, each codebook delayed by its entry of the delay pattern
(Dia-1.6B: [0, 8, 9, ..., 15] over 9 codebooks). The family calls these for a Dia folder (its recipe,
dstune.models.dia.facts.CODEBOOKS_MODEL, names this module; dstune.families.codebook_models says what it holds).

    build(model, folders, device, dtype) -> DiaBuilt
    encode_batch(built, batch) -> the class's inputs and labels, as DiaProcessor(..., output_labels=True) makes them
    sample(built, module, prompts, sample_spec) / synthesize(folder, text, ...) -> Clips

Dia keeps its codec outside the model class: the DiaProcessor holds the DacModel (`audio_tokenizer`, named by path
in processor_config.json). It is frozen, fp32 and whole on every rank; each clip is encoded alone, zero-padded to a
multiple of DAC's hop as the processor pads it, so the codes are cacheable and equal to the processor's.

One utterance, as the processor builds it for training (generation=False): the text's bytes ([S1]/[S2] are ids 1
and 2) on the encoder side; on the decoder side BOS, the frames' codes, EOS, then the delay pattern applied
(codebook c shifted right by delay[c], BOS before, PAD after), left-padded with BOS to the batch's longest clip.
The labels are the delayed sequence one position ahead, -100 on BOS and PAD: the class's loss is the mean
cross-entropy over every codebook of every remaining position (transformers' ForMaskedLM loss: no further shift).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.precision import at_least_float32, at_least_float32_dtype
from dstune.families.speech import Clip, CodecTokensBuilt, checkpoint_activations
from dstune.families.speech_codecs import decode_codes, encode_clip
from dstune.hf import NotAvailableLocally, hub_snapshot, quiet_hf_libraries
from dstune.models.dia.facts import ARCHITECTURE
from dstune.resampling import resample

CODEC_KIND = "dac_hop_padded"  # dstune.families.speech_codecs: DAC on the clip zero-padded to a multiple of its hop
SPEAKER_TAGS = ("[S1]", "[S2]")  # Dia's dialogue turns; a text must start with one


class DiaModule(torch.nn.Module):
    """The trained module: the whole class (its codec is not part of it), under `model.`, so that the family's
    export and LoRA code find the class's own names there."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels=None):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            labels=labels,
        )


@dataclass(kw_only=True)
class DiaBuilt(CodecTokensBuilt):
    architecture: str
    processor: object


def codec_folder(name_or_path: str) -> Path:
    """The DAC's local folder (it keys the codec-token cache): the processor's path, or its hub id's snapshot."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        return hub_snapshot(name_or_path)
    except NotAvailableLocally as err:
        raise FamilyError(f"Dia's audio tokenizer (processor_config.json): {err}") from None


def load(folder: Path):
    """(model, processor) of a Dia folder, fp32; FamilyError naming the folder when either cannot be loaded."""
    from transformers import DiaForConditionalGeneration, DiaProcessor

    try:
        with quiet_hf_libraries():
            model = DiaForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32)
            processor = DiaProcessor.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(
            f"{folder}: cannot load it as {ARCHITECTURE} with its DiaProcessor and DAC "
            f"({(str(err).strip().splitlines() or [''])[0]})"
        ) from None
    return model, processor


def build(model, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32) -> DiaBuilt:
    folder = folders["pretrained"]
    whole, processor = load(folder)
    codec = processor.audio_tokenizer.to(at_least_float32_dtype(dtype_for_frozen)).eval().requires_grad_(False)
    rate, hop = int(codec.config.sampling_rate), int(codec.config.hop_length)
    channels = int(whole.config.decoder_config.num_channels)
    layout = {
        "sampling_rate": rate,
        "frame_rate": rate / hop,
        "num_codebooks": channels,
        "frame_order": [[q, 0] for q in range(channels)],
        "codec": CODEC_KIND,
    }
    if model.gradient_checkpointing:
        checkpoint_activations(whole)
    device = torch.device(device)
    trainable = DiaModule(whole).train().requires_grad_(True)
    return DiaBuilt(
        folder=folder,
        device=device,
        trainable=trainable,
        codec=codec.to(device),
        codec_folder=codec_folder(codec.name_or_path),
        codec_kind=CODEC_KIND,
        architecture=ARCHITECTURE,
        processor=processor,
        layout=layout,
        max_sample_seconds=model.max_sample_seconds,
        temperature=model.sample_temperature,
    )


# --------------------------------------------------------------------------------------------- train step


def dia_text(text: str) -> str:
    """A clip's transcript as Dia reads it: kept when it starts with a speaker tag ([S1]/[S2], a dialogue's
    turns), else spoken by [S1]."""
    text = text.strip()
    return text if text.startswith(SPEAKER_TAGS) else f"{SPEAKER_TAGS[0]} {text}"


def delayed(frames: torch.Tensor, delays: list[int], bos: int, pad: int) -> torch.Tensor:
    """(B, T, C) frames -> the delay pattern: codebook c shifted right by delays[c] (BOS in front), the sequence
    extended by max(delays) positions of PAD so that every codebook's last code is kept."""
    batch, length, channels = frames.shape
    extended = torch.cat([frames, torch.full((batch, max(delays), channels), pad, dtype=frames.dtype)], 1)
    out = torch.empty_like(extended)
    for channel, delay in enumerate(delays):
        out[:, :delay, channel] = bos
        out[:, delay:, channel] = extended[:, : extended.shape[1] - delay, channel]
    return out


def decoder_batch(config, codes: list[torch.Tensor]) -> dict:
    """decoder_input_ids (B, T, C), decoder_attention_mask (B, T) and labels (B * C, T), channel-major, from each
    clip's (C, frames) codes: [BOS, frames..., EOS] left-padded with BOS to the longest clip, then delayed."""
    bos, eos, pad = (
        config.decoder_config.bos_token_id,
        config.decoder_config.eos_token_id,
        config.decoder_config.pad_token_id,
    )
    delays, channels = list(config.delay_pattern), config.decoder_config.num_channels
    longest = max(c.shape[1] for c in codes)
    frames = torch.full((len(codes), longest + 2, channels), bos, dtype=torch.long)
    mask = torch.zeros((len(codes), longest + 2 + max(delays)), dtype=torch.long)
    for row, clip in enumerate(codes):
        padding = longest - clip.shape[1]
        frames[row, padding + 1 : padding + 1 + clip.shape[1]] = clip.t().long()
        frames[row, -1] = eos
        mask[row, padding:] = 1
    sequence = delayed(frames, delays, bos, pad)
    labels = sequence[:, 1:].clone()
    labels[(labels == pad) | (labels == bos)] = -100
    labels = (
        labels.transpose(1, 2).reshape(len(codes) * channels, -1).contiguous()
    )  # one clip: a view; the loss views it flat
    return {"decoder_input_ids": sequence[:, :-1], "decoder_attention_mask": mask[:, :-1], "labels": labels}


def text_batch(tokenizer, texts: list[str]) -> dict:
    """The encoder's input_ids and attention_mask: each text's bytes (with its speaker tags), right-padded."""
    rows = [tokenizer(dia_text(text), add_special_tokens=False).input_ids for text in texts]
    input_ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = torch.tensor(ids), 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def encode_batch(built: DiaBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The class's inputs for a batch: text right-padded (pad id 0), audio as decoder_batch. A cached batch holds
    "codes"; otherwise each clip is encoded alone by the frozen DAC."""
    layout, config = built.layout, built.trainable.model.config
    codes = batch.get("codes") or [
        encode_clip(built.codec, CODEC_KIND, wave, layout["num_codebooks"]) for wave in batch["audio"]
    ]
    encoded = {**text_batch(built.processor.tokenizer, batch["texts"]), **decoder_batch(config, codes)}
    return {
        **{k: v.to(built.device) for k, v in encoded.items()},
        "indices": torch.as_tensor(batch["index"], dtype=torch.long),
    }


def loss(built: DiaBuilt, trainable_forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The class's own loss from the labels (mean over every labelled codebook position); no random draws."""
    out = trainable_forward(
        **{
            k: encoded[k]
            for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")
        }
    )
    return at_least_float32(out.loss)


# ------------------------------------------------------------------------------------------------- sampling


def undelayed_codes(config, sequence: torch.Tensor, start: int) -> torch.Tensor:
    """(C, frames) codes of a generated (T, C) delayed sequence: the delay reverted, from frame `start` (after BOS
    and any voice prompt) up to the first EOS of codebook 0 (or the last frame every codebook reached)."""
    delays, eos = list(config.delay_pattern), config.decoder_config.eos_token_id
    usable = sequence.shape[0] - max(delays)
    frames = (
        torch.stack([sequence[d : d + usable, c] for c, d in enumerate(delays)], 1) if usable > 0 else (sequence[:0])
    )
    ended = (frames[:, 0] == eos).nonzero()
    end = int(ended[0]) if len(ended) else len(frames)
    codes = frames[start:end]
    return codes.clamp(max=eos - 1).t().long()  # a codebook other than 0 may not have stopped yet: keep it a code


def generate_codes(
    model,
    processor,
    text: str,
    max_frames: int,
    temperature: float,
    seed: int,
    prompt_audio: np.ndarray | None = None,
    prompt_text: str = "",
) -> torch.Tensor:
    """(C, frames) codes the class's own generate makes for `text` (after a voice prompt: its audio and transcript,
    which Dia continues), from `seed` without touching the caller's random state; every rank runs the same calls.
    Guidance, top-k and top-p are the folder's generation_config's; the temperature is the caller's."""
    words = dia_text(f"{prompt_text.strip()} {text}" if prompt_audio is not None else text)
    audio = (
        {}
        if prompt_audio is None
        else {
            "audio": [np.asarray(prompt_audio, np.float32)],
            "sampling_rate": processor.feature_extractor.sampling_rate,
        }
    )
    with warnings.catch_warnings():  # DiaTokenizer's own max_length meets the processor's padding=True
        warnings.filterwarnings("ignore", message="`max_length` is ignored")
        inputs = processor(text=[words], **audio).to(next(model.parameters()).device)
    start = int((inputs["decoder_input_ids"][0, :, 0] != model.config.decoder_config.pad_token_id).sum())
    sampling = {"do_sample": temperature > 0, **({"temperature": temperature} if temperature > 0 else {})}
    with torch.random.fork_rng(devices=[]), quiet_hf_libraries():
        torch.manual_seed(seed)
        sequence = model.generate(**inputs, max_new_tokens=max_frames, **sampling)
    return undelayed_codes(model.config, sequence[0].cpu(), start)


def _wave(codec, codes: torch.Tensor) -> np.ndarray:
    return decode_codes(codec, "dac", codes) if codes.shape[1] else np.zeros(0, np.float32)


def voice_prompt(path, sample_rate: int) -> tuple[np.ndarray, str]:
    """(wave at `sample_rate`, transcript) of a reference clip and the .txt of the same name beside it."""
    import soundfile

    path = Path(path).expanduser()
    try:
        wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        text = path.with_suffix(".txt").read_text().strip()
    except (OSError, RuntimeError) as err:
        raise FamilyError(
            f"sample.voice_prompts: {path} (and its .txt transcript) cannot be read ({str(err).splitlines()[0]})"
        ) from None
    return resample(wave.mean(axis=1), rate, sample_rate), text


def sample(built: DiaBuilt, lm_module: torch.nn.Module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
    """One clip per prompt, from sample_spec.seed, through the class's own generate (every rank: ZeRO-3); after
    its reference clip when sample.voice_prompts names one per prompt."""
    inner = getattr(lm_module, "model", lm_module)
    was_training = inner.training
    inner.eval()
    max_frames = max(1, int(built.max_sample_seconds * built.layout["frame_rate"]))
    voices = [voice_prompt(path, built.sample_rate) for path in getattr(sample_spec, "voice_prompts", None) or []]
    clips = []
    try:
        with torch.no_grad():
            for number, prompt in enumerate(prompts):
                audio, text = voices[number] if voices else (None, "")
                codes = generate_codes(
                    inner,
                    built.processor,
                    prompt,
                    max_frames,
                    built.temperature,
                    sample_spec.seed * 1000 + number,
                    audio,
                    text,
                )
                clips.append(Clip(_wave(built.codec, codes), built.sample_rate))
    finally:
        inner.train(was_training)
    return clips


def synthesize(
    folder,
    text: str,
    seconds: float = 2.0,
    temperature: float = 1.8,
    seed: int = 0,
    prompt_audio: np.ndarray | None = None,
    prompt_text: str = "",
) -> Clip:
    """Speech for `text` from a Dia folder with the class, its processor and its DAC only; with `prompt_audio`
    (at the DAC's rate) and its transcript `prompt_text`, in that voice."""
    model, processor = load(Path(folder))
    model.eval()
    codec = processor.audio_tokenizer.eval()
    frames = max(1, int(seconds * codec.config.sampling_rate / codec.config.hop_length))
    with torch.no_grad():
        codes = generate_codes(model, processor, text, frames, temperature, seed, prompt_audio, prompt_text)
        wave = _wave(codec, codes)
    return Clip(wave, int(codec.config.sampling_rate))

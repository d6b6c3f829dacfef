"""The `tts_codebooks` family: TTS models that predict several codec codebooks per audio frame, trained through
their own transformers class and loss. The folder's `architectures` says which model it is: Sesame CSM
(CsmForConditionalGeneration: a Llama-shaped backbone over text ids and Mimi frames predicts codebook 0 of the next
frame; a depth decoder, started from the backbone's hidden state, predicts codebooks 1..Q-1 of that frame), and
the classes other units declare on this family (dstune.families.codebook_models, told by the folder's
architecture): the functions below hand a folder of theirs to their own torch side, and export theirs as CSM's.

    build(model, folders, device, dtype_for_frozen) -> CodebooksBuilt
    encode_batch(built, batch, dtype) -> {"input_ids", "frame_codes", "attention_mask", "labels", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar: the class's own loss (backbone + depth decoder)
    sample / save_samples / export / save_lora_weights as the other families

CSM's codec (Mimi) is a submodule of its class. dstune takes it out of the trained module: it stays frozen and fp32,
whole on every rank (never partitioned by ZeRO-3), and encodes each clip alone, so codes are cacheable
(data.cache.codec_tokens, dstune.cache.codec_tokens) and the same for any batch or rank count. The trained module
(`CodebookFramesModel`) holds the rest of the class and does what the class does with `input_values`: each audio
frame's codes are embedded in place of its <|AUDIO|> token, the audio EOS frame (all codes = codebook_eos_token_id)
in place of <|audio_eos|>, and the labels are those codes; then the class's own forward computes the loss.

One utterance is what CSM's processor and chat template make of a (speaker, text, audio) turn:
<|begin_of_text|>[speaker]text<|end_of_text|> <|AUDIO|> x frames <|audio_eos|>, labels on the frames and the EOS frame.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from dstune.families.base import Family, FamilyError, Speaker
from dstune.families.precision import at_least_float32, at_least_float32_dtype
from dstune.families.speech import Clip, CodecTokensBuilt, checkpoint_activations, save_wavs
from dstune.families.speech_codecs import decode_codes, encode_clip
from dstune.families.codebook_models import codebooks_models
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries

CODEC_ATTRIBUTE = {"CsmForConditionalGeneration": "codec_model"}  # where each class keeps its codec
CODEC_KIND = {"CsmForConditionalGeneration": "mimi"}  # dstune.families.speech_codecs' name for it
DEFAULT_SPEAKER = "0"  # CSM's prompts name a speaker ("[0]Hello."); clips without one are speaker 0
ARCHITECTURES = (*CODEC_ATTRIBUTE, *codebooks_models())  # the classes this family trains


def _declared(architecture: str):
    """The torch side of a class another unit declared on this family (None for CSM, this module's own)."""
    model = codebooks_models().get(architecture)
    return None if model is None else importlib.import_module(model.torch_side)


class CodebookFramesModel(torch.nn.Module):
    """The trained part of a CSM: the class without its codec, taking the frames' codes instead of audio."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, frame_codes, attention_mask, labels=None):
        """input_ids (B, S) text and frame tokens; frame_codes (B, S, Q) the codes at the frame tokens (anything
        elsewhere); labels (B, S, Q): codes to predict, -100 elsewhere. The class's own output (loss from labels)."""
        config = self.model.config
        is_frame = (input_ids == config.audio_token_id) | (input_ids == config.audio_eos_token_id)
        text = self.model.embed_text_tokens(input_ids)
        frames = self.model.backbone_model.embed_tokens(frame_codes)
        embeds = torch.where(is_frame.unsqueeze(-1), frames, text)
        return self.model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)


@dataclass(kw_only=True)
class CodebooksBuilt(CodecTokensBuilt):
    """`trainable` is the CodebookFramesModel; the codec folder is the model folder (the codec's weights are in
    it)."""

    architecture: str
    processor: object


def folder_architecture(folder: Path) -> str:
    """The class named in the folder's config.json; FamilyError when this family does not train it."""
    try:
        names = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as err:
        raise FamilyError(f"{folder}: no readable config.json ({err})") from None
    known = [name for name in names if name in ARCHITECTURES]
    if not known:
        raise FamilyError(
            f"{folder}: its config.json names {names or 'no class'}; model.family tts_codebooks trains "
            f"{', '.join(ARCHITECTURES)}"
        )
    return known[0]


def trains_folder(folder: Path) -> bool:
    """Whether `folder` holds a class this family trains (a tts_codebooks export, for `dstune synthesize`)."""
    try:
        folder_architecture(folder)
    except FamilyError:
        return False
    return True


def build(model, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32) -> CodebooksBuilt:
    """Load the class (fp32, train mode) and its processor, and take the codec out of the trained module."""
    import transformers
    from transformers import AutoProcessor

    folder = folders["pretrained"]
    architecture = folder_architecture(folder)
    if _declared(architecture) is not None:
        return _declared(architecture).build(model, folders, device, dtype_for_frozen)
    try:
        with quiet_hf_libraries():
            whole = getattr(transformers, architecture).from_pretrained(folder, torch_dtype=torch.float32)
            processor = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(
            f"{folder}: cannot load it as {architecture} with its processor "
            f"({(str(err).strip().splitlines() or [''])[0]})"
        ) from None
    codec = getattr(whole, CODEC_ATTRIBUTE[architecture]).to(at_least_float32_dtype(dtype_for_frozen))
    codec.eval().requires_grad_(False)
    setattr(whole, CODEC_ATTRIBUTE[architecture], None)  # frozen and whole on every rank, outside DeepSpeed
    codec_config, config = codec.config, whole.config
    layout = {
        "sampling_rate": int(codec_config.sampling_rate),
        "frame_rate": float(codec_config.frame_rate),
        "num_codebooks": int(config.num_codebooks),
        "frame_order": [[q, 0] for q in range(config.num_codebooks)],
        "codec": CODEC_KIND[architecture],
    }
    if model.gradient_checkpointing:
        checkpoint_activations(whole)
    device = torch.device(device)
    # left in host memory in fp32: the start-up casts it to the training dtype, then moves it (engine.place_trainable)
    trainable = CodebookFramesModel(whole).train().requires_grad_(True)
    return CodebooksBuilt(
        folder=folder,
        device=device,
        trainable=trainable,
        codec=codec.to(device),
        codec_folder=folder,
        codec_kind=CODEC_KIND[architecture],
        architecture=architecture,
        processor=processor,
        layout=layout,
        max_sample_seconds=model.max_sample_seconds,
        temperature=model.sample_temperature,
    )


# --------------------------------------------------------------------------------------------- train step


def prompt_ids(built: CodebooksBuilt, text: str, speaker: str) -> list[int]:
    """<|begin_of_text|>[speaker]text<|end_of_text|>: a turn's text as CSM's chat template writes it."""
    tokenizer = built.processor.tokenizer
    body = tokenizer(f"[{speaker or DEFAULT_SPEAKER}]{text}", add_special_tokens=False).input_ids
    return [tokenizer.bos_token_id] + list(body) + [tokenizer.eos_token_id]


def utterance(config, prompt: list[int], codes: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(ids, frame codes (S, Q), labels (S, Q)) of one turn: the prompt, one <|AUDIO|> per frame of `codes`
    (Q, frames) and <|audio_eos|>; the labels are the frames' codes and the EOS frame, -100 on the prompt."""
    frames = codes.shape[1]
    ids = prompt + [config.audio_token_id] * frames + [config.audio_eos_token_id]
    eos_frame = torch.full((codes.shape[0], 1), config.codebook_eos_token_id, dtype=torch.long)
    audio = torch.cat([codes.long(), eos_frame], 1).t()
    frame_codes = torch.cat([torch.zeros(len(prompt), codes.shape[0], dtype=torch.long), audio])
    labels = torch.cat([torch.full((len(prompt), codes.shape[0]), -100, dtype=torch.long), audio])
    return ids, frame_codes, labels


def encode_batch(built: CodebooksBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The batch right-padded (pad = <|end_of_text|>, labels -100). A cached batch holds "codes"; otherwise each
    clip is encoded alone by the frozen codec."""
    if _declared(built.architecture) is not None:
        return _declared(built.architecture).encode_batch(built, batch, dtype)
    layout, config = built.layout, built.trainable.model.config
    codes = batch.get("codes") or [
        encode_clip(built.codec, built.codec_kind, wave, layout["num_codebooks"], layout["frame_order"])
        for wave in batch["audio"]
    ]
    speakers = batch.get("speakers") or [""] * len(batch["texts"])
    rows = [
        utterance(config, prompt_ids(built, text, speaker), clip_codes)
        for text, speaker, clip_codes in zip(batch["texts"], speakers, codes)
    ]
    length, q = max(len(ids) for ids, _, _ in rows), layout["num_codebooks"]
    input_ids = torch.full((len(rows), length), built.processor.tokenizer.pad_token_id, dtype=torch.long)
    frame_codes = torch.zeros((len(rows), length, q), dtype=torch.long)
    labels = torch.full((len(rows), length, q), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (ids, row_codes, row_labels) in enumerate(rows):
        n = len(ids)
        input_ids[row, :n], frame_codes[row, :n], labels[row, :n], attention_mask[row, :n] = (
            torch.tensor(ids),
            row_codes,
            row_labels,
            1,
        )
    device = built.device
    return {
        "input_ids": input_ids.to(device),
        "frame_codes": frame_codes.to(device),
        "attention_mask": attention_mask.to(device),
        "labels": labels.to(device),
        "indices": torch.as_tensor(batch["index"], dtype=torch.long),
    }


def loss(built: CodebooksBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The class's own loss: the backbone's cross-entropy on codebook 0 of each next frame plus the depth decoder's
    on the frame's codebooks (every frame trains the depth decoder); no random draws. Other classes: their own."""
    if _declared(built.architecture) is not None:
        return _declared(built.architecture).loss(built, trainable_forward, encoded, seed, step)
    out = trainable_forward(
        input_ids=encoded["input_ids"],
        frame_codes=encoded["frame_codes"],
        attention_mask=encoded["attention_mask"],
        labels=encoded["labels"],
    )
    return at_least_float32(out.loss)


# ------------------------------------------------------------------------------------------------- sampling


def decodable_codes(vocab_size: int, codebook_size: int) -> dict:
    """generate's settings that keep every sampled id a code of the codec: the codebook vocabulary has a few ids
    past the codebook (CSM: 2051 ids, 2048 codes) that an undertrained model may pick and the codec cannot decode."""
    extra = list(range(codebook_size, vocab_size))
    return {"suppress_tokens": extra, "depth_decoder_suppress_tokens": extra} if extra else {}


def generate_codes(
    model,
    processor,
    codebook_size: int,
    text: str,
    max_frames: int,
    temperature: float,
    seed: int,
    speaker: str = DEFAULT_SPEAKER,
) -> torch.Tensor:
    """(Q, frames) codes the class's own generate makes for `text` (its EOS frame and what follows cut off). The
    draws come from `seed` without touching the caller's random state; every rank runs the same calls."""
    tokenizer = processor.tokenizer
    prompt = f"{tokenizer.bos_token}[{speaker}]{text}{tokenizer.eos_token}"  # the first frame follows, as in training
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(next(model.parameters()).device)
    sampling = {
        "do_sample": temperature > 0,
        "depth_decoder_do_sample": temperature > 0,
        **decodable_codes(model.config.vocab_size, codebook_size),
    }
    if temperature > 0:
        sampling.update(temperature=temperature, depth_decoder_temperature=temperature)
    with torch.random.fork_rng(devices=[]), quiet_hf_libraries():
        torch.manual_seed(seed)
        frames = model.generate(**inputs, max_new_tokens=max_frames, **sampling)
    frames = frames[0].long().cpu()  # (frames, Q)
    ended = (frames == model.config.codebook_eos_token_id).all(-1).nonzero()
    return frames[: int(ended[0]) if len(ended) else len(frames)].t()


def sample(
    built: CodebooksBuilt, lm_module: torch.nn.Module, prompts: list[str], sample_spec, resolution=None
) -> list[Clip]:
    """One clip per prompt, from sample_spec.seed, through the class's own generate (every rank: ZeRO-3)."""
    if _declared(built.architecture) is not None:
        return _declared(built.architecture).sample(built, lm_module, prompts, sample_spec, resolution)
    inner = getattr(lm_module, "model", lm_module)
    was_training = inner.training
    inner.eval()
    max_frames = max(1, int(built.max_sample_seconds * built.layout["frame_rate"]))
    clips = []
    try:
        with torch.no_grad():
            for number, prompt in enumerate(prompts):
                codes = generate_codes(
                    inner,
                    built.processor,
                    int(built.codec.config.codebook_size),
                    prompt,
                    max_frames,
                    built.temperature,
                    sample_spec.seed * 1000 + number,
                )
                wave = decode_codes(built.codec, built.codec_kind, codes) if codes.shape[1] else np.zeros(0, np.float32)
                clips.append(Clip(wave, built.sample_rate))
    finally:
        inner.train(was_training)
    return clips


# --------------------------------------------------------------------------------------------------- export


def _whole_model(built: CodebooksBuilt, state_dict: dict):
    """The class loaded from the pretrained folder (its codec included) with the trained weights put in."""
    import transformers

    with quiet_hf_libraries():
        whole = getattr(transformers, built.architecture).from_pretrained(built.folder, torch_dtype=torch.float32)
    trained = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
    missing, unexpected = whole.load_state_dict(trained, strict=False)
    if built.architecture in CODEC_ATTRIBUTE:  # CSM: the codec inside the class was not trained (others': outside)
        codec_prefix = CODEC_ATTRIBUTE[built.architecture] + "."
        missing = [k for k in missing if not k.startswith(codec_prefix)]
    else:  # a declared class: what its trained module held frozen stays the pretrained folder's
        frozen = codebooks_models()[built.architecture].frozen_parts
        missing = [k for k in missing if not any(k == part or k.startswith(part + ".") for part in frozen)]
    if missing or unexpected or len(trained) != len(state_dict):
        raise ValueError(
            f"trained weights do not fit {built.architecture}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return whole


def _write_folder(built: CodebooksBuilt, whole, work: Path) -> None:
    with quiet_hf_libraries():
        whole.save_pretrained(work, safe_serialization=True)
        built.processor.save_pretrained(work)


def export(built: CodebooksBuilt, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
    """A folder the class's from_pretrained and AutoProcessor load (codec inside, as the class keeps it)."""
    out_dir = Path(out_dir)
    with folder_written_atomically(out_dir, "export") as work:
        _write_folder(built, _whole_model(built, state_dict), work)
    return out_dir


ADAPTER_FOLDER = "adapter"


def save_lora_weights(built: CodebooksBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """A LoRA export: the peft adapter folder (`adapter/`, onto the pretrained folder's class) and the merged
    model as a full folder with its processor."""
    import transformers
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    folder = Path(folder)
    fields = {k: v for k, v in adapter_metadata.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
    codec_name = CODEC_ATTRIBUTE.get(built.architecture)
    # CSM's codec inside the class was never adapted
    excluded = {"exclude_modules": rf"{codec_name}\..*"} if codec_name else {}
    with quiet_hf_libraries():
        base = getattr(transformers, built.architecture).from_pretrained(built.folder, torch_dtype=torch.float32)
        config = LoraConfig(**{**fields, "init_lora_weights": False, **excluded})
        peft_model = get_peft_model(base, config)
        renamed = {f"base_model.model.{k[len('model.') :]}": v for k, v in lora_layers.items()}
        result = set_peft_model_state_dict(peft_model, renamed)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"LoRA weights do not fit the model: unexpected {sorted(result.unexpected_keys)[:5]}")
        peft_model.peft_config["default"].base_model_name_or_path = str(built.folder)
        peft_model.save_pretrained(folder / ADAPTER_FOLDER, safe_serialization=True)
        merged = peft_model.merge_and_unload()
    _write_folder(built, merged, folder)


def synthesize(
    folder, text: str, seconds: float = 2.0, temperature: float = 0.8, seed: int = 0, speaker: str = DEFAULT_SPEAKER
) -> Clip:
    """Speech for `text` from an exported folder with the class, its processor and its codec only."""
    import transformers
    from transformers import AutoProcessor

    folder = Path(folder)
    architecture = folder_architecture(folder)
    if _declared(architecture) is not None:  # its own speaker convention (in the text, or none)
        return _declared(architecture).synthesize(folder, text, seconds=seconds, temperature=temperature, seed=seed)
    with quiet_hf_libraries():
        model = getattr(transformers, architecture).from_pretrained(folder).eval()
        processor = AutoProcessor.from_pretrained(folder)
    codec = getattr(model, CODEC_ATTRIBUTE[architecture])
    frames = max(1, int(seconds * codec.config.frame_rate))
    with torch.no_grad():
        codes = generate_codes(
            model, processor, int(codec.config.codebook_size), text, frames, temperature, seed, speaker
        )
    wave = decode_codes(codec, CODEC_KIND[architecture], codes) if codes.shape[1] else np.zeros(0, np.float32)
    return Clip(wave, int(codec.config.sampling_rate))


FAMILY = Family(
    name="tts_codebooks",
    modality="audio",
    pretrained_fields=("pretrained",),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_wavs,
    export=export,
    save_lora_weights=save_lora_weights,
    speaker=Speaker(trains_folder, synthesize),
)

"""Described token layouts of codec-token TTS LMs: how one utterance becomes a token sequence, and back.

A layout (a dict, written as `dstune_tts.json` beside an exported model) says:
- `special_tokens`: name -> id;
- the prompt template: `before_text` + text ids + `after_text` (names of special tokens), then the audio ids, then
  `after_audio`; generation stops at the `stop` token; `pad` fills batches;
- the codec (`codec`, `sampling_rate`, `samples_per_frame`, `frame_rate` = frames per second) and how its codebooks
  are interleaved per frame: `codes_per_frame[c]` codes of codebook c per frame, and `frame_order`, the
  (codebook, index within the frame) written at each position of a frame;
- the audio ids: code k at frame position p is the token `audio_offset + p * codebook_size + k`;
- `loss_on`: `audio` (labels only on the audio ids and what follows) or `all` (every non-pad token, as Orpheus's
  fine-tuning script labels its sequences).

In the family, one clip's codes are a (positions, frames) array: row p holds the codes written at frame position p.
With one code per codebook per frame (EnCodec, DAC, Mimi) the rows are the codebooks; for SNAC's hierarchical
codebooks (Orpheus: 1 + 2 + 4 codes per frame) the rows follow `frame_order`.

Presets: `dstune` (text, BOS, the flattened residual codes, EOS; loss on audio) and `orpheus` (SNAC 24 kHz, 7 codes
per frame, the added tokens after Llama-3's 128256 text tokens, as Orpheus's public fine-tuning and inference code
lay them out). This module is torch-free (layer 1): `dstune validate` checks layouts offline.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

from dstune.models.tts_lm.spec import TTS_LAYOUT_FILE


LLAMA3_TEXT_VOCAB = 128256  # Orpheus's added tokens follow Llama-3's text vocabulary
ORPHEUS_SNAC = {"sampling_rate": 24000, "hop_length": 512, "vq_strides": [4, 2, 1], "codebook_size": 4096}


def orpheus_layout(text: str = "tokenizer") -> dict:
    """Orpheus's layout: [start_of_human] text [end_of_text end_of_human start_of_ai start_of_speech] codes
    [end_of_speech end_of_ai], SNAC 24 kHz codes interleaved 7 per frame from id 128266 on, 4096 ids per position."""
    base = LLAMA3_TEXT_VOCAB
    special = {
        "start_of_text": 128000,
        "end_of_text": 128009,
        "start_of_speech": base + 1,
        "end_of_speech": base + 2,
        "start_of_human": base + 3,
        "end_of_human": base + 4,
        "start_of_ai": base + 5,
        "end_of_ai": base + 6,
        "pad_token": base + 7,
    }
    coarsest_stride = max(ORPHEUS_SNAC["vq_strides"])
    samples_per_frame = ORPHEUS_SNAC["hop_length"] * coarsest_stride
    positions = [[0, 0], [1, 0], [2, 0], [2, 1], [1, 1], [2, 2], [2, 3]]
    audio_offset, size = base + 10, ORPHEUS_SNAC["codebook_size"]
    return {
        "name": "orpheus",
        "text": text,
        "codec": "snac",
        "sampling_rate": ORPHEUS_SNAC["sampling_rate"],
        "samples_per_frame": samples_per_frame,
        "frame_rate": ORPHEUS_SNAC["sampling_rate"] / samples_per_frame,
        "codebook_size": size,
        "codes_per_frame": [1, 2, 4],
        "frame_order": positions,
        "num_codebooks": len(positions),
        "audio_offset": audio_offset,
        "special_tokens": special,
        "before_text": ["start_of_human"],
        "after_text": ["end_of_text", "end_of_human", "start_of_ai", "start_of_speech"],
        "after_audio": ["end_of_speech", "end_of_ai"],
        "stop": "end_of_speech",
        "pad": "pad_token",
        "loss_on": "all",
        "vocab_size": audio_offset + len(positions) * size,
    }


def tts_layout(
    text: str,
    text_vocab_size: int,
    num_codebooks: int,
    codebook_size: int,
    codec: str,
    sampling_rate: int,
    frame_rate: float,
) -> dict:
    """dstune's layout as dstune_tts.json has always written it (`describe` spells out its template): text ids,
    then num_codebooks blocks of codebook_size audio ids, then audio BOS, audio EOS and padding."""
    audio_offset = text_vocab_size
    audio_end = audio_offset + num_codebooks * codebook_size
    return {
        "text": text,
        "text_vocab_size": text_vocab_size,
        "audio_offset": audio_offset,
        "num_codebooks": num_codebooks,
        "codebook_size": codebook_size,
        "audio_bos": audio_end,
        "audio_eos": audio_end + 1,
        "pad": audio_end + 2,
        "vocab_size": audio_end + 3,
        "codec": codec,
        "sampling_rate": sampling_rate,
        "frame_rate": frame_rate,
    }


def dstune_layout(
    text: str,
    text_vocab_size: int,
    num_codebooks: int,
    codebook_size: int,
    codec: str,
    sampling_rate: int,
    frame_rate: float,
) -> dict:
    """dstune's own layout: text ids, then num_codebooks blocks of codebook_size audio ids, then audio BOS, audio
    EOS and padding; [text] [BOS] [frame 0: codebook 0..Q-1] ... [EOS]; loss on the audio ids and EOS."""
    return describe(tts_layout(text, text_vocab_size, num_codebooks, codebook_size, codec, sampling_rate, frame_rate))


def describe(layout: dict) -> dict:
    """The full description of a layout; a `dstune_tts.json` written before layouts were described (no
    `frame_order`) is dstune's layout and gets its template spelled out."""
    if "frame_order" in layout:
        return dict(layout)
    special = {"audio_bos": layout["audio_bos"], "audio_eos": layout["audio_eos"], "pad": layout["pad"]}
    codebooks = int(layout["num_codebooks"])
    return {
        **layout,
        "name": "dstune",
        "special_tokens": special,
        "before_text": [],
        "after_text": ["audio_bos"],
        "after_audio": ["audio_eos"],
        "stop": "audio_eos",
        "pad": "pad",
        "loss_on": "audio",
        "codes_per_frame": [1] * codebooks,
        "frame_order": [[q, 0] for q in range(codebooks)],
        "samples_per_frame": layout["sampling_rate"] / layout["frame_rate"],
    }


def token(layout: dict, name: str) -> int:
    return int(layout["special_tokens"][name])


def template_problems(layout: dict) -> list[str]:
    """The template names only defined special tokens; the frame order writes every code of a frame once."""
    problems = []
    special = layout.get("special_tokens", {})
    for key in ("before_text", "after_text", "after_audio"):
        problems += [f"{key}: {name!r} is not in special_tokens" for name in layout.get(key, []) if name not in special]
    for key in ("stop", "pad"):
        if layout.get(key) not in special:
            problems.append(f"{key}: {layout.get(key)!r} is not in special_tokens")
    if layout.get("loss_on") not in ("audio", "all"):
        problems.append(f"loss_on: {layout.get('loss_on')!r} is neither 'audio' nor 'all'")
    wanted = sorted((c, i) for c, count in enumerate(layout.get("codes_per_frame", [])) for i in range(count))
    if sorted(tuple(p) for p in layout.get("frame_order", [])) != wanted:
        problems.append(
            f"frame_order {layout.get('frame_order')} does not write each of the codes_per_frame "
            f"{layout.get('codes_per_frame')} (codebook, index) pairs exactly once"
        )
    return problems


def layout_problems(layout: dict, vocab_size: int | None = None) -> list[str]:
    """What is wrong with a layout (empty: nothing), for an LM of `vocab_size` ids when given: the template, the
    token ranges (special tokens inside the vocabulary and outside the audio ids), and the codec's frame rate."""
    problems = template_problems(layout)
    audio_start = int(layout["audio_offset"])
    audio_stop = audio_start + len(layout["frame_order"]) * int(layout["codebook_size"])
    if audio_stop > layout["vocab_size"]:
        problems.append(f"audio ids {audio_start}..{audio_stop - 1} go past vocab_size {layout['vocab_size']}")
    if vocab_size is not None and vocab_size < layout["vocab_size"]:
        problems.append(f"the LM has {vocab_size} ids, fewer than the layout's vocab_size {layout['vocab_size']}")
    for name, value in layout.get("special_tokens", {}).items():
        if not 0 <= value < layout["vocab_size"]:
            problems.append(f"special token {name} = {value} is outside 0..{layout['vocab_size'] - 1}")
        elif audio_start <= value < audio_stop:
            problems.append(f"special token {name} = {value} falls among the audio ids {audio_start}..{audio_stop - 1}")
    rate = Fraction(layout["sampling_rate"]) / Fraction(layout["samples_per_frame"]).limit_denominator(10_000)
    if abs(float(rate) - float(layout["frame_rate"])) > 1e-6 * float(rate):
        problems.append(
            f"frame_rate {layout['frame_rate']} != sampling_rate {layout['sampling_rate']} / "
            f"samples_per_frame {layout['samples_per_frame']} = {float(rate)}"
        )
    return problems


# Layout (preset name) -> how its prompt names the voice: Orpheus's multi-speaker prompts are "tara: Hello there.".
# A layout without an entry has no place for a speaker: one model voice for every clip.
SPEAKER_PROMPTS = {"orpheus": "{speaker}: {text}"}


def layout_name(layout_file: dict | None, token_layout: str | None, codec: str) -> str:
    """The layout a tts_lm run trains with, without building it: the folder's dstune_tts.json (`layout_file`), else
    model.token_layout, else the default for the codec (SNAC's codes fit only the orpheus layout)."""
    if layout_file is not None:
        return describe(layout_file)["name"]
    return token_layout or ("orpheus" if codec == "snac" else "dstune")


def spec_layout_name(model) -> str:
    """layout_name for a tts_lm model section (model.pretrained, token_layout, codec), reading the dstune_tts.json
    of a local folder; a built-in or hub model without one here goes by the spec."""
    try:
        with open(os.path.join(os.path.expanduser(model.pretrained), TTS_LAYOUT_FILE)) as handle:
            layout_file = json.load(handle)
    except (OSError, ValueError):
        layout_file = None
    return layout_name(layout_file, model.token_layout, model.codec)


def spoken_text(layout: dict, text: str, speaker: str) -> str:
    """The text of one clip as the layout's prompt takes it: with its speaker named where the layout names voices
    (a text that already starts with "speaker:" is left as it is)."""
    template = SPEAKER_PROMPTS.get(layout.get("name", ""))
    if not speaker or template is None or text.startswith(f"{speaker}:"):
        return text
    return template.format(speaker=speaker, text=text)


def prompt_ids(layout: dict, text_ids: list[int]) -> list[int]:
    """What a model is given to speak `text_ids`: the template up to the first audio id."""
    return (
        [token(layout, n) for n in layout["before_text"]]
        + list(text_ids)
        + [token(layout, n) for n in layout["after_text"]]
    )


def training_ids(layout: dict, text_ids: list[int], audio_ids: list[int]) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one utterance; labels are -100 where the loss is masked."""
    prompt = prompt_ids(layout, text_ids)
    audio = list(audio_ids) + [token(layout, n) for n in layout["after_audio"]]
    labels = (list(prompt) if layout["loss_on"] == "all" else [-100] * len(prompt)) + audio
    return prompt + audio, labels

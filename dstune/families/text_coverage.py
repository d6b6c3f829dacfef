"""Whether a speech model's tokenizer covers a dataset's language, torch-free (what `dstune validate` says of a
dataset in a language the tokenizer does not cover, before anything trains):

    tokenizer = text_tokenizer(card.text_tokenizer_kind(folder), folder, added_tokens)   # None: not checked
    report = coverage(tokenizer, [(sample id, transcript), ...])
    report.above(0.1) -> the samples whose share of unknown tokens is over the limit

A model's card says how its text becomes tokens (ModelCard.text_tokenizer_kind): "files", the folder's own tokenizer
files (tokenizer.json through the `tokenizers` library, else a SentencePiece model file), or "utf8", one token per
UTF-8 byte (a byte tokenizer; a model without a tokenizer file). No transformers, no torch: the Rust tokenizer
and SentencePiece load in well under a second, so validate stays quick.

What "unknown" means (docs/tts.md, "A new language"): a token is unknown when it does not hold a whole character, by
the tokenizer's kind:
- a tokenizer with an unknown token (SentencePiece, a character vocabulary): that token (`<unk>`), and a character
  the vocabulary drops without one. The character is lost: the model cannot tell it from another, whatever it trains on;
- a byte-level tokenizer (GPT-2-style byte-level BPE, SentencePiece with byte fallback): it never emits `<unk>`;
  a character none of its tokens holds whole is written as its UTF-8 bytes, each token a piece of a character
  (decoded alone it is not text). Nothing is lost, but the model starts from byte pieces it rarely saw;
- UTF-8 bytes (no vocabulary beyond the 256 bytes): every byte of a character of more than one byte (anything
  outside ASCII), by the same rule.
A sample's share is its unknown tokens over its tokens (the transcript alone, no special tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

FILES, UTF8 = "files", "utf8"  # the kinds a card declares (ModelCard.text_tokenizer_kind)
REPLACEMENT = "\ufffd"  # what a piece of a character decodes to alone
SENTENCEPIECE_FILES = ("spm_char.model", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
BATCH = 1024  # transcripts encoded per call
LOST, BYTES = "lost", "bytes"  # what happens to an unknown character: it becomes <unk> / it is written as bytes


@dataclass(frozen=True)
class SampleCoverage:
    """One sample's transcript through the tokenizer."""

    sample: str  # its id (the clip's path in the dataset)
    tokens: int
    unknown: int
    characters: str  # the characters behind its unknown tokens, each once, in order

    @property
    def share(self) -> float:
        return self.unknown / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class Coverage:
    """A dataset's transcripts through a model's tokenizer."""

    tokenizer: str  # what it is, in words ("tokenizer.json of /m (byte-level)")
    fate: str  # LOST or BYTES: what becomes of a character it lacks
    samples: tuple[SampleCoverage, ...]

    def above(self, limit: float) -> list[SampleCoverage]:
        """The samples whose share of unknown tokens is over `limit`, largest share first."""
        return sorted((s for s in self.samples if s.share > limit), key=lambda s: (-s.share, s.sample))

    def touched(self) -> list[SampleCoverage]:
        """The samples with at least one unknown token."""
        return [s for s in self.samples if s.unknown]

    def characters(self, samples: Sequence[SampleCoverage]) -> str:
        """Every unknown character of `samples`, each once, in order of first appearance."""
        return "".join(dict.fromkeys("".join(s.characters for s in samples)))


class _Utf8Bytes:
    """One token per UTF-8 byte: a character outside ASCII is all unknown bytes."""

    fate = BYTES

    def __init__(self, what: str):
        self.what = what

    def samples(self, samples: Sequence[tuple[str, str]]) -> list[SampleCoverage]:
        return [self.sample(sample, text) for sample, text in samples]

    def sample(self, sample: str, text: str) -> SampleCoverage:
        wide = [c for c in text if ord(c) > 127]
        return SampleCoverage(
            sample, len(text.encode("utf-8")), sum(len(c.encode("utf-8")) for c in wide), "".join(dict.fromkeys(wide))
        )


class _Vocabulary:
    """A tokenizer with a vocabulary (`encode(text) -> ids`): a token is unknown when it is a piece of a character
    (`pieces(ids)`: the ids that, decoded alone, are not whole characters) or stands for characters it lacks (the
    unknown id `unk`, or nothing at all for a character a vocabulary without one drops). Each character it lacks
    counts as one unknown token, since an unknown token may stand for a run of them (SentencePiece's does)."""

    def __init__(self, what: str, fate: str, encode, encode_many, pieces, unk: Optional[int]):
        self.what, self.fate, self._encode, self._encode_many = what, fate, encode, encode_many
        self._pieces, self._unk = pieces, unk
        self._chars: dict[str, str] = {}  # character -> "" (known), "lost" or "pieces"

    def _char(self, char: str) -> str:
        if char not in self._chars:
            ids = self._encode(char)
            lost = not ids or self._unk in ids
            self._chars[char] = "lost" if lost else "pieces" if self._pieces(ids) else ""
        return self._chars[char]

    def samples(self, samples: Sequence[tuple[str, str]]) -> list[SampleCoverage]:
        """Every sample, its transcript encoded in batches (the tokenizer's threads)."""
        out = []
        for start in range(0, len(samples), BATCH):
            chunk = samples[start : start + BATCH]
            encoded = self._encode_many([text for _, text in chunk])
            out += [self.sample(sample, text, ids) for (sample, text), ids in zip(chunk, encoded)]
        return out

    def sample(self, sample: str, text: str, ids: list[int]) -> SampleCoverage:
        chars = sorted((c for c in set(text) if not c.isspace() and self._char(c)), key=text.index)
        pieces = len(self._pieces(ids))
        if not chars:  # nearly every sample of a covered language
            return SampleCoverage(sample, len(ids), pieces, "")
        lost = sum(1 for c in text if c in chars and self._chars[c] == "lost")
        unk = ids.count(self._unk) if self._unk is not None else 0
        return SampleCoverage(sample, len(ids) - unk + lost, pieces + lost, "".join(chars))


def _json_tokenizer(path: Path, added_tokens: Sequence[str]) -> _Vocabulary:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    if added_tokens:  # model.added_tokens: known once added (what start-up does to the tokenizer)
        tokenizer.add_tokens(list(added_tokens))
    document = json.loads(path.read_text(encoding="utf-8"))
    model = document.get("model", {})
    # bytes stand in for a character it lacks: a byte-level pre-tokenizer or decoder (GPT-2's), or byte fallback
    byte_level = bool(model.get("byte_fallback")) or '"ByteLevel"' in json.dumps(
        [document.get("pre_tokenizer"), document.get("decoder")]
    )
    unk = tokenizer.token_to_id(model["unk_token"]) if model.get("unk_token") else None
    piece: dict[int, bool] = {}

    def pieces(ids: list[int]) -> list[int]:
        new = sorted({i for i in ids if i not in piece})
        for i, text in zip(new, tokenizer.decode_batch([[i] for i in new], skip_special_tokens=False)):
            piece[i] = i != unk and REPLACEMENT in text
        return [i for i in ids if piece[i]]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def encode_many(texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]

    fate = BYTES if byte_level else LOST
    kind = "an unknown token" if fate == LOST else "byte-level"
    return _Vocabulary(f"{path.name} of {path.parent} ({kind})", fate, encode, encode_many, pieces, unk)


def _sentencepiece(path: Path) -> _Vocabulary:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def pieces(ids: list[int]) -> list[int]:
        return [i for i in ids if processor.is_byte(i)]

    fallback = any(processor.is_byte(i) for i in range(processor.get_piece_size()))
    fate = BYTES if fallback else LOST
    what = f"{path.name} of {path.parent} (SentencePiece{', byte fallback' if fallback else ''})"
    return _Vocabulary(what, fate, processor.encode, processor.encode, pieces, processor.unk_id())


def text_tokenizer(kind: str, folder: Path, added_tokens: Sequence[str] = ()):
    """The tokenizer a card's `kind` names in `folder`, or None when the folder holds no tokenizer file it reads
    (start-up then finds the folder's tokenizer itself, and this check is skipped)."""
    folder = Path(folder)
    if kind == UTF8:
        return _Utf8Bytes("UTF-8 bytes (one token per byte)")
    if kind != FILES:
        return None
    if (folder / "tokenizer.json").is_file():
        return _json_tokenizer(folder / "tokenizer.json", added_tokens)
    named = [folder / name for name in SENTENCEPIECE_FILES if (folder / name).is_file()]
    return _sentencepiece(named[0]) if named else None


def coverage(tokenizer, samples: Sequence[tuple[str, str]]) -> Coverage:
    """Each (sample id, transcript) through `tokenizer` (text_tokenizer's)."""
    return Coverage(tokenizer.what, tokenizer.fate, tuple(tokenizer.samples(list(samples))))


LISTED = 10  # samples named one per line in the message; the rest counted


def coverage_messages(report: Coverage, limit: float, model: str, extension: str) -> tuple[Optional[str], str]:
    """(the error: samples over `limit`, or None; a warning for samples with unknown tokens under it, or ""), naming
    the samples, their shares, the characters, the limit and the fixes. `extension`: how this model's tokenizer can
    be extended, or why it cannot (the card's words)."""
    over, touched = report.above(limit), report.touched()
    if not touched:
        return None, ""
    why = f"{model}'s tokenizer ({report.tokenizer}) has no token for " + (
        "them: they become its unknown token, so the model cannot tell them apart, however long it trains"
        if report.fate == LOST
        else "them whole: they are written as UTF-8 byte pieces the model rarely saw (nothing is lost, and "
        "enough data can teach them, but a language it never read starts from scratch)"
    )
    fixes = (
        "Fix: transliterate or normalise those characters into ones the tokenizer has (a language's romanisation, "
        f"accents spelled out), or start from a model whose tokenizer covers the language; {extension}"
    )
    if over:
        shown = "".join(
            f"\n  {s.sample}: {s.share:.0%} of {s.tokens} tokens unknown ({_shown(s.characters)})"
            for s in over[:LISTED]
        )
        more = f"\n  ... and {len(over) - LISTED} more" if len(over) > LISTED else ""
        error = (
            f"{len(over)} of {len(report.samples)} samples have more than {limit:.0%} unknown tokens (the limit, "
            f"data.max_unknown_tokens): the tokenizer does not cover their language.{shown}{more}\n"
            f"Characters: {_chars(report.characters(over))}. {why}. {fixes}. To train on them anyway ("
            + ("the characters stay unknown" if report.fate == LOST else "a new language from byte pieces, knowingly")
            + "), raise data.max_unknown_tokens (1.0 accepts every sample)."
        )
        return error, ""
    worst = max(touched, key=lambda s: s.share)
    warning = (
        f"{len(touched)} of {len(report.samples)} samples have unknown tokens, each under the {limit:.0%} limit "
        f"(data.max_unknown_tokens; the most: {worst.sample}, {worst.share:.0%}): characters "
        f"{_chars(report.characters(touched))}. {why}. {fixes}."
    )
    return None, warning


def _shown(characters: str) -> str:
    return repr(characters[:12]) + (" ..." if len(characters) > 12 else "")


def _chars(characters: str) -> str:
    more = f" and {len(characters) - 12} more" if len(characters) > 12 else ""
    return " ".join(f"{c!r} U+{ord(c):04X}" for c in characters[:12]) + more

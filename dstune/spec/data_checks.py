"""What the data section can feed: a model family's kind of data (`data_family_problem`), and the rules between the
sets of data.sets (`sets_problems`). Torch-free: the spec asks the first as it loads, validate the second, at each
set's line."""

from __future__ import annotations

from dstune.spec.data_sections import MAX_UNKNOWN_TOKENS, DataSpec, VideoSpec
from dstune.spec.section import BUILTIN_PREFIX, CODEC_TOKEN_FAMILIES, VIDEO_FAMILY


def data_family_problem(audio: bool, family: str, data: "DataSpec", video: bool = False) -> str | None:
    """Why `data` cannot feed `family` (speech data for speech families, images for image families, videos or
    images for video families), or None. With data.sets, each set's own settings are checked (the message names
    the set)."""
    if data.sets is not None:
        if audio:
            return (
                f"data.sets: model.family {family} trains on speech; several datasets per run are for the image "
                "and video families so far. Give one dataset as data.path"
            )
        for number, (item, one) in enumerate(zip(data.sets, data.set_specs())):
            problem = _one_set_problem(audio, family, one, video)
            if problem:
                return f"data.sets.{number} ({item.label}): {problem}"
        return None
    return _one_set_problem(audio, family, data, video)


def _one_set_problem(audio: bool, family: str, data: "DataSpec", video: bool) -> str | None:
    name = data.path[len(BUILTIN_PREFIX) :] if data.path.startswith(BUILTIN_PREFIX) else None
    clips = name in ("moving-shapes", "moving-shapes-av")
    if not video and (clips or data.video != VideoSpec()):  # the defaults alone are harmless
        return (
            f"model.family {family} trains on {'speech' if audio else 'images'}: data.path builtin:moving-shapes "
            f"and data.video are for the video family ({VIDEO_FAMILY})"
        )
    if video and (data.eval is not None or data.random_flip):
        return (
            f"model.family {family} trains on video clips: data.eval and data.random_flip are not offered for "
            "video yet; remove them"
        )
    if video and data.alpha_mask:
        return (
            f"data.alpha_mask reads an image's alpha channel; model.family {family} trains on video clips, which "
            "have none. Give the clips' masks as data.mask_dir (a mask image or a mask video per clip)"
        )
    if video and data.buckets.enabled:
        return _video_bucket_problem(data)
    if audio:
        if name is not None and name != "tones":
            return (
                f"model.family {family} trains on speech, but data.path {data.path} is an image dataset: use "
                f"{BUILTIN_PREFIX}tones or a speech folder (data.format ljspeech or jsonl)"
            )
        if data.format == "folder":
            return (
                f"model.family {family} trains on speech: data.format must be ljspeech, jsonl, gptsovits, f5csv "
                "or auto, not folder"
            )
        if data.buckets.enabled or data.cache.latents or data.cache.text_embeddings:
            return (
                f"model.family {family} trains on speech: data.buckets, data.cache.latents and "
                "data.cache.text_embeddings are for images; use data.duration_bucket_seconds and "
                "data.cache.codec_tokens"
            )
        if data.cache.codec_tokens and family not in CODEC_TOKEN_FAMILIES:
            return (
                f"data.cache.codec_tokens is for the codec-token models (model.family "
                f"{' or '.join(CODEC_TOKEN_FAMILIES)}), not {family}"
            )
        if data.eval is not None:
            return (
                f"data.eval: the held-out loss is computed for the image families; "
                f"model.family {family} has no evaluation pass yet. Remove data.eval"
            )
        if data.control_dir is not None:
            return (
                f"data.control_dir pairs source and target images (edit training); model.family {family} "
                "trains on speech"
            )
        if data.speaker_balance and data.duration_bucket_seconds:
            return (
                "data.speaker_balance and data.duration_bucket_seconds both choose which clips form the batches: "
                "use one of them"
            )
        if data.masked:
            return f"data.mask_dir and data.alpha_mask weight an image's loss; model.family {family} trains on speech"
        if data.min_clip_seconds >= data.max_clip_seconds:
            return (
                f"data.min_clip_seconds {data.min_clip_seconds:g} must be below data.max_clip_seconds "
                f"{data.max_clip_seconds:g}"
            )
        return None
    if (
        name == "tones"
        or data.format in ("ljspeech", "gptsovits", "f5csv")
        or data.cache.codec_tokens
        or data.duration_bucket_seconds
        or data.speaker_balance
        or data.speakers != "separate"
        or data.max_unknown_tokens != MAX_UNKNOWN_TOKENS
    ):
        return (
            f"model.family {family} trains on images; data.path builtin:tones, data.format ljspeech, data.cache."
            "codec_tokens, data.duration_bucket_seconds, data.speaker_balance, data.speakers and "
            "data.max_unknown_tokens are for the speech families"
        )
    return None


VIDEO_SIDE_MULTIPLE = 16  # the common video layout: an 8x VAE, then 2x2 patches (a 16x VAE with 1x1 patches too)


def _video_bucket_problem(data: "DataSpec") -> str | None:
    """data.buckets of a video family: every side a multiple of 16 pixels, or a clip's latent grid does not split
    into the transformer's 2x2 patches."""
    m = VIDEO_SIDE_MULTIPLE
    if data.buckets.sizes:
        bad = [list(size) for size in data.buckets.sizes if size[0] % m or size[1] % m]
        if bad:
            return (
                f"data.buckets.sizes {bad}: a video clip's sides must be multiples of {m} pixels (the VAE's 8x "
                f"compression, then 2x2 patches); round them to multiples of {m}"
            )
    elif data.buckets.step % m:
        return (
            f"data.buckets.step {data.buckets.step}: video buckets need sides that are multiples of {m} pixels "
            f"(the VAE's 8x compression, then 2x2 patches); use a step that is a multiple of {m}, e.g. "
            f"{max(m, data.buckets.step // m * m)}"
        )
    return None


def sets_problems(data: "DataSpec", lora: bool) -> list[tuple[str, str]]:
    """(dotted key, message) for each rule data.sets breaks between its sets or with the run: two sets of one name
    (the name keys the caches and the logs), weights in some sets only (or with data.buckets), no set that trains,
    a preservation set without adapters to switch off (`lora`: model.train is lora)."""
    if data.sets is None:
        return []
    problems, first_of = [], {}
    for number, item in enumerate(data.sets):
        if item.label in first_of:
            key = f"data.sets.{number}.{'name' if item.name else 'path'}"
            problems.append(
                (
                    key,
                    f"set {number} is named {item.label!r}, as set {first_of[item.label]} is: a set's name keys its "
                    "samples in the caches and logs, so give each set its own `name`",
                )
            )
        first_of.setdefault(item.label, number)
    weighted = [item.weight is not None for item in data.sets]
    if any(weighted) and not all(weighted):
        number = weighted.index(not weighted[0])
        problems.append(
            (
                f"data.sets.{number}.weight",
                f"set {data.sets[number].label} {'gives' if weighted[number] else 'does not give'} a weight and set "
                f"{data.sets[0].label} {'does not' if weighted[number] else 'does'}: weights share an epoch among all "
                "sets, so give `weight` in every set (each set's share) or in none (each set's samples x `repeats`)",
            )
        )
    grouped = any(
        one.buckets.enabled
        or one.resolution != data.resolution
        or len(one.video.frame_counts) > 1
        or one.video.max_frames != data.video.max_frames
        for one in data.set_specs()
    )
    if all(weighted) and grouped:
        problems.append(
            (
                "data.sets.0.weight",
                "set weights with buckets or sets at several sizes (or frame counts) are not offered yet (each "
                "size's batches are drawn on their own); give the sets `repeats` instead, or train them at one size "
                "without buckets",
            )
        )
    for number, (item, one) in enumerate(zip(data.sets, data.set_specs())):
        buckets = one.buckets
        own = item.buckets is not None or item.resolution is not None
        if own and buckets.enabled and not buckets.sizes and buckets.step > one.resolution:
            problems.append(
                (
                    f"data.sets.{number}.{'buckets.step' if item.buckets is not None else 'resolution'}",
                    f"the set's bucket step {buckets.step} is larger than its resolution {one.resolution}: no bucket "
                    "side fits. Use a step of at most the resolution (a multiple of 8), or give buckets.sizes",
                )
            )
    for number, item in enumerate(data.sets):
        if item.role == "preservation" and not lora:
            problems.append(
                (
                    f"data.sets.{number}.role",
                    "preservation holds the adapters' output to the base model's own (the adapters switched off), "
                    "so it needs model.train: lora; to train a full model near its base on class images use role "
                    "regularization",
                )
            )
    if not any(item.role == "train" for item in data.sets):
        problems.append(
            (
                "data.sets.0.role",
                "no set has role train: regularization and preservation sets only hold the trained model near its base; give the "
                "images to learn as a set with role train (the default)",
            )
        )
    return problems

"""What `dstune validate` says about a video family's clips (torch-free): how many clips the files give once
data.video has chosen their frames (dstune.data.clips), their frame-count and size buckets, and each bucket's
transformer tokens per sample, the sequence length that drives activation memory.

    count_clips(spec) -> ClipCount(count, origin, groups, summary, problems)

`groups` ({"Ff WxH": clips}, display order) is what the plan divides into whole global batches when batches are
grouped (dstune.data.clips.is_grouped); `summary` is the "Clips" section of validate's report and of --json.
Tokens per clip come from the model's token factors (its card's `token_factors`: the VAE's spatial and temporal
factors and the transformer's patch, read from the model's configs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dstune.data.clips import clip_counts, index_clips, is_grouped, latent_tokens, set_video
from dstune.data.image_check import find_unreadable
from dstune.data.index import DataError, builtin_name, is_video_file
from dstune.families import clip_token_factors, get_facts
from dstune.plan import key_label

PROBLEMS_LISTED = 20  # videos that give no clip named one per line; the rest counted


@dataclass(frozen=True)
class ClipCount:
    count: int
    origin: str
    groups: Optional[dict]  # {"Ff WxH": clips} when batches are grouped, else None
    summary: dict
    problems: list[str] = field(default_factory=list)  # one line per video that gives no clip
    warnings: list[str] = field(default_factory=list)
    stills: list = field(default_factory=list)  # the records of still images (one-frame clips read from image files)
    # the files without a sound track whose data.video.require_sound (data's, or their set's) asks for one
    silent: list = field(default_factory=list)


def count_clips(spec, show_progress: bool = False) -> ClipCount:
    """The clips of spec.data for spec.model (DataError passes through)."""
    data = spec.data
    index = index_clips(data, read_captions=False, show_progress=show_progress)
    counts = clip_counts(index.records, data)
    spatial, patch, temporal, factors = clip_token_factors(spec)
    stills = sum(r.repeats for r in index.records if r.frames == 1 and r.image_path is not None)
    still_records = [r for r in index.records if r.image_path is not None and not is_video_file(r.image_path)]
    frames, sizes = {}, {}
    for (count, width, height), clips in counts.items():
        frames[str(count)] = frames.get(str(count), 0) + clips
        sizes[f"{width}x{height}"] = sizes.get(f"{width}x{height}", 0) + clips
    buckets = {
        key_label(key): {
            "frames": key[0],
            "width": key[1],
            "height": key[2],
            "clips": clips,
            "tokens": latent_tokens(key, spatial, patch, temporal),
        }
        for key, clips in counts.items()
    }
    largest = max(buckets, key=lambda label: buckets[label]["tokens"]) if buckets else None
    video = data.video
    summary = {
        "video_files": index.files,
        "clips": index.num_samples,
        "stills": stills,
        "unusable_videos": len(index.problems),
        "counted_by_decoding": index.counted,
        "builtin": builtin_name(data.path) if data.sets is None else None,  # data.sets: the Sets rows name them
        "sampling": video.sampling,
        "stride": (video.stride or "frames") if video.sampling == "sliding" else None,
        "fps": video.fps,
        "frame_counts": sorted({count for one in data.set_specs() for count in one.video.frame_counts}),
        "grouped": is_grouped(data),
        "frames": dict(sorted(frames.items(), key=lambda item: int(item[0]))),
        "sizes": sizes,
        "buckets": buckets,
        "largest_bucket": largest,
        "tokens_per_sample_max": buckets[largest]["tokens"] if largest else 0,
        "tokens_from": factors,
    }
    if get_facts(spec.model.family).trains_sound(spec) is not False:  # the model trains sound, or may
        summary["sound"] = {"with": index.with_sound, "without": index.num_samples - index.with_sound}
    if data.sets is not None:
        origin = f"counted in the {len(data.sets)} sets of data.sets, below"
    else:
        origin = data.path if builtin_name(data.path) else f"counted in {data.path}"
    origin += f"; {index.num_samples} clips from {index.files} video files" + (
        f" and {stills} stills" if stills else ""
    )
    groups = {key_label(key): clips for key, clips in counts.items()} if is_grouped(data) else None
    return ClipCount(
        index.num_samples,
        origin,
        groups,
        summary,
        list(index.problems),
        list(index.warnings),
        still_records,
        _silent_files([r for r in index.records if set_video(data, r.set_index).require_sound]),
    )


def _silent_files(records) -> list[str]:
    """The files (or built-in datasets) of the clips without a sound track, each once, in dataset order."""
    return list(dict.fromkeys(r.image_path or r.sample_id.split("/", 1)[0] for r in records if not r.sound))


def clip_plan(spec, source, num_samples: Optional[int], check_files: bool = False) -> tuple:
    """validate's count of a video family: (clips or None, origin, groups, summary, issues): the videos that give
    no clip are one error (startup would stop on them), an unusable dataset another; with `check_files`, still
    images that cannot be read (dstune.data.image_check) another."""
    try:
        counted = count_clips(spec, show_progress=True)
    except DataError as err:
        return None, "", None, None, [source.issue(err.key or "data.path", err.message)]
    issues = [source.issue("data.path", text, severity="warning") for text in counted.warnings]
    issues += sound_issues(spec, source, counted)
    if counted.problems:
        issues.append(source.issue("data.path", problem_text(counted.problems)))
    bad = find_unreadable(counted.stills, show_progress=True) if check_files else []
    if bad:
        listing = "\n  ".join(f"{record.image_path}: {reason}" for record, reason in bad[:PROBLEMS_LISTED])
        more = f"\n  ... and {len(bad) - PROBLEMS_LISTED} more" if len(bad) > PROBLEMS_LISTED else ""
        issues.append(
            source.issue(
                "data.path",
                f"{len(bad)} still image(s) cannot be read and would stop training "
                f"before step 1 (video datasets are checked whole; data.skip_bad_files does not "
                f"apply to them):\n  {listing}{more}\nReplace or delete them.",
            )
        )
    if num_samples is not None and num_samples != counted.count:
        issues.append(
            source.issue(
                "data.path",
                f"--num-samples {num_samples} ignored: {spec.data.path} is here and gives {counted.count} clips",
                severity="warning",
            )
        )
    return counted.count or None, counted.origin, counted.groups, counted.summary, issues


def sound_issues(spec, source, counted: ClipCount) -> list:
    """A model that trains sound on clips without any says so (every clip would train its video alone);
    data.video.require_sound refuses each file without a sound track, and a model that trains no sound."""
    trains = get_facts(spec.model.family).trains_sound(spec)
    sound = counted.summary.get("sound")
    key = _require_sound_key(spec.data)
    if key and trains is False:
        return [
            source.issue(
                key,
                f"{spec.model.pretrained} trains no sound (its frames only): a sound track would not be used. "
                f"Remove {key}.",
            )
        ]
    silent = counted.silent
    if key and silent:
        listing = "\n  ".join(silent[:PROBLEMS_LISTED])
        more = f"\n  ... and {len(silent) - PROBLEMS_LISTED} more" if len(silent) > PROBLEMS_LISTED else ""
        return [
            source.issue(
                key,
                f"{len(silent)} file(s) have no sound track, and {key} asks that every clip has one:\n  "
                f"{listing}{more}\nGive those clips with their sound (or delete them), or set {key}: false to "
                "train their video alone.",
            )
        ]
    if trains and sound and counted.count and not sound["with"]:
        return [
            source.issue(
                "data.path",
                f"none of the {counted.count} clips has a sound track: {spec.model.pretrained} trains each clip's "
                "sound with its frames, so this run trains the video alone (the audio half of the model learns "
                "nothing). Give clips with their sound, or set data.video.require_sound: true to make this an "
                "error.",
                severity="warning",
            )
        ]
    return []


def _require_sound_key(data) -> Optional[str]:
    """The dotted key that asks every clip for a sound track (data.video.require_sound, or the first set's own
    data.sets.N.video.require_sound), or None when nothing asks."""
    for number, one in enumerate(data.sets or []):
        if one.video is not None and one.video.require_sound:
            return f"data.sets.{number}.video.require_sound"
    if data.video.require_sound and (data.sets is None or any(one.video is None for one in data.sets)):
        return "data.video.require_sound"
    return None


def problem_text(problems: list[str]) -> str:
    """The validate error naming every video that gives no clip (as startup would stop with)."""
    listing = "\n  ".join(problems[:PROBLEMS_LISTED])
    more = f"\n  ... and {len(problems) - PROBLEMS_LISTED} more" if len(problems) > PROBLEMS_LISTED else ""
    return (
        f"{len(problems)} video(s) give no clip and would stop training before step 1 (the plan counts the "
        f"others):\n  {listing}{more}"
    )


def clip_buckets(summary: Optional[dict]) -> list[tuple[int, int, int, int]]:
    """[(frames, width, height, clips)] of a summary (for the memory plan), or [] without one."""
    if not summary:
        return []
    return [(b["frames"], b["width"], b["height"], b["clips"]) for b in summary["buckets"].values()]


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The report's Clips section: the extraction, the files, frame and size buckets, tokens per bucket. (What each
    epoch uses per bucket is the Buckets section's, from the plan.)"""
    stride = {None: "", "frames": ", stride = each clip's frame count (chunks do not overlap)"}.get(
        summary["stride"], f", stride {summary['stride']} frames"
    )
    fps = f" at {summary['fps']:g} fps" if summary["fps"] else " at each file's own fps"
    decoded = (
        f"; {summary['counted_by_decoding']} headers stated no frame count (counted by decoding)"
        if summary["counted_by_decoding"]
        else ""
    )
    unusable = (
        f"; {summary['unusable_videos']} videos give no clip (see the error)" if summary["unusable_videos"] else ""
    )
    files = (
        f"builtin:{summary['builtin']}: {summary['clips']} rendered clips"
        if summary["builtin"]
        else f"{summary['video_files']} videos and {summary['stills']} stills -> {summary['clips']} clips (repeats "
        f"included){unusable}{decoded}"
    )
    rows = [
        ("extraction", f"{summary['sampling']}{stride}{fps}; frame counts {summary['frame_counts']}"),
        ("files", files),
        *([("sound", sound_text(summary["sound"]))] if summary.get("sound") else []),
        ("frame buckets", ", ".join(f"{frames} frames: {n}" for frames, n in summary["frames"].items())),
        ("size buckets", ", ".join(f"{size}: {n}" for size, n in summary["sizes"].items())),
    ]
    rows += [
        (f"  {label}", f"{bucket['clips']} clips, {bucket['tokens']} tokens per sample")
        for label, bucket in summary["buckets"].items()
    ]
    rows.append(
        (
            "tokens",
            f"largest {summary['tokens_per_sample_max']} per sample ({summary['largest_bucket']}; "
            f"the memory plan's); from {summary['tokens_from']}",
        )
    )
    return rows


def sound_text(sound: dict) -> str:
    """The report's sound row: how many clips train with their sound, how many their video alone."""
    total = sound["with"] + sound["without"]
    if not sound["without"]:
        return f"all {total} clips have a sound track: each trains its video and its sound"
    if not sound["with"]:
        return f"none of the {total} clips has a sound track: each trains its video alone"
    return (
        f"{sound['with']} of {total} clips have a sound track and train video and sound; {sound['without']} "
        "without train their video alone"
    )

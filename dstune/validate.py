"""A loaded spec + a world -> everything a run needs to know, checked: what `dstune validate` and training both call.

    validate_spec(spec, source, world) -> Resolved       (training: the spec it loaded, the world it launched)
    load_and_validate(spec_path, overrides, world)       (`dstune validate`: load, then the same)

    world -> number of samples -> make_plan -> compile_ds_config -> DeepSpeed cross-check

Every stage that can still run does run, so one call reports every error it can find (a missing dataset and a bad
DeepSpeed JSON together), then raises one ResolveError (a SpecError) holding all of them. Only a spec that does
not load stops at once: later stages need it. deepspeed (and torch) are imported only by the stages that need
them, so a spec error is reported without waiting for either.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from dstune.data.audio_index import duration_groups, index_audio
from dstune.data.buckets import (
    bucket_counts,
    bucket_sizes,
    record_sizes,
    own_size_pictures,
    reference_size_problem,
    upscaling_warning,
)
from dstune.data.image_check import image_file_issues
from dstune.data.index import METADATA_FILE, DataError, builtin_name, index_dataset
from dstune.ds_json.blocks import compile_ds_config
from dstune.ds_json.user_file import user_config_path
from dstune.ds_json.cross_check import cross_check as deepspeed_cross_check
from dstune.ds_json.fill_spec import apply_ds_file, ds_value_sources
from dstune.memory.plan import Setup
from dstune.memory.verdict import memory_json
from dstune.families import card_of_spec, get_facts
from dstune.families.quantized_file import quantized_file_setup, transformer_file_problems
from dstune.families.speakers import SpeakersRefused, Voices
from dstune.memory.counts import SizesUnknown
from dstune.model_defaults import bucket_step_problem, with_model_defaults
from dstune.model_folders import locate, model_folder_issues
from dstune.families.text_coverage import coverage, coverage_messages, text_tokenizer
from dstune.memory.counts import BUILTIN_FOLDERS, BUILTIN_MARKER
from dstune.spec.section import BUILTIN_PREFIX
from dstune.plan import Plan, data_parallel_ranks, make_plan, resolve_batch
from dstune.sequence_parallel import bucket_tokens, sequence_issues, with_all_to_all
from dstune.sets_plan import at_largest_set, set_rows
from dstune.spec.load import SpecError, SpecIssue, SpecSource, load_spec
from dstune.spec.models import AUDIO_FAMILIES, VIDEO_FAMILIES, Spec, lora_format_problem, sets_problems
from dstune.trackers import wandb_missing
from dstune.video_plan import clip_buckets, clip_plan
from dstune.world import World, world_from_flags

ACCELERATORS = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class Resolved:
    spec: Spec
    source: SpecSource
    world: World
    plan: Plan
    ds_config: dict
    num_samples: int
    num_samples_origin: str  # "counted in /data/x", "from --num-samples; ...", "builtin:shapes"
    warnings: tuple[SpecIssue, ...]
    ds_sources: dict = field(default_factory=dict)  # DeepSpeed key -> "ds.json:4" / "spec.yaml:7" / "default" ...
    clips: Optional[dict] = None  # video families: dstune.video_plan's summary (frame and size buckets, tokens)
    resolution_origin: str = ""  # where data.resolution's value came from ("set in the spec", the model's size)
    guidance_origin: str = ""  # where sample.guidance's value came from ("set in the spec", the pipeline's default)
    voices: Optional[Voices] = None  # speech: how the model hears the data's speakers (None: the data names none)
    sets: Optional[tuple] = None  # data.sets: dstune.sets_plan.SetRow per set


class ResolveError(SpecError):
    """Every error found, plus whatever could still be worked out (for `validate` to show beside the errors)."""

    def __init__(
        self,
        issues: list[SpecIssue],
        warnings: Iterable[SpecIssue] = (),
        spec: Optional[Spec] = None,
        world: Optional[World] = None,
        plan: Optional[Plan] = None,
        ds_config: Optional[dict] = None,
        num_samples_origin: str = "",
        clips: Optional[dict] = None,
    ):
        super().__init__(issues)
        self.clips = clips
        self.warnings = tuple(warnings)
        self.spec = spec
        self.world = world
        self.plan = plan
        self.ds_config = ds_config
        self.num_samples_origin = num_samples_origin


@dataclass
class IssueList:
    """What the stages have produced so far."""

    errors: list[SpecIssue] = field(default_factory=list)
    warnings: list[SpecIssue] = field(default_factory=list)

    def add(self, issues: Iterable[SpecIssue]) -> None:
        for issue in issues:
            (self.warnings if issue.severity == "warning" else self.errors).append(issue)


WorldArg = Union[None, World, Callable[[], World]]


def load_and_validate(
    spec_path,
    overrides: Iterable[str] = (),
    world: WorldArg = None,
    num_samples: Optional[int] = None,
    accelerator: str = "auto",
    cross_check: bool = True,
    check_files: bool = True,
) -> Resolved:
    """Load the spec, then validate_spec. `world`: a World, a function returning one (called only once the spec
    has loaded, so a spec error is reported before a hostfile is read), or None for what this machine would launch
    (dstune.world.world_from_flags())."""
    spec, source = load_spec(spec_path, overrides)
    return validate_spec(spec, source, _make_world(world), num_samples, accelerator, cross_check, check_files)


def validate_spec(
    spec: Spec,
    source: SpecSource,
    world: World,
    num_samples: Optional[int] = None,
    accelerator: str = "auto",
    cross_check: bool = True,
    check_files: bool = False,
) -> Resolved:
    """Raise SpecError (a ResolveError) holding every error found; dstune.world.WorldError passes through.
    `num_samples`: used when data.path does not exist here (planning offline). `check_files`: open every image
    (dstune.data.image_check), as `dstune validate` does; training leaves it to start-up. Resolved.spec and .source
    are the spec as the run uses it: with deepspeed.config's values in the keys the spec leaves unset."""
    found, file_read = IssueList(), True
    found.add(source.warnings)
    try:
        spec, source, conflicts = apply_ds_file(spec, source)
        found.add(conflicts)
    except SpecError as err:  # the file is unreadable or a value it fills breaks a rule: the rest is checked with
        if spec.train.micro_batch_size is None and spec.train.global_batch_size is None:  # the spec alone, if it can
            raise ResolveError(err.issues, world=world) from None
        found.add(err.issues)
        file_read = False
    spec, resolution_origin, guidance_origin = with_model_defaults(spec)  # left out: the model's native values
    found.add(source.issue("data.buckets.step", p) for p in [bucket_step_problem(spec, resolution_origin)] if p)
    _check_accelerator(spec, source, accelerator, found)
    _check_trackers(spec, source, found)
    _check_lora_format(spec, source, found)
    folder_issues = model_folder_issues(spec, source, num_samples)
    found.add(folder_issues)
    if not any(issue.severity == "error" and issue.key == "model.family" for issue in folder_issues):
        _check_model(spec, source, found)  # not on another model's folder, whose configs would give nonsense
    count, origin, groups, clips, voices, pictures = _count_samples(spec, source, num_samples, found, check_files)
    lora = getattr(spec.model, "train", "full") == "lora"
    found.add(source.issue(key, text) for key, text in sets_problems(spec.data, lora))
    sets = set_rows(spec.data, spec.model.family in VIDEO_FAMILIES) if count is not None else None
    found.add(sequence_issues(spec, source, world.world_size, bucket_tokens(spec, clips, groups, pictures)))
    plan = None
    if count is not None:
        try:
            plan = make_plan(spec.train, world, count, source, groups, spec.deepspeed.sequence_parallel_size)
            found.add(plan.warnings)
        except SpecError as err:
            found.add(err.issues)
    # Without a plan, a stand-in still lets compile and the cross-check run; its batch errors count only when
    # make_plan did not already report them.
    checked_plan = plan or _stand_in_plan(spec, source, world, found if count is None else IssueList())
    ds_config = _compile_and_check(
        spec, source, checked_plan if file_read else None, found, cross_check, stand_in=plan is None
    )
    found.errors = _once(found.errors)
    found.add(quantized_base_issues(spec, source, ds_config))
    if found.errors:
        raise ResolveError(found.errors, found.warnings, spec, world, plan, ds_config if plan else None, origin, clips)
    return Resolved(
        spec,
        source,
        world,
        plan,
        ds_config,
        count,
        origin,
        tuple(found.warnings),
        ds_value_sources(ds_config, spec, source),
        clips,
        resolution_origin,
        guidance_origin,
        voices,
        sets,
    )


def _once(errors: list[SpecIssue]) -> list[SpecIssue]:
    """A key of the DeepSpeed file written in both places is reported by apply_ds_file and again by the merge
    (which keeps the spec's value): the first, which names both places, stays."""
    seen, out = set(), []
    for issue in errors:
        if issue.key and (issue.key, issue.where) in seen:
            continue
        seen.add((issue.key, issue.where))
        out.append(issue)
    return out


def _transformer_folder(spec: Spec) -> tuple[Optional[Path], Optional[object]]:
    """(the pipeline folder when it is on this machine, its model's card): what model.transformer_file is read
    against (a file in the model's original naming is mapped with the folder's transformer config)."""
    pretrained = locate(spec.model.pretrained)
    folder = pretrained.path if pretrained.kind in ("folder", "hub") else None
    return folder, card_of_spec(spec) if folder is not None else None


def quantized_base_issues(spec: Spec, source: SpecSource, ds_config: Optional[dict]) -> list[SpecIssue]:
    """model.base_precision under ZeRO-3 (the spec's stage, or the one a deepspeed.config JSON sets): int8 runs
    (dstune's own int8 layer, dstune.families.int8_partitioned) except with DoRA or NVMe parameter offload; nf4 is
    refused. model.transformer_file: its header read (layout, scales, keys against the folder's); under ZeRO-3 its
    1-byte partitions refused with NVMe parameter offload."""
    precision = getattr(spec.model, "base_precision", None)
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", spec.deepspeed.zero_stage)
    offload = (ds_config or {}).get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    reference = getattr(spec.model, "transformer_file", None)
    if reference:
        folder, card = _transformer_folder(spec)
        problems = transformer_file_problems(reference, folder, stage, card, nvme=offload == "nvme")
        return [source.issue("model.transformer_file", problem) for problem in problems]
    if precision is None or stage != 3:
        return []
    if precision == "int8":
        settings = getattr(spec.model, "lora_settings", None)
        if offload == "nvme":
            return [
                source.issue(
                    "deepspeed.offload_param",
                    "nvme with base_precision int8 under ZeRO stage 3: DeepSpeed 0.19.8's NVMe parameter swapper "
                    "sizes and types every swap buffer in the training dtype, while the int8 base's partitions are "
                    "int8 (1 byte, not 2): they would be read back wrong. Use deepspeed.offload_param cpu (tested), "
                    "or remove base_precision.",
                )
            ]
        if getattr(settings, "type", "lora") != "dora":
            return []
        return [
            source.issue(
                "model.lora.type",
                "dora with base_precision int8 under ZeRO stage 3: DoRA normalises by the base layer's weight, which "
                "peft reads as the stored int8 codes of dstune's ZeRO-3 int8 layer (it dequantizes only its own "
                "known formats). Use model.lora.type lora, deepspeed.zero_stage 2 (int8 through bitsandbytes), or "
                "remove base_precision.",
            )
        ]
    return [
        source.issue(
            "model.base_precision",
            f"{precision} with ZeRO stage 3: DeepSpeed 0.19.8 cannot partition bitsandbytes' 4-bit weights. ZeRO-3 "
            "splits each parameter's data across ranks and gathers it back as a plain tensor, while bitsandbytes "
            "keeps the nf4 block scales and the packed shape beside the data on the parameter object, which ZeRO-3 "
            "neither partitions nor gathers (DeepSpeed's own quantized frozen weights need CUDA kernels). Use "
            "base_precision int8 (dstune stores it as plain int8 parameters that ZeRO-3 partitions), "
            "deepspeed.zero_stage 2 (frozen weights are not partitioned there, so the nf4 base is one copy per GPU), "
            "or remove base_precision.",
        )
    ]


def _make_world(world: WorldArg) -> World:
    if world is None:
        return world_from_flags()
    return world() if callable(world) else world


def _check_trackers(spec: Spec, source: SpecSource, found: IssueList) -> None:
    problem = wandb_missing() if spec.output.wandb else None
    if problem:
        found.add([source.issue("output.wandb", problem)])


def _check_accelerator(spec: Spec, source: SpecSource, accelerator: str, found: IssueList) -> None:
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if spec.train.precision != "fp16":
        return  # only fp16 depends on the accelerator; do not import torch to find out which one this is
    if accelerator == "auto":
        accelerator = _this_machine_accelerator()
    if accelerator == "cpu":
        found.add(
            [
                source.issue(
                    "train.precision",
                    "fp16 does not run on DeepSpeed's CPU accelerator (it has no fp16 support). Use bf16 or fp32 here, "
                    "or validate for the GPUs the run will use with --accelerator cuda.",
                )
            ]
        )


def _this_machine_accelerator() -> str:
    wanted = os.environ.get("DS_ACCELERATOR")
    if wanted in ("cpu", "cuda"):
        return wanted
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_lora_format(spec: Spec, source: SpecSource, found: IssueList) -> None:
    problem = lora_format_problem(spec.model.family, getattr(spec.model, "train", "full"), spec.output.lora_format)
    if problem:
        found.add([source.issue("output.lora_format", problem)])


def _check_model(spec: Spec, source: SpecSource, found: IssueList) -> None:
    """The spec against its model's own configs, offline (the family's facts: dstune.families.facts), and, for a
    model that trains on (source, target) pairs, the data giving them."""
    facts = get_facts(spec.model.family)
    issues = facts.spec_issues(spec)
    pairs = facts.pairs(spec)
    data = spec.data
    root = os.path.expanduser(data.path)
    if (
        pairs
        and data.control_dir is None
        and (builtin_name(data.path) or (os.path.isdir(root) and not os.path.isfile(os.path.join(root, METADATA_FILE))))
    ):
        issues.append(
            (
                "data.control_dir",
                f"{pairs} trains on (source, target) pairs: give the folder of "
                "source images (data.control_dir, e.g. ../control) or a `control_file_name` per "
                "metadata.jsonl line",
            )
        )
    found.add([source.issue(key, text) for key, text in issues])


def _count_samples(
    spec: Spec, source: SpecSource, num_samples: Optional[int], found: IssueList, check_files: bool = False
) -> tuple[Optional[int], str, Optional[dict], Optional[dict], Optional[Voices]]:
    """(number of samples or None when unknown, where it came from, {bucket: samples} with grouped batches, the
    clip summary of a video family, how a speech model hears the data's speakers, an image model's own-size
    references: dstune.data.buckets.own_size_pictures)."""
    path, voices = spec.data.path, None
    if builtin_name(path) is None and not os.path.exists(os.path.expanduser(path)):
        return (*_count_not_here(spec, source, num_samples, found), None, None)
    if spec.model.family in VIDEO_FAMILIES:  # clips after frame extraction; videos that give none are errors
        *counted, issues = clip_plan(spec, source, num_samples, check_files)
        found.add(issues)
        return (*counted, None, None)
    pictures = None
    try:
        if spec.model.family in AUDIO_FAMILIES:  # speech: clip headers give durations, length rules, length groups
            index = index_audio(spec.data)
            groups, pairs = duration_groups(index.records, spec.data), 0
            if spec.data.speaker_balance and not any(r.speaker for r in index.records):
                found.add(
                    [
                        source.issue(
                            "data.speaker_balance",
                            f"{path} names no speaker for any clip, so there is "
                            "nothing to balance: use a GPT-SoVITS .list or metadata.jsonl with `speaker`, "
                            "or remove data.speaker_balance",
                        )
                    ]
                )
            voices = _check_speakers(spec, source, index.records, found)
            found.add(text_coverage_issues(spec, source, index.records))
        else:
            index = index_dataset(
                spec.data,
                read_captions=False,  # lists files; reads no image, clip or caption
                video=spec.model.family in VIDEO_FAMILIES,
            )
            groups, pairs = _image_groups(spec, source, index.records, found), index.num_pairs
            sizes = reference_size_problem(index.records, spec.data, spec.train.micro_batch_size)
            pictures = own_size_pictures(index.records, spec.data)
            found.add([source.issue("data.reference_size", sizes)] if sizes else ())
            found.add(image_file_issues(spec.data, index.records + index.held_out, source) if check_files else ())
    except DataError as err:
        found.add([source.issue(err.key or "data.path", err.message)])
        return None, "", None, None, None, None
    found.add(source.issue("data.path", text, severity="warning") for text in index.warnings)
    count = index.num_samples
    if spec.data.sets is not None:
        origin = f"counted in the {len(spec.data.sets)} sets of data.sets, below"
    else:
        origin = path if builtin_name(path) else f"counted in {path}"
    if pairs:  # edit / control training: every target counted has its source
        references = max((len(r.control_paths) for r in index.records), default=1)
        origin += f"; {pairs} source/target pairs" + (f", {references} references each" if references > 1 else "")
    if spec.data.eval is not None:
        where = (
            f"{spec.data.eval.fraction:g} of the images" if spec.data.eval.fraction is not None else spec.data.eval.path
        )
        origin += f"; {len(index.held_out)} held out for data.eval ({where}), never trained on"
    if num_samples is not None and num_samples != count:
        found.add(
            [
                source.issue(
                    "data.path",
                    f"--num-samples {num_samples} ignored: {path} is here and holds {count} samples",
                    severity="warning",
                )
            ]
        )
    return count, origin, groups, None, voices, pictures


def _check_speakers(spec: Spec, source: SpecSource, records, found: IssueList) -> Optional[Voices]:
    """How the model hears the clips' speakers (validate prints it); a refusal where it cannot tell them apart."""
    try:
        return get_facts(spec.model.family).voices(spec, [r.speaker for r in records], [r.caption for r in records])
    except SpeakersRefused as err:
        found.add([source.issue(err.key, err.message)])
        return None


def text_coverage_issues(spec: Spec, source: SpecSource, records) -> list[SpecIssue]:
    """A dataset in a language the model's tokenizer does not cover (dstune.families.text_coverage): an error naming
    the samples over data.max_unknown_tokens, a warning for unknown tokens under it. Nothing when the model's
    folder or its tokenizer is not here (a hub id not downloaded, a built-in not built yet: start-up loads it)."""
    card = get_facts(spec.model.family).card(spec)
    folder = _tokenizer_folder(spec)
    if card is None or folder is None:
        return []
    added = getattr(spec.model, "added_tokens", None) or ()
    tokenizer = text_tokenizer(card.text_tokenizer_kind(folder), folder, added)
    if tokenizer is None:
        return []
    report = coverage(tokenizer, [(r.sample_id, r.caption) for r in records])
    error, warning = coverage_messages(report, spec.data.max_unknown_tokens, card.name, card.added_tokens_hint())
    if error:
        return [source.issue("data.path", error)]
    return [source.issue("data.path", warning, severity="warning")] if warning else []


def _tokenizer_folder(spec: Spec) -> Optional[Path]:
    """The folder of spec.model.pretrained here: a local folder, the hub cache's snapshot, a built-in already built
    in output.cache_dir; None when it is not here."""
    reference = spec.model.pretrained
    location = locate(reference)
    if location.kind in ("folder", "hub"):
        return location.path
    if location.kind == "builtin":
        built = Path(spec.output.cache_dir).expanduser() / "builtin" / BUILTIN_FOLDERS[reference[len(BUILTIN_PREFIX) :]]
        return built if (built / BUILTIN_MARKER).is_file() else None
    return None


def _count_not_here(
    spec: Spec, source: SpecSource, num_samples: Optional[int], found: IssueList
) -> tuple[Optional[int], str, Optional[dict], Optional[dict]]:
    """data.path is not on this machine: --num-samples plans offline (warning what it cannot know: buckets, clip
    durations), or an error says how to plan."""
    path = spec.data.path
    if num_samples is not None:
        video = spec.model.family in VIDEO_FAMILIES
        if spec.data.buckets.enabled or video and len(spec.data.video.frame_counts) > 1:
            found.add(
                [
                    source.issue(
                        "data.buckets" if spec.data.buckets.enabled else "data.video.frames",
                        "the files are not on this "
                        "machine, so their buckets are unknown: the plan below treats the dataset as one bucket and "
                        "overstates the steps per epoch (for video, give --num-samples as clips)",
                        severity="warning",
                    )
                ]
            )
        if spec.data.duration_bucket_seconds:
            found.add(
                [
                    source.issue(
                        "data.duration_bucket_seconds",
                        "the clips are not on this machine, so their durations are "
                        "unknown: the plan below treats the dataset as one length bucket and overstates the steps per "
                        "epoch a little (each bucket leaves out its remainder)",
                        severity="warning",
                    )
                ]
            )
        return num_samples, "from --num-samples; data.path is not on this machine", None, None
    found.add(
        [
            source.issue(
                "data.path",
                f"{path} does not exist here, so its samples cannot be counted. Fix the path, or pass "
                "--num-samples N to plan offline for a dataset of N samples (repeats included).",
            )
        ]
    )
    return None, "", None, None


def _image_groups(spec: Spec, source: SpecSource, records, found: IssueList) -> Optional[dict]:
    """With data.buckets (or data.sets at several sizes), {"WxH": samples} from the image headers (no pixels
    decoded); unreadable files are a warning with data.skip_bad_files (they train as a substitute in the square
    bucket), else a DataError. Images smaller than data.resolution (or their bucket) are a warning, per set."""
    specs = spec.data.set_specs()
    for number, one in enumerate(specs):
        key = "data.resolution" if spec.data.sets is None else f"data.sets.{number}.resolution"
        mine = [r for r in records if r.set_index == number] if spec.data.sets is not None else records
        found.add(source.issue(key, w, severity="warning") for w in [upscaling_warning(mine, one)] if w)
    if any(one.buckets.enabled and not bucket_sizes(one) for one in specs):
        return None  # no bucket fits (a step above the resolution): bucket_step_problem / sets_problems said so
    record_buckets, unreadable = record_sizes(records, spec.data)
    if record_buckets is None:
        return None
    if unreadable:
        found.add(
            [
                source.issue(
                    "data.path",
                    f"{len(unreadable)} image(s) have unreadable headers and are skipped (data.skip_bad_files): "
                    f"{'; '.join(unreadable[:3])}",
                    severity="warning",
                )
            ]
        )
    return bucket_counts(records, record_buckets)


def _stand_in_plan(spec: Spec, source: SpecSource, world: World, found: IssueList) -> Optional[Plan]:
    """When the sample count is unknown, the batch triad is still checked, and a plan with one step per epoch
    lets compile and the DeepSpeed cross-check report their own errors (a bad deepspeed.config) in the same run.
    The stand-in is never shown."""
    try:
        size = spec.deepspeed.sequence_parallel_size
        _, _, global_batch = resolve_batch(spec.train, data_parallel_ranks(world.world_size, size, source), source)
        return make_plan(spec.train, world, global_batch, source, sequence_parallel_size=size)
    except SpecError as err:
        found.add(err.issues)
        return None


def _compile_and_check(
    spec: Spec, source: SpecSource, plan: Optional[Plan], found: IssueList, cross_check: bool, stand_in: bool
) -> Optional[dict]:
    if plan is None:
        return None
    report = IssueList()
    ds_config = None
    try:
        ds_config, compile_warnings = compile_ds_config(spec.train, spec.deepspeed, plan, source)
        report.add(compile_warnings)
        if cross_check:
            user_path = user_config_path(spec.deepspeed.config, source) if spec.deepspeed.config else None
            report.add(deepspeed_cross_check(ds_config, plan, source, user_path))
    except SpecError as err:
        report.add(err.issues)
    found.errors += report.errors
    if not stand_in:  # a stand-in plan's step counts are made up, and so would its warnings be
        found.warnings += report.warnings
    return ds_config


def plan_memory(
    spec: Spec,
    plan: Plan,
    ds_config: dict,
    gpu_memory_bytes: Optional[float] = None,
    accelerator: str = "cuda",
    clips: Optional[dict] = None,
) -> dict:
    """The memory plan of a validated run (`dstune validate`'s Memory section, the `memory` key of --json):
    parameters counted on the meta device (dstune.memory.counts), bytes per GPU and node (dstune.memory.plan);
    `clips`: a video family's clip summary (Resolved.clips: the largest bucket's activations). Without the model's
    config files every figure is null and `unknown` says why."""
    spec = at_largest_set(spec)  # data.sets at several sizes: the largest sample sets the peak
    try:
        counts = get_facts(spec.model.family).count(spec, plan.num_samples, clip_buckets(clips))
    except (SizesUnknown, KeyError) as err:  # KeyError: a config layout the activation estimates do not know
        why = (
            str(err)
            if isinstance(err, SizesUnknown)
            else f"the memory plan does not know this model's config layout (no {err} in its config)"
        )
        return {
            "per_gpu": None,
            "host_per_node_bytes": None,
            "gpu_memory_bytes": gpu_memory_bytes,
            "fits": None,
            "suggestions": [],
            "unknown": why,
        }
    # model.base_precision (the quantized frozen base) sets the frozen base's bytes per parameter where it exists
    setup = Setup.of(spec, plan, ds_config, getattr(spec.model, "base_precision", None), accelerator)
    if getattr(spec.model, "transformer_file", None):  # its bytes, as the layers hold them
        folder, card = _transformer_folder(spec)
        setup = quantized_file_setup(spec.model.transformer_file, setup, card, folder)
    return memory_json(counts, with_all_to_all(setup, spec, clips), gpu_memory_bytes)

"""The `data` section: dataset, preprocessing, aspect-ratio / duration buckets and the encoder cache. Re-exported by
dstune.spec.models; torch-free like the rest of the spec."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from dstune.spec.section import VIDEO_FAMILY
from dstune.spec.section import BUILTIN_PREFIX, Section


# ---------------------------------------------------------------------------------------------------------- data


def reference_key(name: str, number: int) -> str:
    """A batch key of data.control_dir's reference `number` (0-based): `control_values`, `control_values_2`, ...
    (the datasets write them, the edit models read them)."""
    return name if number == 0 else f"{name}_{number + 1}"


class CacheSpec(Section):
    latents: bool = Field(
        False,
        description="Encode every image (or clip) with the VAE once, before training, and train from the stored posteriors "
        "(mean, std). Needs data.center_crop: true (a random crop cannot be cached). With data.random_flip both "
        "orientations are cached. See docs/caching.md.",
    )
    text_embeddings: bool = Field(
        False,
        description="Encode every caption (and the empty caption, for caption_dropout) with the text encoder once.",
    )
    dir: Optional[str] = Field(
        None,
        description="Cache folder; default `<output.cache_dir>/encoded`. `{node}` / `{rank}` in it are replaced by "
        "the node / rank number (node-local disks). Ranks that see the same folder split the build between them."
        " A relative path is taken from the spec file's folder (from the current directory when given with --set).",
    )
    codec_tokens: bool = Field(
        False,
        description="Audio families (tts_lm): encode every clip with the codec once, before training, and train from "
        "the stored tokens (same cache folder, keys and guarantees as latents).",
    )
    barrier_timeout_minutes: int = Field(
        60,
        gt=0,
        description="How long ranks wait for each other at the end of the cache build before stopping.",
    )


class BucketsSpec(Section):
    enabled: bool = Field(
        False,
        description="Aspect-ratio buckets: each image (video clip) trains at the (width, height) bucket nearest its "
        "aspect ratio (resized to cover it, then cropped), and every global batch comes from one bucket (for video, "
        "one bucket of frame count and size). See docs/batches-and-epochs.md.",
    )
    sizes: Optional[list[tuple[int, int]]] = Field(
        None,
        description="The buckets as [width, height] pairs in pixels, multiples of 8 (the VAE's latent grid). "
        "Omitted: generated with (about) the pixel area of data.resolution^2 from min_aspect, max_aspect and step.",
    )
    min_aspect: float = Field(
        0.5, gt=0, description="Generated buckets: the narrowest width/height (0.5 = 1:2 portrait)."
    )
    max_aspect: float = Field(
        2.0, gt=0, description="Generated buckets: the widest width/height (2.0 = 2:1 landscape)."
    )
    step: int = Field(
        64,
        gt=0,
        description="Generated buckets: both sides are multiples of this many pixels (a multiple of 8; "
        "at most data.resolution). Smaller steps give more buckets, each with fewer images.",
    )

    @field_validator("sizes")
    @classmethod
    def _sizes_on_the_latent_grid(cls, sizes):
        if sizes is not None:
            if not sizes:
                raise ValueError("give at least one [width, height] bucket, or leave `sizes` out to generate them")
            bad = [list(size) for size in sizes if min(size) <= 0 or size[0] % 8 or size[1] % 8]
            if bad:
                raise ValueError(f"bucket sides must be positive multiples of 8 (the VAE's latent grid): {bad}")
        return sizes

    @field_validator("step")
    @classmethod
    def _step_on_the_latent_grid(cls, step: int) -> int:
        if step % 8:
            raise ValueError(f"{step} is not a multiple of 8 (the VAE's latent grid); use e.g. {max(8, step // 8 * 8)}")
        return step

    @field_validator("max_aspect")
    @classmethod
    def _aspect_range(cls, value: float, info):
        if "min_aspect" in info.data and value < info.data["min_aspect"]:
            raise ValueError(f"{value} is below min_aspect {info.data['min_aspect']}")
        return value


class VideoSpec(Section):
    frames: Union[int, list[int]] = Field(
        5,
        description="Frames per training clip, the counts the model's VAE takes: 4k+1 for one that compresses time "
        "4x after the first frame (5, 9, ..., 81, ..., 121), 8k+1 for one that compresses it 8x (9, 17, ..., 121), "
        "17k+5 for one of 17-frame chunks (22, 39, ...); validate names the counts a model takes, and each video model's docs page gives its count. A list of counts makes frame-count buckets: each video trains "
        "at the largest count it can fill (after fps resampling), and every global batch comes from one count (and "
        "one data.buckets size). A still image is a one-frame clip. See docs/batches-and-epochs.md.",
    )
    sampling: Literal["head", "uniform", "sliding"] = Field(
        "head",
        description="Which frames of a longer video: `head` the first `frames` (after fps resampling), "
        "`uniform` `frames` spread evenly over the whole video, `sliding` every chunk of `frames` consecutive "
        "frames starting each `stride` frames (one long video gives several clips, each a sample of its own; the "
        "frames after the last whole chunk are left out).",
    )
    fps: Optional[float] = Field(
        None,
        gt=0,
        description="Resample videos to this frame rate before choosing frames (each output frame "
        "takes the source frame nearest its time); each video model's docs page gives the rate it was trained at. "
        "Omitted: the file's own frame rate.",
    )

    stride: Optional[int] = Field(
        None,
        gt=0,
        description="sampling: sliding: frames (after fps resampling) from one chunk's first frame to "
        "the next one's. Omitted: the clip's frame count (chunks that neither overlap nor leave gaps); smaller "
        "overlaps them, larger skips frames between them.",
    )
    require_sound: bool = Field(
        False,
        description="For a model that trains sound with its frames (validate says whether it does): every clip must have a sound track. A "
        "video file without one is an error naming it (validate and the run's start), instead of a clip that trains "
        "the video alone. Off: clips without sound train the video alone, and validate counts the clips with and "
        "without sound (and says so when none has any). See the model's docs page.",
    )

    @field_validator("frames")
    @classmethod
    def _frame_counts(cls, value):
        counts = value if isinstance(value, list) else [value]
        if not counts:
            raise ValueError("give at least one frame count, e.g. 81 or [33, 49, 81]")
        for count in counts:  # the counts a model's VAE takes are its card's clip rule (validate checks them)
            if count < 1:
                raise ValueError(f"{count} frames: a clip has at least one frame")
        if len(set(counts)) != len(counts):
            raise ValueError(f"{counts} names a frame count twice; give each once")
        return value

    @model_validator(mode="after")
    def _stride_is_for_sliding(self) -> "VideoSpec":
        if self.stride is not None and self.sampling != "sliding":
            raise ValueError(
                f"data.video.stride {self.stride} applies to sampling: sliding only (sampling is "
                f"{self.sampling}): set sampling: sliding, or remove stride"
            )
        return self

    def __repr_args__(self):
        # repr(data.video) is part of a clip's latent-cache key: without a stride it stays what it was before
        # `stride` existed, so the caches of unchanged specs still match;
        # require_sound decides what is accepted, not what a clip's latents are: never part of the key
        return [
            (name, value)
            for name, value in super().__repr_args__()
            if not (name == "stride" and value is None) and name != "require_sound"
        ]

    @property
    def frame_counts(self) -> tuple[int, ...]:
        """The frame-count buckets, shortest first (one for a single count)."""
        return tuple(sorted(self.frames if isinstance(self.frames, list) else [self.frames]))

    @property
    def max_frames(self) -> int:
        return self.frame_counts[-1]


class EvalSpec(Section):
    path: Optional[str] = Field(
        None,
        description="A held-out dataset folder in the layout of data.path (same format and caption rules). "
        "Give this or `fraction`."
        " A relative path is taken from the spec file's folder (from the current directory when given with --set).",
    )
    fraction: Optional[float] = Field(
        None,
        gt=0,
        lt=1,
        description="Hold out this fraction of data.path's images (at least one), chosen by a hash "
        "of each sample's id (stable when the folder grows); they never train. Give this or `path`.",
    )
    every_steps: Optional[int] = Field(
        None,
        gt=0,
        description="Compute the held-out loss every N optimizer steps; it is always computed after the last step.",
    )
    batch_size: Optional[int] = Field(
        None, gt=0, description="Samples per forward pass of the evaluation; default train.micro_batch_size (or 1)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "EvalSpec":
        if (self.path is None) == (self.fraction is None):
            raise ValueError(
                "data.eval needs exactly one of `path` (a held-out folder) or `fraction` (a share of "
                "data.path held out), e.g. `fraction: 0.05`"
            )
        return self


SET_ROLES = ("train", "regularization", "preservation")
# The keys a data set may give for itself; every other data key is the run's, for every set alike.
SET_OVERRIDES = (
    "path",
    "format",
    "resolution",
    "buckets",
    "caption_extension",
    "caption_dropout",
    "mask_dir",
    "alpha_mask",
    "video",
)


class DataSetSpec(Section):
    """One dataset of data.sets: its files and the settings it trains with (unset: data's own)."""

    path: str = Field(
        description="The set's dataset folder (the layouts of data.path), or a built-in dataset (`builtin:shapes`). "
        "A relative path is taken from the spec file's folder (from the current directory when given with --set)."
    )
    name: Optional[str] = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="How `validate`, the logs and the caches name the set (letters, digits, `_`, `.`, `-`); "
        "default: the last part of its path. Names must differ between sets.",
    )
    format: Optional[Literal["auto", "folder", "jsonl"]] = Field(None, description="As data.format; unset: data's.")
    repeats: int = Field(
        1,
        ge=1,
        description="Times each sample of the set appears in one epoch, on top of kohya `N_name` folders inside it "
        "(a sample in `3_x` of a set with repeats 2 appears 6 times). Not with `weight`.",
    )
    weight: Optional[float] = Field(
        None,
        gt=0,
        description="The set's share of an epoch instead of repeats: an epoch has as many places as all sets have "
        "samples (kohya folder repeats counted), shared among the sets in proportion to their weights; a set with "
        "more places than samples repeats them, one with fewer leaves some out, a different set each epoch. Give "
        "`weight` in every set or in none; not with data.buckets.",
    )
    role: Literal["train", "regularization", "preservation"] = Field(
        "train",
        description="`train`: trained as usual. `regularization`: class images (DreamBooth prior preservation, "
        "kohya's is_reg): a micro batch's loss is its train samples' mean plus loss_weight x its regularization "
        "samples' mean, as the diffusers DreamBooth scripts add prior_loss_weight x their prior loss. "
        "`preservation` (model.train: lora): differential output preservation: these samples' target is the base "
        "model's own prediction (the adapters switched off, no second copy), their mean added with loss_weight; "
        "a micro batch holding one runs one more forward, without gradients. See docs/data.md.",
    )
    loss_weight: float = Field(
        1.0,
        ge=0,
        description="Multiplies the set's part of the loss: DreamBooth's prior_loss_weight for a regularization "
        "set, DOP's multiplier for a preservation set. A train set's samples: their losses are multiplied by it inside the train samples' mean.",
    )
    resolution: Optional[int] = Field(
        None,
        gt=0,
        description="As data.resolution, for this set (its square side, or its buckets' area); unset: data's. Sets "
        "at other sizes never share a global batch: each global batch is one size (as with buckets).",
    )
    buckets: Optional[BucketsSpec] = Field(
        None, description="As data.buckets, for this set (whole: every key of it); unset: data's."
    )
    caption_extension: Optional[str] = Field(None, description="As data.caption_extension; unset: data's.")
    caption_dropout: Optional[float] = Field(None, ge=0, le=1, description="As data.caption_dropout; unset: data's.")
    mask_dir: Optional[str] = Field(None, description="As data.mask_dir, relative to this set's path; unset: data's.")
    alpha_mask: Optional[bool] = Field(None, description="As data.alpha_mask, for this set; unset: data's.")
    video: Optional[VideoSpec] = Field(
        None,
        description="As data.video, for this set (whole: every key of it; model.family video): its frames (a count "
        "or frame-count buckets), sampling, stride and fps; unset: data's. Clips of other frame counts or sizes "
        "never share a global batch.",
    )

    @model_validator(mode="after")
    def _repeats_or_weight(self) -> "DataSetSpec":
        if self.weight is not None and self.repeats != 1:  # 1 is also what a saved spec (every key) holds
            raise ValueError(
                f"give `repeats` (the set's samples x {self.repeats} per epoch) or `weight` (its share of the "
                "epoch's places), not both"
            )
        return self

    @model_validator(mode="after")
    def _files_for_masks(self) -> "DataSetSpec":
        if self.mask_dir is not None and self.alpha_mask:
            raise ValueError("mask_dir and alpha_mask both give loss masks: keep one")
        if self.path.startswith(BUILTIN_PREFIX) and (self.mask_dir or self.alpha_mask):
            raise ValueError(
                f"{self.path} is generated and has no files to read masks from; point path at a folder of images"
            )
        return self

    @property
    def label(self) -> str:
        """The set's name, or its path's last part."""
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]


DEFAULT_DATA_PATH = "builtin:shapes"
# a transcript with more unknown tokens is in a language the tokenizer does not cover (dstune.families.text_coverage)
MAX_UNKNOWN_TOKENS = 0.1


class DataSpec(Section):
    path: str = Field(
        DEFAULT_DATA_PATH,
        description="Dataset folder, or `builtin:shapes` (synthetic coloured shapes with captions, generated offline), "
        "for video families `builtin:moving-shapes` (the shapes moving, as clips) or `builtin:moving-shapes-av` "
        "(those clips with a sound track: a tone whose pitch follows the shape), or for audio families "
        "`builtin:tones` (digit strings spoken as tone sequences, generated offline)."
        " A relative path is taken from the spec file's folder (from the current directory when given with --set).",
    )
    format: Literal["auto", "folder", "jsonl", "ljspeech", "gptsovits", "f5csv"] = Field(
        "auto",
        description="`folder`: images with same-name .txt captions (kohya layout, `N_name` subfolders repeat N times); "
        "`jsonl`: metadata.jsonl with `file_name` and `text` (Hugging Face imagefolder). `auto`: jsonl when "
        "metadata.jsonl exists, else folder. Audio families: `ljspeech` (metadata.csv `id|text|normalized` + wavs/), "
        "`jsonl` (metadata.jsonl with `audio`, `text`, optional `speaker`), `gptsovits` (metadata.list lines "
        "`path|speaker|language|text`; data.path may also name a .list file), `f5csv` (F5-TTS's metadata.csv headed "
        "`audio_file|text`); `auto` picks by which file exists. See docs/tts.md.",
    )
    resolution: int = Field(
        32,
        gt=0,
        description="Images (and video frames) are resized (shorter side) and cropped to this square size, in pixels. With "
        "data.buckets: the square bucket's side, and the pixel area (resolution^2) of generated buckets. Omitted: "
        "the model's native size, from its folder's configs (512, 1024, or 480 for a 480p video model; 32 for the "
        "built-in tiny models); `validate` prints the size chosen and why.",
    )
    allow_upscaling: bool = Field(
        False,
        description="Accept training images smaller than data.resolution (they are upscaled, which blurs "
        "them). Without it, `validate` and the run's start warn with the count and the largest factor.",
    )
    center_crop: bool = Field(True, description="Crop the centre (true) or a random position (false).")
    random_flip: bool = Field(False, description="Flip images horizontally at random (per sample, from the seed).")
    caption_dropout: float = Field(
        0.0, ge=0, le=1, description="Probability of training a sample with an empty caption."
    )
    caption_extension: str = Field(".txt", description="Caption file extension in `folder` format.")
    skip_bad_files: bool = Field(
        False,
        description="Unreadable files (`dstune validate` opens every image, truncated JPEGs included, reads every "
        "video's and audio file's header, and every rank checks its share before step 1): false stops with every "
        "such file named; true skips them (each is replaced by the next readable sample) and reports the count.",
    )
    drop_last: bool = Field(
        True,
        description="Each epoch, samples that do not fill a whole global batch are left out (a different set each "
        "epoch, since the order is reshuffled). False is not supported: every step must see a full global batch.",
    )
    control_dir: Optional[Union[str, list[str]]] = Field(
        None,
        description="Edit / control training (the edit models: docs/family-flow.md): the folder of source "
        "(control, reference) images, one per target image in data.path with the same relative path and name, any "
        "image extension (`target/a.png` pairs with `control/a.jpg`). Absolute, or relative to data.path "
        "(`../control`: the folder beside it). A list of folders gives each target several references, reference k "
        "from the k-th folder (the multi-image edit models: docs/data.md). In "
        "metadata.jsonl a line's `control_file_name` (relative to data.path; a list for several) names its "
        "references instead. Each reference is resized and cropped with its target (same bucket, same crop and "
        "flip), or keeps its own size with data.reference_size: own; `validate` counts the pairs and names every sample missing a reference, with the file it looked "
        "for. See docs/data.md. Video models trained on reference clips (in-context control, an IC-LoRA): "
        "the folder of reference clips (or images), one per target clip, matched the same way; each is read with its "
        "clip's frames.",
    )
    reference_size: Optional[Literal["target", "own"]] = Field(
        None,
        description="How data.control_dir's reference images are sized. `target`: resized and cropped with their "
        "target (its size or bucket, its crop, its flip). `own`: each reference keeps its own aspect ratio, resized "
        "(not cropped) to the area of its target's size, sides multiples of 32, flipped with its target; it is "
        "cached at that size and adds its own tokens. Default: the model's (own for the multi-image edit models, "
        "whose pipelines size each input image by itself; target for the others, as their diffusers training "
        "scripts do). With train.micro_batch_size above 1, `validate` checks that the samples' references share "
        "their sizes (see docs/data.md).",
    )
    mask_dir: Optional[str] = Field(
        None,
        description="Masked loss: a folder of loss masks, one per training image with the same relative path and "
        "name, any image extension (`images/a.png` takes `masks/a.png`). White trains fully, black is left out of the loss, grey weighs between. Absolute, or relative to "
        "data.path (`../masks`: the folder beside it). An image without a mask trains whole (`validate` counts "
        "them). Each mask is resized and cropped with its image and averaged down to the latent grid (cached beside "
        "the latents with data.cache.latents); a sample's loss is sum(mask x error) / sum(mask). Video clips "
        "(model.family video) take a mask image (every frame alike) or a mask video of their frames (frame by "
        "frame), averaged in time as the VAE compresses it. See docs/data.md.",
    )
    alpha_mask: bool = Field(
        False,
        description="Masked loss from each image's alpha channel (kohya's alpha_mask): transparent pixels are left "
        "out of the loss, opaque ones train, as data.mask_dir's masks do. An image without alpha trains whole. "
        "Not with data.mask_dir; image families only (clips have no alpha).",
    )
    sets: Optional[list[DataSetSpec]] = Field(
        None,
        description="Several datasets in one run (data.path is the one-set form: give one or the other). Each set "
        "has its path and may give its own format, resolution, buckets, caption_extension, caption_dropout, mask_dir "
        "or alpha_mask (unset: data's), its `repeats` (each sample x repeats per epoch) or, in every set, its `weight` (its share of the epoch), its `role` (train; regularization: DreamBooth's "
        "class images; preservation: the base model's output as the target, with LoRA) and its `loss_weight`. An epoch holds every set's samples x repeats; the sets are spread "
        "evenly through it, so each global batch holds them in their shares (to one sample), the same for any "
        "number of ranks. `validate` prints a row per set. Image families (model.family flow and the UNet families). See docs/data.md.",
    )
    num_workers: int = Field(2, ge=0, description="Data loader worker processes per rank.")
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Latent and text-embedding cache.")
    video: VideoSpec = Field(
        default_factory=VideoSpec,
        description=f"The video family (model.family {VIDEO_FAMILY}): frames per clip (or "
        "frame-count buckets), which "
        "frames (head, uniform, sliding chunks), frame rate. "
        "Video datasets: `builtin:moving-shapes`, `builtin:moving-shapes-av` (with sound), or folders of .mp4/.webm/.mov/.mkv (and still images) with "
        "same-stem .txt captions or metadata.jsonl.",
    )
    buckets: BucketsSpec = Field(
        default_factory=BucketsSpec, description="Aspect-ratio buckets (off by default: square crops)."
    )
    min_clip_seconds: float = Field(
        0.0, ge=0, description="Audio: clips shorter than this are skipped (counted by `validate` and at start)."
    )
    max_clip_seconds: float = Field(
        20.0, gt=0, description="Audio: clips longer than this are skipped (counted by `validate` and at start)."
    )
    eval: Optional[EvalSpec] = Field(
        None,
        description="Held-out loss: a folder or a fraction of data.path, evaluated every `every_steps` with "
        "fixed noise and timesteps per sample (comparable across evaluations and numbers of ranks). Image families. "
        "See docs/training.md.",
    )
    duration_bucket_seconds: Optional[float] = Field(
        None,
        gt=0,
        description="Audio length grouping: clips fall into duration buckets this many seconds wide and every global "
        "batch comes from one bucket (fixed micro batch of utterances), so padding stays small. Omitted: no grouping.",
    )
    speaker_balance: bool = Field(
        False,
        description="Audio datasets with speakers (GPT-SoVITS .list, metadata.jsonl `speaker`): every epoch "
        "gives each speaker the same number of places (small speakers repeat, large ones leave clips out), drawn "
        "from train.seed, the same on every rank. Not with duration_bucket_seconds. See docs/tts.md.",
    )
    max_unknown_tokens: float = Field(
        MAX_UNKNOWN_TOKENS,
        ge=0,
        le=1,
        description="Audio: the largest share of a transcript's tokens the model's tokenizer may not know (its "
        "unknown token, or a character written as UTF-8 byte pieces) before `validate` refuses the sample: a dataset "
        "in a language the tokenizer does not cover is named with each sample's share and the characters it lacks. "
        "Samples under it with unknown tokens are a warning. 1.0 accepts every sample. See docs/tts.md, A new language.",
    )
    speakers: Literal["separate", "blend"] = Field(
        "separate",
        description="Audio datasets with speakers (GPT-SoVITS .list, metadata.jsonl `speaker`). `separate`: each "
        "speaker is its own voice, given to the model the way it conditions on speakers (its speaker ids, dialogue "
        "tags, `Speaker N:` script lines, speaker vectors or prompt names; the sorted names take the model's ids in "
        "order); `validate` prints the mapping and refuses several speakers for a model that cannot "
        "tell them apart. `blend`: the speaker column is left out and every clip trains the model's default voice. "
        "See docs/tts.md, Speakers.",
    )

    @model_validator(mode="after")
    def _bucket_step_fits(self) -> "DataSpec":
        if (
            self.buckets.enabled
            and not self.buckets.sizes
            and self.buckets.step > self.resolution
            and "resolution" in self.model_fields_set
        ):  # unset: the model's native size, known to validate
            raise ValueError(
                f"data.buckets.step {self.buckets.step} is larger than data.resolution {self.resolution}: no bucket "
                f"side fits. Use a step of at most {self.resolution} (a multiple of 8), or give data.buckets.sizes."
            )
        return self

    @model_validator(mode="after")
    def _path_or_sets(self) -> "DataSpec":
        if self.sets is None:
            return self
        if not self.sets:
            raise ValueError(
                "data.sets is empty: give at least one set (`- path: ...`), or remove it and use data.path"
            )
        if self.path != DEFAULT_DATA_PATH:  # the default is what a saved spec (every key written) holds
            raise ValueError(
                "give data.path (one dataset) or data.sets (several), not both: move data.path into data.sets as "
                "`- path: ...`"
            )
        if self.eval is not None and self.eval.fraction is not None:
            raise ValueError(
                "data.eval.fraction holds out a share of data.path; with data.sets give the held-out images as a "
                "folder of their own (data.eval.path)"
            )
        return self

    @model_validator(mode="after")
    def _one_mask_source(self) -> "DataSpec":
        if self.mask_dir is not None and self.alpha_mask:
            raise ValueError("data.mask_dir and data.alpha_mask both give loss masks: keep one")
        if self.sets is None and self.path.startswith(BUILTIN_PREFIX) and (self.mask_dir or self.alpha_mask):
            raise ValueError(
                f"data.mask_dir and data.alpha_mask read masks from a dataset's files; data.path {self.path} is "
                "generated and has none. Point data.path at your images."
            )
        return self

    def set_specs(self) -> list["DataSpec"]:
        """Each set as the DataSpec it trains with: data's keys, the set's own (SET_OVERRIDES) in their place; the
        one-set form (data.path) is [data]."""
        if self.sets is None:
            return [self]
        return [
            self.model_copy(
                update={
                    "sets": None,
                    "eval": None,
                    **{key: getattr(item, key) for key in SET_OVERRIDES if getattr(item, key) is not None},
                }
            )
            for item in self.sets
        ]

    @property
    def masked(self) -> bool:
        """Whether samples carry loss masks (data.mask_dir or data.alpha_mask, here or in a set)."""
        return any(one.mask_dir is not None or one.alpha_mask for one in self.set_specs())

    @property
    def control_dirs(self) -> list[str]:
        """data.control_dir as a list of folders, one per reference ([] without)."""
        if self.control_dir is None:
            return []
        return [self.control_dir] if isinstance(self.control_dir, str) else list(self.control_dir)

    @model_validator(mode="after")
    def _control_needs_files(self) -> "DataSpec":
        folders = self.control_dir
        if isinstance(folders, list) and (not folders or len(set(folders)) != len(folders)):
            raise ValueError(
                f"data.control_dir: a list gives one folder per reference; got {folders}, which is empty or names "
                "a folder twice. List each reference folder once (or give one folder as a string)."
            )
        if self.control_dir is not None and self.sets is None and self.path.startswith(BUILTIN_PREFIX):
            raise ValueError(
                f"data.control_dir pairs source images with the target images of a folder; data.path "
                f"{self.path} is generated and has no files to pair. Point data.path at the targets."
            )
        return self

    @model_validator(mode="after")
    def _cache_needs_fixed_crop(self) -> "DataSpec":
        if self.cache.latents and not self.center_crop:
            raise ValueError(
                "data.cache.latents: true needs data.center_crop: true: a cached latent freezes one crop, so a "
                "random crop would silently become the same crop every epoch. Set center_crop: true or turn "
                "latent caching off."
            )
        return self

    @field_validator("drop_last")
    @classmethod
    def _only_drop_last(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "drop_last: false is not supported: a short last batch would change the global batch size and the "
                "learning-rate arithmetic. Use a global batch that divides the dataset to lose nothing."
            )
        return value

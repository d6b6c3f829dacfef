"""The card of a video model (`model.family video`, VideoCard): its pipeline folder (PipelineCard) and what validate,
the memory plan, the video planner and start-up know of it without torch. What is common to the video models is
here (two experts and the timesteps each trains, the clip buckets, the latent cache, the sequence-parallel attention);
what is a model's own (its token factors, its activations, its text and first-frame cache bytes, its spec checks) is
a method its card type overrides.

Tokens of a clip: latent frames (1 + (frames - 1) / 4) x (H / s / ph) x (W / s / pw), with the VAE's spatial factor s
and the transformer's patch (pt, ph, pw) read from the model's configs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Optional, Sequence

from dstune import registry
from dstune.card import ClipRule
from dstune.families.base import FamilyError
from dstune.families.denoiser_facts import (
    PipelineFolder,
    count_denoiser,
    latent_channels,
    pipeline_folder,
    side_issues,
)
from dstune.families.facts import Attention, no_plan_refusal
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import PipelineCard, SpecIssues
from dstune.memory.counts import SizesUnknown, count_component
from dstune.memory.working import Geometry, VaeWork
from dstune.spec.section import VIDEO_FAMILY
from dstune.spec.video_models import expert_problems, expert_range, expert_range_text, experts_in

# Where a model's configs are not here (a hub id not downloaded, no stored copy), tokens are estimated with the
# common video layout: an 8x VAE and 1x2x2 patches; validate says so where it prints them.
ASSUMED_SPATIAL, ASSUMED_PATCH = 8, (1, 2, 2)
TEMPORAL_COMPRESSION = 4  # the video VAEs: the first frame, then 4 frames per latent frame (frames are 4k+1)

TokenFactors = tuple[int, tuple[int, int, int], int, str]  # (VAE spatial factor, patch (t, h, w), temporal, origin)
# what validate's clip tokens read (token_factors below): (VAE spatial factor, patch (t, h, w), clip rule, origin)
ClipFactors = tuple[int, tuple[int, int, int], ClipRule, str]


def clip_buckets(spec, num_samples: int, clips) -> list[tuple[int, int, int, int]]:
    """The (frames, width, height, clips) buckets, or all clips at the longest count and the square."""
    side = spec.data.resolution
    return list(clips) or [(spec.data.video.max_frames, side, side, num_samples)]


def clip_volume(frames: int, width: int, height: int, *_, rule: ClipRule = ClipRule(TEMPORAL_COMPRESSION)) -> int:
    """Latent frames (the model's clip rule) x pixels: what a clip's tokens and its cached latent grow with."""
    return rule.latent_frames(frames) * width * height


def expert_summary(index: dict, expert: str, timestep_range) -> dict:
    """`memory.parameters.expert` of validate --json: the expert, its component and the timesteps it trains."""
    low, high, inclusive = expert_range(index, expert, timestep_range)
    return {
        "name": expert,
        "component": "transformer_2" if expert == "low_noise" else "transformer",
        "boundary_ratio": index["boundary_ratio"],
        "timesteps": [low, high],
        "max_included": inclusive,
        "text": expert_range_text(index, expert, timestep_range),
    }


@dataclass(frozen=True, kw_only=True)
class VideoCard(PipelineCard):
    """A video model's card (see the module docstring): its own facts are the methods below that raise."""

    # a guidance-distilled model whose class fits model.cfg_augmented_target (its loss rearranges the guidance)
    fits_guided_target: ClassVar[bool] = False

    # ------------------------------------------------------------------------------- the model's own facts

    def token_factors(self, folder: PipelineFolder) -> TokenFactors:
        """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, where they came from)."""
        raise NotImplementedError(f"{self.name}'s card says no token factors")

    def clip_rule(self, folder: PipelineFolder) -> ClipRule:
        """The frame counts the model's VAE takes and their latent frames: a causal VAE of the temporal factor
        (token_factors) keeps the first frame (4k+1 -> k+1) unless the model's card says otherwise."""
        return ClipRule(self.token_factors(folder)[2])

    def frame_issues(self, spec, folder: PipelineFolder) -> SpecIssues:
        """data.video.frames (and each set's own) and model.sample_frames against the clip rule, naming the counts
        the VAE takes."""
        rule, whose = self.clip_rule(folder), f"{self.name}'s VAE"
        issues = [
            (f"{prefix}.frames", "; ".join(rule.problem(count, whose) for count in uneven))
            for prefix, section in set_videos(spec.data)
            if (uneven := [count for count in section.frame_counts if not rule.takes(count)])
        ]
        frames = getattr(spec.model, "sample_frames", None)
        if frames is not None and not rule.takes(frames):
            issues.append(("model.sample_frames", rule.problem(frames, whose)))
        return issues

    def clip_activation_bytes(self, spec, folder: PipelineFolder, frames: int, width: int, height: int):
        """One clip's activations at (frames, width, height), in the memory plan's units: (full, checkpointed)."""
        raise NotImplementedError(f"{self.name}'s card says no activations")

    def image_to_video(self, spec, folder: PipelineFolder) -> bool:
        """Whether this run trains image-to-video (the first frame given)."""
        return False

    def text_bytes(self, spec, folder: PipelineFolder) -> int:
        """One caption's cached text tensors, in bytes."""
        return 0

    def condition_cache_bytes(self, spec, folder, companions: dict, channels: int, factor: int, buckets, num_samples):
        """The first-frame condition the latent cache stores beside the clips, in bytes."""
        return 0

    def model_spec_issues(self, spec, folder: PipelineFolder) -> SpecIssues:
        """The spec against the folder's own configs, beyond what every video model is checked for."""
        return []

    def model_problems(self, folder: Path, model_spec) -> list[str]:
        """What the model itself refuses of the folder with these model keys (its layout against
        model.image_to_video, say), beyond the components and the configs' agreement."""
        return []

    def appended_latent_frames(self, spec) -> int:
        """Latent frames the transformer reads after each clip's own (a reference frame appended to the sequence):
        counted in the clip's tokens, which validate prints and a sequence split divides."""
        return 0

    def split_tokens(self, spec, frames: int, video_tokens: int) -> tuple[int, str]:
        """(the tokens a sequence-parallel split divides of one sample whose clip has `frames` frames and
        `video_tokens` transformer tokens, what they are): the clip's tokens, unless the model splits a longer
        sequence ("" says they are the clip's)."""
        return video_tokens, ""

    def split_attention(self, folder: PipelineFolder) -> Optional[Attention]:
        """Attention facts of a model whose sequence-parallel plan is dstune's (not its class's); None: the class's."""
        return None

    def folder_sampling_parts(self, folder: PipelineFolder) -> tuple[str, ...]:
        """The frozen parts loaded only while samples render, of those the folder has."""
        return tuple(part for part in self.sampling_parts if (folder.index.get(part) or [None])[0])

    # ------------------------------------------------------------------------------- checks

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """model.expert and model.timestep_range against the folder's experts, the components, the configs'
        agreement and the model's own refusals."""
        index = read_model_index(folder)
        problems = expert_problems(index, model_spec.expert, model_spec.timestep_range)
        problems += component_problems(folder, index, self.components)
        if not problems:
            problems += self.config_mismatches(folder)
        return problems + self.model_problems(folder, model_spec)

    def settings_issues(self, model_spec) -> SpecIssues:
        issues = super().settings_issues(model_spec)
        if getattr(model_spec, "cfg_augmented_target", None) is not None and not self.fits_guided_target:
            issues.append(
                (
                    "model.cfg_augmented_target",
                    f"{self.name} is not a guidance-distilled model dstune fits a guidance-augmented target for "
                    "(docs/family-*.md say which are): remove it",
                )
            )
        if model_spec.timestep_sampling == "shifted_logit_normal" and not self.draws_sigma:
            issues.append(
                (
                    "model.timestep_sampling",
                    "shifted_logit_normal is the sampler of the video models that draw sigma themselves; "
                    f"{self.name} indexes the scheduler's tables: use uniform, logit_normal or mode",
                )
            )
        return issues

    def spec_issues(self, spec) -> SpecIssues:
        """A video spec against its folder's own configs, before any GPU time (startup checks again): model.expert
        and model.timestep_range against model_index.json (two experts need an expert; a range stays on its
        expert's side of boundary_ratio), the model keys it refuses, then the model's own checks."""
        try:
            folder = pipeline_folder(spec.model.pretrained)
            folder.config("transformer"), folder.config("vae")
        except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the folder itself
            return self.text_offload_issues(spec)
        issues = self.text_offload_issues(spec) + [
            (
                "model.timestep_range" if problem.startswith("model.timestep_range") else "model.expert",
                f"{spec.model.pretrained}: {problem}",
            )
            for problem in expert_problems(folder.index, spec.model.expert, spec.model.timestep_range)
        ]
        spatial, patch, _, _ = self.token_factors(folder)
        side = spatial * max(patch[1], patch[2])
        why = (
            f"{spec.model.pretrained} takes clip sides in multiples of {side} px (its VAE's {spatial}x, then "
            f"{patch[1]}x{patch[2]} patches)"
        )
        issues += self.settings_issues(spec.model) + side_issues(spec, side, why) + self.tiling_issues(spec, folder)
        if spec.output.lora_format == "comfyui" and not self.original_lora_names:
            issues.append(
                (
                    "output.lora_format",
                    f"{spec.model.pretrained}: dstune has no ComfyUI format for {self.name} (ComfyUI's loader maps the "
                    "layer names of the model's original checkpoints, and dstune has no map of them for it). Set "
                    "output.lora_format: diffusers (its pipeline's load_lora_weights loads it)",
                )
            )
        return issues + self.frame_issues(spec, folder) + self.model_spec_issues(spec, folder)

    # ------------------------------------------------------------------------------- memory

    def trained(self, spec, folder: PipelineFolder) -> tuple:
        """The expert a two-expert folder trains (the other loads only while samples render), else the transformer
        (with the parts the model loads for samples only)."""
        if spec.model.expert is None or "transformer_2" not in experts_in(folder.index):
            parts = self.folder_sampling_parts(folder)
            return (
                "transformer",
                {part: count_component(str(folder.path / part / "config.json"))[0] for part in parts},
                None,
            )
        module, other = (
            ("transformer_2", "transformer") if spec.model.expert == "low_noise" else ("transformer", "transformer_2")
        )
        sampling_only = {other: count_component(str(folder.path / other / "config.json"))[0]}
        return module, sampling_only, expert_summary(folder.index, spec.model.expert, spec.model.timestep_range)

    def uses_image_encoder(self, spec, folder: PipelineFolder) -> bool:
        return self.image_to_video(spec, folder)

    def activation_bytes(self, spec, folder: PipelineFolder, config: dict, clips) -> tuple[float, float]:
        """The largest bucket's clip."""
        frames, width, height, _ = max(clip_buckets(spec, 0, clips), key=lambda b: clip_volume(*b))
        return self.clip_activation_bytes(spec, folder, frames, width, height)

    def cache_bytes(self, spec, folder: PipelineFolder, companions: dict, num_samples: int, clips) -> int:
        """Each bucket's clips' posteriors (float32 mean and std), the first-frame condition, and the captions'
        text."""
        latents = 0
        if spec.data.cache.latents and "vae" in companions:
            channels, factor, rule = *latent_channels(folder), self.clip_rule(folder)
            buckets = clip_buckets(spec, num_samples, clips)
            latents = sum(
                2 * channels * clip_volume(f, w // factor, h // factor, rule=rule) * 4 * n for f, w, h, n in buckets
            )
            latents += self.condition_cache_bytes(spec, folder, companions, channels, factor, buckets, num_samples)
        return self.text_bytes(spec, folder) * num_samples + latents

    def geometry(self, spec, folder: PipelineFolder, clips) -> Geometry:
        """The largest bucket's clip (a cache entry) and a sample (model.sample_frames at data.resolution's square),
        with their latent tokens at the VAE's compression; samples render one prompt a call."""
        spatial, rule = self.token_factors(folder)[0], self.clip_rule(folder)
        frames, width, height, _ = max(clip_buckets(spec, 0, clips), key=lambda b: clip_volume(*b))
        side, sample_frames = spec.data.resolution, spec.model.sample_frames

        def tokens(f: int, w: int, h: int) -> float:
            return rule.latent_frames(f) * (w // spatial) * (h // spatial)

        return Geometry(
            (frames, width, height),
            tokens(frames, width, height),
            (sample_frames, side, side),
            tokens(sample_frames, side, side),
        )

    def tiling_issues(self, spec, folder: PipelineFolder) -> SpecIssues:
        """model.vae_tiling on a VAE whose tiles' memory no one measured (VaeWork.tile_px)."""
        if not spec.model.vae_tiling:
            return []
        vae_class = (folder.index.get("vae") or [None, None])[1]
        work = self.working.get(vae_class)
        if isinstance(work, VaeWork) and work.tile_px:
            return []
        known = sorted(
            {
                name
                for card in registry.family_cards(self.family)
                for name, work in getattr(card, "working", {}).items()
                if isinstance(work, VaeWork) and work.tile_px
            }
        )
        return [
            (
                "model.vae_tiling",
                f"{spec.model.pretrained}: its VAE ({vae_class}) encodes whole clips here; dstune tiles only the VAEs "
                f"whose tiles' memory it measured ({', '.join(known) or 'none'}): remove model.vae_tiling",
            )
        ]

    def count(self, spec, num_samples: int, clips: Sequence = ()):
        return count_denoiser(spec, num_samples, clips, self)

    def pairs(self, spec) -> Optional[str]:
        return None

    def attention(self, spec) -> Optional[Attention]:
        """The transformer's attention heads (what a sequence-parallel split must divide), None when its config is
        not here; a refusal for a transformer class without a context-parallel plan. Two experts have the same
        shape, so the high-noise one speaks for both."""
        try:
            folder = pipeline_folder(spec.model.pretrained)
            config = folder.config("transformer")
        except (SizesUnknown, OSError, ValueError):
            return None
        own = self.split_attention(folder)
        if own is not None:  # its plan is dstune's
            return own
        origin = f"the transformer config of {folder.origin}"
        no_plan = no_plan_refusal(self.transformer_class)
        if no_plan:
            return Attention(0, 0, origin, no_plan)
        if not isinstance(config.get("num_attention_heads"), int):
            return None
        return Attention(config["num_attention_heads"], config.get("attention_head_dim", 0), origin)


# ----------------------------------------------------------------------------------------- which model


def card_of_folder(cards: Sequence[VideoCard], folder: Path) -> VideoCard:
    """The card of the video model a pipeline folder holds, by its transformer class (and, where models share one,
    its pipeline class); FamilyError naming the known ones."""
    path = Path(folder) / "transformer" / "config.json"
    transformer = read_component_config(Path(folder), "transformer").get("_class_name") if path.is_file() else None
    candidates = [card for card in cards if card.transformer_class == transformer]
    if not candidates:
        raise FamilyError(
            f"{folder} cannot be used as a video pipeline (model.family {VIDEO_FAMILY}): its transformer "
            f"({transformer or 'no transformer/config.json'}) is none of the video models dstune trains "
            f"({', '.join(f'{card.name}: {card.transformer_class}' for card in cards)})"
        )
    pipeline = read_model_index(Path(folder)).get("_class_name")
    return next((card for card in candidates if pipeline in card.folder_classes), candidates[0])


def card_of_configs(cards: Sequence[VideoCard], folder: PipelineFolder) -> Optional[VideoCard]:
    """The card of a folder known by its configs (validate); None when no video model has its transformer."""
    transformer = (folder.index.get("transformer") or [None, None])[1]
    candidates = [card for card in cards if card.transformer_class == transformer]
    pipeline = folder.index.get("_class_name")
    return next((card for card in candidates if pipeline in card.folder_classes), candidates[0] if candidates else None)


def card_of_reference(cards: Sequence[VideoCard], pretrained: str) -> Optional[VideoCard]:
    """The card of the video model `pretrained` holds, from its configs (None: no video model has its
    transformer); SizesUnknown when its configs are not here."""
    folder = pipeline_folder(pretrained)
    folder.config("transformer"), folder.config("vae")
    return card_of_configs(cards, folder)


def unknown_model(cards: Sequence[VideoCard], spec, raising: bool) -> SpecIssues:
    """A folder whose configs are here but name none of the video models is refused (the list of them); one whose
    configs are not here is left to start-up. The plan cannot count either: SizesUnknown with the reason."""
    known = ", ".join(card.transformer_class for card in cards)
    try:
        folder = pipeline_folder(spec.model.pretrained)
        folder.config("transformer"), folder.config("vae")
    except (SizesUnknown, OSError, ValueError):
        if raising:
            raise
        return []
    if raising:
        raise SizesUnknown(f"{folder.origin}: its transformer is none of the video models dstune trains ({known})")
    transformer = (folder.index.get("transformer") or [None, "none"])[1]
    return [
        (
            "model.pretrained",
            f"{spec.model.pretrained}: its transformer ({transformer}) is none of the video models dstune trains "
            f"({known})",
        )
    ]


def token_factors(cards: Sequence[VideoCard], pretrained: str, spec=None) -> ClipFactors:
    """The token factors of a video model's configs with the clip rule of its transformer's tokens (the VAE's, with
    the latent frames the model appends after a clip's own for `spec`), or the common layout where they are not here
    (said so)."""
    assumed = f"{ASSUMED_SPATIAL}x VAE, {'x'.join(map(str, ASSUMED_PATCH))} patches"
    try:
        folder = pipeline_folder(pretrained)
        folder.config("vae"), folder.config("transformer")
    except (SizesUnknown, OSError, ValueError):
        return (
            ASSUMED_SPATIAL,
            ASSUMED_PATCH,
            ClipRule(TEMPORAL_COMPRESSION),
            f"assumed ({assumed}): the model's configs are not here",
        )
    card = card_of_configs(cards, folder)
    if card is None:  # model.pretrained is refused for it (spec_issues): its configs say nothing of a video model
        why = f"assumed ({assumed}): {folder.origin} is none of the video models dstune trains"
        return ASSUMED_SPATIAL, ASSUMED_PATCH, ClipRule(TEMPORAL_COMPRESSION), why
    spatial, patch, _, origin = card.token_factors(folder)
    rule, appended = card.clip_rule(folder), card.appended_latent_frames(spec) if spec is not None else 0
    return spatial, patch, replace(rule, first_latents=rule.first_latents + appended), origin


def set_videos(data) -> list[tuple[str, object]]:
    """(dotted key, video section) of data.video and of every set that gives its own (data.sets.N.video)."""
    own = [(f"data.sets.{n}.video", item.video) for n, item in enumerate(data.sets or []) if item.video is not None]
    return [("data.video", data.video)] + own

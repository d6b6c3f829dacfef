"""LTX-2's sequence split (deepspeed.sequence_parallel_size N > 1; dstune.families.ulysses applies it), for video
and for audio+video training. diffusers 0.42's own plan for LTX2VideoTransformer3DModel (`_cp_plan`) splits the
caption and its mask with the clip, but the attention processor expands the mask to every head before the Ulysses
all-to-all divides the heads, so the masked cross-attention fails on N > 1. dstune's plan splits the clip alone:

- the clip's tokens are split at the transformer's input, the video rotary table (the one video self-attention
  reads) with them, and the output projection's tokens are gathered back;
- only the video self-attention runs the Ulysses all-to-all; every other attention runs on this rank's queries
  against keys it holds whole, which is exact because an attention's queries are independent of each other. The
  caption is kept whole rather than split: its cross-attention then needs no all-to-all at all, its mask no
  re-layout, and N no rule on model.max_sequence_length (the caption's keys and values, max_sequence_length x the
  width per block, are computed on every rank; its gradients are each rank's queries' share, which the group sums);
- the audio stream (a clip's sound tokens, 25 a second, or in video-only training one zero token cut off by
  isolate_modalities) is kept whole on every rank: every rank computes the same audio. The video queries' attention
  to the audio takes this rank's share of the cross-modal rotary table; the audio queries' attention to the video
  gathers the video's keys and values, and in backward sums every rank's gradient of them before each rank takes
  its share (dstune.families.ulysses.gathered_over_group), so a video token gets the gradient of the audio on every
  rank, not only on its own. The audio's own loss is then computed on every rank of the group, and the group sums
  gradients: the flow core divides that loss's gradient by N (dstune.models.ltx2.model), its value unchanged. The
  2-rank runs of tests/dist/test_sequence_parallel.py check that losses, gradient norms and the LoRA file equal one
  rank's with the clips' sound;
- samples (no gradients) run the pipeline's joint audio and video the same way.
"""

from __future__ import annotations

from dstune.families.ulysses import gathered_over_group

PROCESSOR_CLASSES = ("LTX2AudioVideoAttnProcessor", "LTX2PerturbedAttnProcessor")
AUDIO_ONLY = ("audio_attn1", "audio_attn2")  # the audio stream's own attentions: whole on every rank
CAPTION = ("attn2",)  # the clip's queries, the caption's keys: whole keys, no all-to-all
VIDEO_QUERIES_AUDIO_KEYS = "audio_to_video_attn"
AUDIO_QUERIES_VIDEO_KEYS = "video_to_audio_attn"


def context_parallel_plan(rope_type: str) -> dict:
    """Where the clip splits and gathers (the names are LTX2VideoTransformer3DModel's modules and its forward's
    arguments). The video rotary table is (B, tokens, D) for interleaved RoPE, (B, heads, tokens, D / heads / 2)
    for split RoPE (LTX-2's own checkpoints)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)  # (B, clip tokens, channels)
    if rope_type == "split":
        table = ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
    else:
        table = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    return {
        "": {"hidden_states": tokens},
        "rope": {0: table, 1: table},  # the video self-attention's cos and sin
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class WholeKeysAttention:
    """An LTX-2 attention whose keys every rank holds whole (the caption, the audio), or gathers whole (the video's,
    for the audio's queries): the stock processor without the all-to-all. `_parallel_config` is set by the split
    (dstune.families.ulysses) and read here for the sequence group only, never handed to the attention."""

    _parallel_config = None

    def __init__(self, stock, role: str = ""):
        self.stock = stock  # its own _parallel_config stays None: no all-to-all
        self.role = role

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        from diffusers.hooks.context_parallel import EquipartitionSharder

        config = self._parallel_config
        if config is not None and self.role == VIDEO_QUERIES_AUDIO_KEYS and query_rotary_emb is not None:
            mesh = config.context_parallel_config._flattened_mesh  # this rank's share of the video's table
            query_rotary_emb = tuple(EquipartitionSharder.shard(t, t.ndim - 2, mesh) for t in query_rotary_emb)
        if config is not None and self.role == AUDIO_QUERIES_VIDEO_KEYS:
            mesh = config.context_parallel_config._flattened_mesh  # every video key, for the whole audio
            encoder_hidden_states = gathered_over_group(encoder_hidden_states, mesh.get_group())
        extra = {}
        if perturbation_mask is not None or all_perturbed is not None:
            extra = {"perturbation_mask": perturbation_mask, "all_perturbed": all_perturbed}
        return self.stock(
            attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb, **extra
        )


def _checked_forward(module, args, kwargs):
    """A forward pre-hook: the split forward refuses what it does not split."""
    for key in ("video_self_attention_mask", "video_keyframes_mask"):
        if kwargs.get(key) is not None:
            raise ValueError(f"LTX-2's sequence split does not split {key}; call it without {key}")
    timestep = kwargs.get("timestep")
    if timestep is not None and timestep.ndim > 1 and timestep.shape[1] > 1:
        raise ValueError(
            "LTX-2's sequence split takes one timestep per sample, not one per token (image-to-video's "
            "per-token timesteps are not split)"
        )
    return None


def prepare_split(transformer, size: int) -> dict:
    """Make `transformer` (an LTX2VideoTransformer3DModel, PEFT-wrapped or not) splittable over `size` ranks: every
    attention but the video self-attention on whole keys, the forward checked; returns the plan to apply."""
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if type(processor).__name__ not in PROCESSOR_CLASSES:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in AUDIO_ONLY + CAPTION + (VIDEO_QUERIES_AUDIO_KEYS, AUDIO_QUERIES_VIDEO_KEYS):
            module.set_processor(WholeKeysAttention(processor, leaf))
    transformer.register_forward_pre_hook(_checked_forward, with_kwargs=True)
    return context_parallel_plan(transformer.config.rope_type)

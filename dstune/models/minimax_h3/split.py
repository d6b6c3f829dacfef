"""MiniMax-H3's sequence split (deepspeed.sequence_parallel_size N > 1; dstune.families.ulysses applies it).
MiniMaxH3Transformer3DModel's own context-parallel plan (`_cp_plan`, diffusers 0.42) splits its one packed sequence
`[text | sound | video]` once the packed buffer is built (at the first block), each row's AdaLN index at every
block, its timestep index at the output norm and its rotary angles, and gathers both output heads back. It needs the
packed length to divide N, and the length is the caption's tokens (any number: the text is unpadded) + the sound's
rows + the video's. diffusers' answer to an uneven length (`ulysses_anything`) has no backward pass, so dstune pads:

- the packed sequence is padded at its end to a multiple of N with rows that no stream is scattered into (zeros;
  rotary position 0, the video's timestep): `position_ids`, `token_tags` and `timestep_indices` get the extra rows;
- the padding is masked as keys in every block's attention (the mask rides with the rotary angles, so a block that
  gradient checkpointing recomputes gets its own clip's mask back). The padding's own outputs are never read: the
  output heads select the video's and the sound's rows by index, so the prediction is the unpadded one;
- the text refiner (attention over the caption alone, before the split) runs whole on every rank, without the
  all-to-all: each rank's gradient of it is its tokens' share, which the group sums.
"""

from __future__ import annotations

import torch

BLOCK_ATTENTION = "transformer_blocks."  # the packed sequence's attentions (split); the refiner's run whole


class PackedAttention:
    """MiniMaxH3AttnProcessor's attention with the packed sequence's padding masked as keys (the mask, when the
    clip was padded, is the rotary tuple's third entry, over the whole padded sequence). `split`: the Ulysses
    all-to-all runs (dispatch_attention_fn with `_parallel_config`, set by dstune.families.ulysses); the text
    refiner's attention keeps its whole caption on every rank instead."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, split: bool):
        self.split = split

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

        query, key, value = (
            projection(hidden_states).unflatten(-1, (attn.heads, -1))
            for projection in (attn.to_q, attn.to_k, attn.to_v)
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        valid_keys = None
        if rotary_emb is not None:
            cos, sin, *mask = rotary_emb
            query, key = _apply_rotary_emb(query, cos, sin), _apply_rotary_emb(key, cos, sin)
            valid_keys = mask[0] if mask else None
        attended = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=valid_keys,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config if self.split else None,
        )
        attended = attended.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](attended))


class PackedPadding:
    """The transformer's forward pre-hook (padding the layout to a multiple of `size` rows) and its rotary
    embedding's forward hook (the key mask of that forward's padding beside the angles)."""

    def __init__(self, size: int):
        self.size, self.rows = size, None

    def pad(self, module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None or "token_tags" not in kwargs or "timestep_indices" not in kwargs:
            raise ValueError(
                "MiniMax-H3's split forward takes its layout as keyword arguments (position_ids, token_tags, "
                "timestep_indices), as its pipeline and dstune's training step pass it"
            )
        rows = positions.shape[0]
        extra = -rows % self.size
        self.rows = (rows, extra)
        if extra:
            kwargs["position_ids"] = torch.cat([positions, positions.new_zeros(extra, positions.shape[1])])
            for name in ("token_tags", "timestep_indices"):
                tensor = kwargs[name]
                kwargs[name] = torch.cat([tensor, tensor[-1:].expand(extra)])  # a video row's tag and timestep
        return args, kwargs

    def mask(self, module, inputs, output):
        if self.rows is None:
            raise RuntimeError("MiniMax-H3's rotary embedding ran outside the transformer's split forward")
        (rows, extra), self.rows = self.rows, None
        if not extra:
            return output
        valid = torch.arange(rows + extra, device=output[0].device) < rows
        return (*output, valid.view(1, 1, 1, -1))  # (batch, heads, queries, keys): every query, the real keys


def prepare_split(transformer, size: int) -> dict:
    """Make `transformer` (a MiniMaxH3Transformer3DModel, PEFT-wrapped or not) splittable over `size` ranks: its
    attentions masking the padding as keys (the refiner's whole on every rank), its layout padded to a multiple of
    `size`; returns its class's own plan, which splits the padded sequence."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention, MiniMaxH3Transformer3DModel

    for name, module in transformer.named_modules():
        if isinstance(module, MiniMaxH3Attention):
            module.set_processor(PackedAttention(split=BLOCK_ATTENTION in name))
    padding = PackedPadding(size)
    transformer.register_forward_pre_hook(padding.pad, with_kwargs=True)  # before the plan's hooks
    transformer.rope.register_forward_hook(padding.mask)  # after the plan splits the angles
    return MiniMaxH3Transformer3DModel._cp_plan

"""Kandinsky 6's sequence split (deepspeed.sequence_parallel_size N > 1; dstune.families.ulysses applies it). diffusers
0.42 gives Kandinsky6Transformer3DModel no context-parallel plan (`_cp_plan`), so dstune writes one here: its splits
and gathers are forward hooks of its own (diffusers' context-parallel hooks take only outputs that are all tensors,
and a fused block returns (video, None) when the forward runs without sound), its video self-attention diffusers'
Ulysses attention (the processor's dispatch_attention_fn with the split's parallel config). The transformer runs
three kinds of streams: the text (a branch of text blocks per modality over the caption), the clip's video tokens and
the clip's sound tokens, which the fused blocks run side by side, each cross-attending to the other. Only the video
is split:

- the video tokens are split at the first fused block's input (not at the transformer's: its forward patchifies the
  clip and builds the rotary table from the whole (frames, height, width) grid), and the video rotary table at every
  fused block's input (the forward hands each block the whole table); the last fused block's video output is
  gathered back, so the forward's reshape to the grid and the output layer see the whole clip;
- only the video self-attention runs the Ulysses all-to-all (N must divide its heads and the clip's tokens). Every
  other attention runs on keys this rank holds whole, which is exact because an attention's queries are independent
  of each other: the text blocks and the sound's own attentions run whole on every rank (the caption, 1024 tokens,
  and the sound, 217 for 121 frames, are small beside the clip's tens of thousands, and keeping them whole sets N
  no rule on model.max_sequence_length or the sound's length), the video's cross-attention to the caption and to the
  sound take this rank's video queries against the whole keys;
- the sound's cross-attention to the video gathers the video's keys and their rotary table
  (dstune.families.ulysses.gathered_over_group): every rank's whole sound reads every video token, and in backward
  each rank's gradient of the gathered tokens is summed over the group before the rank keeps its share;
- what runs whole on every rank after the split feeds the loss N times over: the video's output layer after the
  gather and the whole sound stream, whose parameters' gradients the group then sums. The transformer's outputs
  carry their gradient divided by N into the model (their values unchanged, `shared_gradient`), and the last
  block's gather sums its gradient over the group (as the sound's does), so a step's gradient is one rank's: each
  rank's gradient of a quantity every rank holds whole is its share, the group's sum the whole.

Image-to-video's reference frame (appended after the clip's frames, its token types and rotary positions given to
the forward) is patched into the same tokens before the split, so it splits with them: N divides the clip's tokens
with that frame. Samples (no gradients) run the pipeline's joint video and sound the same way.
"""

from __future__ import annotations

import torch

from dstune.families.ulysses import gathered_over_group

PROCESSOR_CLASS = "Kandinsky6AttnProcessor"
BLOCKS = "visual_transformer_blocks"  # the fused video/sound blocks
VIDEO_SELF_ATTENTION = "video_dec_block.self_attention"  # the one attention that runs the all-to-all
SOUND_QUERIES_VIDEO_KEYS = "av_cross_attention"  # the whole sound's queries against the gathered video
VIDEO, VIDEO_TABLE = 0, 5  # a fused block's positional arguments: vis, aud, text_v, text_a, time_embed, vis_rope, ...


def _split_block_inputs(transformer, first: bool):
    """A forward pre-hook on a fused block: this rank's share of the video tokens (B, tokens, width), at the first
    block only (the later ones get the previous block's share), and of the video rotary table (tokens, 1, D / 2, 2,
    2), which the forward hands every block whole."""

    def split(module, args):
        group = _group(transformer)
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        args = list(args)
        for index in (VIDEO, VIDEO_TABLE) if first else (VIDEO_TABLE,):
            dim = 1 if index == VIDEO else 0
            if args[index].shape[dim] % size:
                raise ValueError(
                    f"Kandinsky 6's sequence split: {args[index].shape[dim]} video tokens do not divide into "
                    f"{size} ranks (validate checks the clips' tokens: deepspeed.sequence_parallel_size)"
                )
            args[index] = args[index].chunk(size, dim=dim)[rank]
        return tuple(args)

    return split


def _group(transformer):
    """This rank's sequence group, as the split (dstune.families.ulysses) configured the transformer."""
    return transformer._parallel_config.context_parallel_config._flattened_mesh.get_group()


class _SharedGradient(torch.autograd.Function):
    """The identity whose backward divides the gradient by the group's size."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None


def shared_gradient(tensor, size: int):
    """`tensor` (a whole output every rank of the group computes) unchanged, its gradient divided by `size`: every
    rank's loss reads it, and the group sums the gradients (the module docstring's last point)."""
    return tensor if tensor is None or not tensor.requires_grad else _SharedGradient.apply(tensor, size)


class WholeKeysAttention:
    """A Kandinsky 6 attention whose keys every rank holds whole (the caption, the sound) or gathers whole (the
    video's, for the sound's queries): the stock processor without the all-to-all. `_parallel_config` is set by the
    split (dstune.families.ulysses) and read here for the sequence group only, never handed to the attention."""

    _parallel_config = None

    def __init__(self, stock, gathers_video: bool = False):
        self.stock = stock  # its own _parallel_config stays None: no all-to-all
        self.gathers_video = gathers_video

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None, attn_mask=None
    ):
        if self.gathers_video and self._parallel_config is not None:
            group = self._parallel_config.context_parallel_config._flattened_mesh.get_group()
            encoder_hidden_states = gathered_over_group(encoder_hidden_states, group)
            if rotary_emb_kv is not None:  # ca_rope: the video keys' rotary table, split with them
                rotary_emb_kv = gathered_over_group(rotary_emb_kv, group, dim=0)
        return self.stock(
            attn,
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            rotary_emb=rotary_emb,
            rotary_emb_kv=rotary_emb_kv,
            attn_mask=attn_mask,
        )


def _gather_video_output(transformer):
    """A forward hook on the last fused block: its video tokens (this rank's share) gathered whole, the sound (or
    None) as it is."""

    def gather(module, args, output):
        video, sound = output
        return gathered_over_group(video, _group(transformer)), sound

    return gather


def _shared_outputs(size: int):
    """A forward hook on the transformer: its video and sound outputs with their gradients divided by `size`."""

    def share(module, args, kwargs, output):
        if isinstance(output, tuple):
            return tuple(shared_gradient(tensor, size) for tensor in output)
        output.sample = shared_gradient(output.sample, size)
        output.audio_sample = shared_gradient(output.audio_sample, size)
        return output

    return share


def prepare_split(transformer, size: int) -> dict:
    """Make `transformer` (a Kandinsky6Transformer3DModel, PEFT-wrapped or not) splittable over `size` ranks: every
    attention but the video self-attention on whole keys, the last block's video gathered, the outputs' gradients
    shared; returns the plan to apply."""
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if type(processor).__name__ != PROCESSOR_CLASS or name.endswith(VIDEO_SELF_ATTENTION):
            continue
        module.set_processor(WholeKeysAttention(processor, name.endswith(SOUND_QUERIES_VIDEO_KEYS)))
    blocks = getattr(transformer, BLOCKS)
    for number, block in enumerate(blocks):
        block.register_forward_pre_hook(_split_block_inputs(transformer, first=number == 0))
    blocks[-1].register_forward_hook(_gather_video_output(transformer))
    transformer.register_forward_hook(_shared_outputs(size), with_kwargs=True)
    return {}  # every split and gather is a hook above: nothing for diffusers' hooks to apply

"""Text encoders run lean: the pipelines call a causal LM or vision-language model for its hidden states only, with
output_hidden_states=True (every layer's output kept until the call returns) on a class whose forward also
computes the LM head's logits over the whole vocabulary (152,064 entries for Qwen2.5-VL, 262,208 for Gemma 3:
more than a caption's hidden states many times over). A forward pre-hook on each text encoder changes the call,
not the pipeline's code:

- `output_hidden_states=True` becomes the list of indices the pipeline reads (the card's
  hidden_states_read; transformers then keeps those and None in the other places, the tuple as long as before);
- `logits_to_keep=1` where the forward takes it: the head runs on the last position only;
- `use_cache=False` where the forward takes it and the caller did not say: no key/value cache of every layer for a
  generation that never follows.

The hidden states are those of the same forward pass, so the embeddings are bit for bit the same
(tests/unit/test_lean_text.py checks it through every flow and video model's own text path).
"""

from __future__ import annotations

import inspect
from typing import Optional


def lean_kwargs(encoder, kwargs: dict, hidden_states: Optional[tuple[int, ...]]) -> dict:
    """The call's keyword arguments, lean: the hidden states read (where the caller asked for all of them), the
    logits of one position (where the class computes any), no key/value cache."""
    lean = dict(kwargs)
    if hidden_states is not None and lean.get("output_hidden_states") is True:
        lean["output_hidden_states"] = list(hidden_states)
    parameters = inspect.signature(encoder.forward).parameters
    if "logits_to_keep" not in lean and "logits_to_keep" in parameters:
        lean["logits_to_keep"] = 1
    if "use_cache" not in lean and ("use_cache" in parameters or (_passes_on(parameters) and _caches(encoder))):
        lean["use_cache"] = False
    return lean


def _passes_on(parameters) -> bool:
    """A forward that hands its other keyword arguments to its language model (Qwen3VLModel's)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _caches(encoder) -> bool:
    """Whether the encoder's language model builds a key/value cache unless told not to."""
    config = getattr(encoder, "config", None)
    text = getattr(config, "text_config", None) or config
    return bool(getattr(text, "use_cache", False))


def make_lean(encoders: dict, hidden_states: dict) -> None:
    """Each text encoder (name -> module or None) runs lean from now on; `hidden_states`: name -> the indices its
    pipeline reads (a name not in it keeps every hidden state it is asked for). The hook's handle is the module's
    `dstune_lean` (removing it gives the plain calls back)."""
    for name, encoder in encoders.items():
        if encoder is None or getattr(encoder, "dstune_lean", None) is not None:
            continue
        reads = hidden_states.get(name)

        def pre_hook(module, args, kwargs, _reads=reads):
            return args, lean_kwargs(module, kwargs, _reads)

        encoder.dstune_lean = encoder.register_forward_pre_hook(pre_hook, with_kwargs=True)

"""Encoded caches, one package: entries and their keys (entries), how ranks share a folder (share), the latent and
text-embedding cache (latents), the codec-token cache (codec_tokens), and the datasets that read them (datasets).
dstune.startup decides once whether a run uses a cache and which; training and `dstune cache` both go through it."""

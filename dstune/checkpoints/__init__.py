"""Checkpoints and resuming a run from one:

- `store`: writing a checkpoint (DeepSpeed's shards, dstune's state and RNG files), the atomic "latest", listing,
  pruning and loading one into an engine;
- `resume_plan`: what a resume on this launch's world keeps, refuses or changes (torch-free: `dstune validate
  --resume-from` asks it too);
- `reshard`: re-partitioning a checkpoint's ZeRO state for another number of ranks (DeepSpeed's universal
  checkpoint converter).

This file imports nothing, so the torch-free modules stay importable without torch.
"""

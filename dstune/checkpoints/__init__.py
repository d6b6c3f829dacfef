"""Checkpoints and resuming a run from one:

- `layout`: the checkpoint folder read as files: which is "latest", the complete ones, dstune's state (torch-free);
- `store`: writing a checkpoint (DeepSpeed's shards, dstune's state and RNG files), the atomic "latest", pruning and
  loading one into an engine;
- `resume_plan`: what a resume on this launch's world keeps, refuses or changes (torch-free: `dstune validate
  --resume-from` asks it too);
- `reshard`: re-partitioning a checkpoint's ZeRO state for another number of ranks (DeepSpeed's universal
  checkpoint converter);
- `resume`: `--resume` as training.py runs it, stage by stage.

This file imports nothing, so the torch-free modules stay importable without torch.
"""

"""The DeepSpeed JSON of a run, in the order the steps run:

    spec, source, notes = apply_ds_file(spec, source)     # fill_spec: the user's deepspeed.config fills unset keys
    ds_config, warnings = compile_ds_config(train, deepspeed, plan, source)   # blocks (+ merge of the user's file)
    errors = cross_check(ds_config, plan, source, user_file)                  # DeepSpeed's own config code, offline

`user_file` reads the user's file; `merge` holds what dstune owns in it and how it is merged after compiling.
Nothing here imports torch or deepspeed at module level.
"""

from dstune.ds_json.blocks import compile_ds_config
from dstune.ds_json.cross_check import cross_check
from dstune.ds_json.fill_spec import apply_ds_file

__all__ = ["apply_ds_file", "compile_ds_config", "cross_check"]

"""The memory plan of a run and its measurement:

- `plan`: bytes per GPU and per node from parameter counts and a setup (torch-free arithmetic);
- `activations`: the generic per-sample activation formulas the families' facts apply to their configs;
- `counts`: a model's config files and its components' parameter counts (stored table or the meta device);
- `record`: the peak memory each phase of a real run measured, beside the prediction (memory.json).

Which components a run holds and their activations are each family's own (dstune.families.<family>_facts).
"""

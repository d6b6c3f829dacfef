"""The spec layer: the YAML spec as frozen pydantic models (dstune.spec.models), its loading (dstune.spec.load) and
its sections. Imports neither torch nor deepspeed. Importing this package imports none of its modules, so that a
section module (section, model_sections, a unit's own family section) can be imported on its own: the union of model
sections in dstune.spec.models reads those modules in turn."""

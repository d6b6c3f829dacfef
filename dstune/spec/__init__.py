"""The spec layer: models and loading. Imports neither torch nor deepspeed."""

from dstune.spec.load import SpecError, SpecIssue, SpecSource, load_spec, parse_override
from dstune.spec.models import ADAFACTOR_STYLE, FAMILIES, Spec

__all__ = ["ADAFACTOR_STYLE", "FAMILIES", "Spec", "SpecError", "SpecIssue", "SpecSource", "load_spec", "parse_override"]

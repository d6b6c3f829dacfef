"""The models dstune trains, one folder (a unit) per model or model group; `dstune.models.registry` lists them.

Imports nothing, so that importing one unit's torch-free module (its facts, its spec data) stays torch-free.
"""

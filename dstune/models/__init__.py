"""The models dstune trains, one folder (a unit) per model or model group, each a card and a class; `dstune.registry`
lists the cards.

Imports nothing, so that importing one unit's torch-free module (its card, its spec section) stays torch-free.
"""

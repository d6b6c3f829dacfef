"""What the spec's YAML says that the loaded values no longer show (torch-free; dstune.spec.load reports it).

    split_prompt_lists(node) -> [(dotted key, line, message)]

A prompt list written in flow style, `prompts: [a cat, sitting, a dog]`, is split by YAML at every comma of its
unquoted items, so a prompt that holds a comma silently becomes two or more. Only the node says the list was written
that way; an item so short that it looks like a fragment of a prompt makes it likely that this happened.
"""

from __future__ import annotations

import yaml

FRAGMENT_WORDS = 2  # an unquoted item this short (words) is likely part of a prompt cut at a comma


def split_prompt_lists(node: yaml.Node) -> list[tuple[str, int, str]]:
    """(key, 1-based line, warning) for each flow-style prompt list (keys ending in `prompts`) of unquoted items
    only, where one item looks like a fragment."""
    found: list[tuple[str, int, str]] = []

    def walk(n: yaml.Node, key: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                walk(value_node, f"{key}.{key_node.value}" if key else str(key_node.value))
            return
        if not (isinstance(n, yaml.SequenceNode) and n.flow_style and key.endswith("prompts") and len(n.value) > 1):
            return
        if not all(isinstance(item, yaml.ScalarNode) for item in n.value):
            return
        if any(item.style for item in n.value):  # a quoted item: the writer knows how commas read (plain: "" or None)
            return
        if not any(len(item.value.split()) <= FRAGMENT_WORDS for item in n.value):
            return
        read = " | ".join(item.value for item in n.value)
        joined = f"{n.value[0].value}, {n.value[1].value}"
        found.append(
            (
                key,
                n.start_mark.line + 1,
                (
                    f"a flow-style list ([...]) of unquoted text is split at every comma: YAML reads {len(n.value)} prompts "
                    f"here ({read}). If a prompt holds a comma, write the list in block style, one prompt per line "
                    f'(`- {joined}` under `{key.rsplit(".", 1)[-1]}:`), or quote each prompt ("{joined}"); if these are '
                    "the prompts you meant, quote them to say so"
                ),
            )
        )

    walk(node, "")
    return found

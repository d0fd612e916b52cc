"""Tags in streamed text (the reasoning split's <think>, tool calls' <tool_call>): text that may be
the start of a tag is held back until the next piece decides it."""

from __future__ import annotations


def tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none); text
    ending with the whole tag is not counted (callers look for the whole tag first)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

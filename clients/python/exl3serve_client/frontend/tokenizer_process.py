"""The front end's tokenizer process: long prompt texts are tokenized there, not in the front end's
own process (docs/frontend.md, "Limits on a request").

Tokenizing megabytes takes seconds of a core. On the event loop it stalled every other request (a
5 MB prompt: no SSE event anywhere for 4 s); on a thread of the same process, one that lets go of
the GIL, the loop still lost up to a second at a time while it ran (measured in the real front
end on the shared 2-core machine: 7-10 stalls over 50 ms per 5 MB prompt, 1.3-2.5 s in all,
against 2-3 stalls, 0.2-1.1 s, with the same tokenizing in another process). A process of its own,
at the lowest CPU priority, leaves the loop, and the engine on the same host, their cores.

One process per front-end process, started (spawn: the front end's gRPC threads make fork unsafe)
before the front end serves; it loads the model directory's tokenizer once and dies with its
parent. Starting it costs a second or two of a core (Python, the tokenizer's imports and files) at
normal priority: paid by the first long prompt, that stalled the requests beside it on a 2-core
machine. Long prompts queue for it, so tokenizing takes at most one core. If it dies (a prompt that
exhausted its memory), that prompt is answered 500 and the next one starts a new process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Optional

from .text import ModelTokenizer
from .workers import exit_with_parent

# In the tokenizer process: the model directory's tokenizer (_start loads it).
_tokenizer: Optional[ModelTokenizer] = None


def _start(model_dir: str, parent_pid: int) -> None:
    """The tokenizer process's start: it dies with the front end, leaves a terminal's Ctrl-C to the
    front end (whose shutdown ends it), runs at the lowest CPU priority, loads the tokenizer."""
    global _tokenizer
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(19)
    _tokenizer = ModelTokenizer(model_dir)


def _started() -> bool:
    return _tokenizer is not None


def _encode(text: str, limit: int, add_special_tokens: bool) -> tuple[int, Optional[bytes]]:
    """In the tokenizer process: the text's token count, and its ids if fewer than limit (as int32
    bytes: a million ids cross the pipe as 4 MB, not a million pickled ints)."""
    assert _tokenizer is not None, "the tokenizer process was not started by _start"
    n, ids = _tokenizer.encode_off_loop(text, limit, add_special_tokens)
    return n, (None if ids is None else array("i", ids).tobytes())


class TokenizerProcessDied(RuntimeError):
    """The tokenizer process died while it tokenized a prompt."""


class TokenizerProcess:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._pool: Optional[ProcessPoolExecutor] = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start, initargs=(str(self.model_dir), os.getpid()))
        return self._pool

    async def start(self) -> None:
        """Starts the process and waits until its tokenizer is loaded."""
        await asyncio.get_running_loop().run_in_executor(self._executor(), _started)

    async def encode(self, text: str, limit: int,
                     add_special_tokens: bool) -> tuple[int, Optional[list[int]]]:
        """The text's token count, and its ids if fewer than limit (none made of a longer one)."""
        loop = asyncio.get_running_loop()
        try:
            n, raw = await loop.run_in_executor(self._executor(), _encode, text, limit,
                                                add_special_tokens)
        except BrokenProcessPool:
            self.close()  # the next prompt starts a new process
            raise TokenizerProcessDied("the tokenizer process died while it tokenized the "
                                       "prompt (out of memory?)") from None
        return n, (None if raw is None else array("i", raw).tolist())

    def close(self) -> None:
        """Ends the process (if started); prompts still queued for it fail."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

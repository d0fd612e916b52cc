"""The front end's tokenizer process (frontend/tokenizer_process.py), which tokenizes long prompts
off the front end's process: the same ids as the tokenizer in the front end, none made past the
limit, a process that died answered as such and replaced by the next prompt."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest

from exl3serve_client.frontend.text import ModelTokenizer
from exl3serve_client.frontend.tokenizer_process import TokenizerProcess, TokenizerProcessDied
from test_text import _model_dir

LONG = ("The quick brown fox jumps over the lazy dog. " * 3000)[:100_000]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("tp"), "qwen3_moe")


def test_same_ids_as_the_front_ends_tokenizer(model):
    tok = ModelTokenizer(model)

    async def run():
        tp = TokenizerProcess(model)
        try:
            out = []
            for text in (LONG, "日本語のテキスト " * 5000, "<|im_start|>user\nhi<|im_end|>" * 100):
                for special in (True, False):
                    want = tok.encode(text, add_special_tokens=special)
                    out.append((await tp.encode(text, len(want) + 1, special), want))
                    assert await tp.encode(text, len(want), special) == (len(want), None)
            return out
        finally:
            tp.close()
    for got, want in asyncio.run(run()):
        assert got == (len(want), want)


def test_a_dead_process_is_replaced(model):
    async def run():
        tp = TokenizerProcess(model)
        others = {p.pid for p in multiprocessing.active_children()}  # earlier tests' leaving
        try:
            n, _ = await tp.encode(LONG, 10, True)
            (child,) = [p for p in multiprocessing.active_children() if p.pid not in others]
            assert os.getpriority(os.PRIO_PROCESS, child.pid) == 19  # it yields its core
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
            with pytest.raises(TokenizerProcessDied):
                await tp.encode(LONG, 10, True)
            assert (await tp.encode(LONG, 10, True))[0] == n  # a new process
        finally:
            tp.close()
    asyncio.run(run())

"""The package's tokenizer and chat code against what transformers recorded on the same files
(tests/fixtures/tokenizer, written by scripts/conformance/tokenizer_fixtures.py), without
transformers: token ids, decodes and incremental detokenization of a few hundred strings, and
apply_chat_template's renderings and ids. And exl3serve-make-tokenizer still writes those files
byte for byte, so that the fixtures speak for the tokenizers test models get today."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from exl3serve_client.frontend.text import ModelTokenizer
from exl3serve_client.frontend.tool_calls import template_tool_call_format
from exl3serve_client.make_tokenizer import FAMILIES, write_tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def test_every_family_has_a_fixture():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == \
        sorted({f.name for f in FAMILIES.values()})


@pytest.fixture(scope="module", params=sorted({f.name for f in FAMILIES.values()}))
def fixture(request):
    d = FIXTURES / request.param
    return d, json.loads((d / "expected.json").read_text()), ModelTokenizer(d)


def test_fixture_is_what_it_claims(fixture):
    """The expectations were recorded on these very files, and cover what they must."""
    d, exp, _ = fixture
    assert exp["family"] == d.name
    for name in TOKENIZER_FILES:
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == exp["sha256"][name], name
    texts = [c["text"] for c in exp["strings"]]
    assert len(texts) >= 300 and len(set(texts)) == len(texts)
    assert "" in texts
    specials = FAMILIES[json.loads((d / "config.json").read_text())["architectures"][0]].specials
    for s in specials:
        assert any(s in t and t != s for t in texts), s
    gens = {(c["name"], c["add_generation_prompt"]) for c in exp["chats"]}
    assert {g for _, g in gens} == {True, False}
    assert any(m["role"] == "assistant" for c in exp["chats"] for m in c["messages"])
    if template_tool_call_format(tok_config_template(d)) is not None:  # it renders tool calls
        assert {m["role"] for c in exp["chats"] for m in c["messages"]} >= {"tool", "developer"}
        assert any("tool_calls" in m for c in exp["chats"] for m in c["messages"])
    if "thinking" in (tok_config_template(d) or ""):  # it has thinking modes (DeepSeek-V4's)
        kwargs = [c["kwargs"] for c in exp["chats"] if "kwargs" in c]
        assert {} in kwargs and {"thinking": False} in kwargs and {"enable_thinking": True} in kwargs
        assert any("reasoning_content" in m for c in exp["chats"] for m in c["messages"])


def tok_config_template(d):
    return json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")


def test_make_tokenizer_still_writes_the_fixture(fixture, tmp_path):
    d, _, _ = fixture
    for name in ("config.json", "generation_config.json"):
        shutil.copy(d / name, tmp_path / name)
    write_tokenizer(tmp_path)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (d / name).read_bytes(), \
            f"{name} of {d.name} changed: run scripts/conformance/tokenizer_fixtures.py " \
            "(tests/fixtures/tokenizer/README.md)"


def _mismatches(cases, got, want_key):
    return [(c["text"], g, c[want_key]) for c, g in zip(cases, got) if g != c[want_key]]


def test_token_ids_equal_transformers(fixture):
    _, exp, tok = fixture
    cases = exp["strings"]
    assert _mismatches(cases, [tok.encode(c["text"]) for c in cases], "ids") == []
    assert _mismatches(cases, [tok.encode(c["text"], add_special_tokens=False) for c in cases],
                       "ids_no_special") == []


def test_decode_equals_transformers(fixture):
    _, exp, tok = fixture
    cases = exp["strings"]
    assert _mismatches(cases, [tok.decode(c["ids"], skip_special_tokens=False) for c in cases],
                       "decode") == []
    assert _mismatches(cases, [tok.decode(c["ids"]) for c in cases], "decode_skip_special") == []


def test_streamed_text_equals_transformers_decode(fixture):
    """Token by token through the front end's detokenizer, the pieces join to transformers'
    decode (special tokens skipped, as the front end sends text)."""
    _, exp, tok = fixture
    got = []
    for c in exp["strings"]:
        d = tok.detokenizer()
        got.append("".join([d.add([i]) for i in c["ids"]] + [d.finish()]))
    assert _mismatches(exp["strings"], got, "decode_skip_special") == []


def test_chat_rendering_equals_apply_chat_template(fixture):
    _, exp, tok = fixture
    for c in exp["chats"]:
        what = (c["name"], c["add_generation_prompt"], c.get("kwargs"))
        tools = c.get("tools")  # the tool conversations (the templates that render calls)
        kwargs = c.get("kwargs", {})  # the thinking modes' (the templates that read them)
        assert tok.render_chat(c["messages"], c["add_generation_prompt"], tools=tools,
                               **kwargs) == c["text"], what
        assert tok.encode_chat(c["messages"], c["add_generation_prompt"], tools=tools,
                               **kwargs) == c["ids"], what


def test_fixture_equals_transformers_today(fixture):
    """Where transformers is installed: recording again with the fixture script gives the
    committed expectations (skipped in CI, which has no transformers)."""
    pytest.importorskip("transformers")
    import importlib.util
    path = FIXTURES.parents[2] / "scripts/conformance/tokenizer_fixtures.py"
    spec = importlib.util.spec_from_file_location("tokenizer_fixtures", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    d, exp, _ = fixture
    now = script.record(d, d.name, exp["sha256"])
    assert now["strings"] == exp["strings"]
    assert now["chats"] == exp["chats"]

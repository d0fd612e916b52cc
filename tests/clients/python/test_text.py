"""Tokenizers of test models, chat templates, incremental detokenization and stop strings, without
servers; and the package itself (version, stubs in step with the proto)."""

from __future__ import annotations

import filecmp
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import exl3serve_client
from exl3serve_client.frontend.text import ModelTokenizer, StopMatcher
from exl3serve_client.make_tokenizer import FAMILIES, write_tokenizer

ROOT = Path(__file__).resolve().parents[3]

ARCHS = {f.name: arch for arch, f in FAMILIES.items()}

# Strings of the kinds the tokenizer must round-trip: Unicode, emoji, runs of whitespace, special
# tokens written in text.
SAMPLES = [
    "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\n\n\n", "a" * 300,
    "naïve café — déjà vu", "日本語のテキスト", "😀👍🏽🇫🇷❤️‍🔥", "mixed 123 4.56e7 -0x1F",
    "\u00a0non-breaking\u2009thin", "    code:\n        return x * 2\n", "", " ", "\n",
    "<|user|> written in text", "<|im_start|>user\nhi<|im_end|>", "[INST] x [/INST]</s>",
    "<｜User｜>question<｜Assistant｜>", "\u200bzero\u200dwidth", "Ωμέγα", "emoji 🧪🧪🧪 run",
]


def _samples(n: int = 300) -> list[str]:
    rng = random.Random(7)
    alphabet = "abc XYZ 0123 \n\t é ß ж 中 文 😀 🚀 👍🏽 <|>[]{} \u00a0\u200d"
    out = list(SAMPLES)
    while len(out) < n:
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    return out


def _model_dir(tmp: Path, family: str, vocab: int = 512) -> Path:
    d = tmp / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [ARCHS[family]],
                                               "vocab_size": vocab,
                                               "max_position_embeddings": 4096}))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module", params=sorted(ARCHS))
def family_dir(request, tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("tok"), request.param)


def test_package_version():
    """The package's version is the project's (CMakeLists.txt's project VERSION), in its metadata
    (pyproject.toml) and its module alike."""
    from importlib.metadata import version
    project = re.search(r"^project\(exl3serve VERSION ([0-9.]+)",
                        (ROOT / "CMakeLists.txt").read_text(), re.M)
    assert project, "CMakeLists.txt names no project VERSION"
    assert exl3serve_client.__version__ == project.group(1)
    assert version("exl3serve") == project.group(1)
    pyproject = re.search(r'^version = "([0-9.]+)"',
                          (ROOT / "clients/python/pyproject.toml").read_text(), re.M)
    assert pyproject and pyproject.group(1) == project.group(1)


def test_type_hints_hold(tmp_path):
    """The package's type hints are checked: mypy (pinned in scripts/checks/frontend/requirements.txt)
    over its sources with clients/python/pyproject.toml's [tool.mypy] finds nothing."""
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml",
                        "--cache-dir", str(tmp_path / "mypy-cache")], cwd=ROOT / "clients/python",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no issues found" in r.stdout


def test_stubs_in_step_with_proto(tmp_path):
    """The stubs shipped in exl3serve/v1 are what clients/python/generate_stubs.sh makes of the proto."""
    if not shutil.which("grpc_python_plugin") or not shutil.which("protoc"):
        pytest.skip("protoc / grpc_python_plugin not installed (scripts/install-deps.sh)")
    subprocess.run([str(ROOT / "clients/python/generate_stubs.sh"), str(tmp_path)], check=True,
                   timeout=60)
    for name in ("exl3serve_pb2.py", "exl3serve_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "exl3serve/v1" / name,
                           ROOT / "clients/python/exl3serve/v1" / name, shallow=False), name


def test_type_stub_names_every_message():
    """exl3serve_pb2.pyi (the stubs' type hints, which mypy reads: Debian's protoc writes them in
    another layout, so they are kept by hand) has a class for every message of the proto."""
    from exl3serve.v1 import exl3serve_pb2 as pb
    pyi = (ROOT / "clients/python/exl3serve/v1/exl3serve_pb2.pyi").read_text()
    stubbed = set(re.findall(r"(?m)^class (\w+)\(_message\.Message\):", pyi))
    assert set(pb.DESCRIPTOR.message_types_by_name) - stubbed == set()


def test_vocab_and_special_tokens(family_dir):
    tok = ModelTokenizer(family_dir)
    family = FAMILIES[ARCHS[family_dir.name]]
    assert tok.vocab_size == 512
    assert tok.tokenizer.id_to_token(0) == family.specials[0]
    assert tok.tokenizer.id_to_token(1) == family.specials[1]
    for s in family.specials:
        assert tok.tokenizer.token_to_id(s) < len(family.specials)


def test_round_trip(family_dir):
    tok = ModelTokenizer(family_dir)
    for s in _samples():
        ids = tok.encode(s, add_special_tokens=False)
        assert all(0 <= i < 512 for i in ids)
        assert tok.tokenizer.decode(ids, skip_special_tokens=False) == s


def test_incremental_detokenization_equals_decode(family_dir):
    """Pieces joined equal decode of the whole output, for any split of random token ids (random
    ids are what a random model emits: broken UTF-8 included), and no piece ends in a character
    that later bytes would change."""
    tok = ModelTokenizer(family_dir)
    rng = random.Random(3)
    for _ in range(1500):
        ids = [rng.randrange(512) for _ in range(rng.randint(1, 50))]
        d = tok.detokenizer()
        pieces, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            pieces.append(d.add(ids[i:i + k]))
            i += k
        pieces.append(d.finish())
        assert "".join(pieces) == tok.decode(ids), ids


def test_multibyte_character_held_until_complete(family_dir):
    tok = ModelTokenizer(family_dir)
    ids = tok.encode("🚀ok", add_special_tokens=False)
    d = tok.detokenizer()
    pieces = [d.add([i]) for i in ids] + [d.finish()]
    assert "".join(pieces) == "🚀ok"
    assert all("\ufffd" not in p for p in pieces)


# Texts a normalizer of Unicode's forms shortens (in UTF-8): mathematical A (4 bytes) and the
# ligature fi (NFKC: "A", "fi"), KELVIN SIGN (NFC: K), Hangul jamo composing into one syllable.
SHRINKING = ["\U0001d400" * 20_000, "\ufb01" * 20_000, "\u212a" * 20_000,
             "\u1100\u1161\u11a8" * 10_000]


def test_min_token_count_is_a_lower_bound(family_dir):
    """min_token_count, the bound the front end refuses a long prompt by untokenized, never
    exceeds the tokens encode gives (special tokens written in the text included), and is of use
    on a long text."""
    tok = ModelTokenizer(family_dir)
    specials = "".join(FAMILIES[ARCHS[family_dir.name]].specials)
    for s in _samples() + SHRINKING + [specials * 2000, " " * 100_000, "😀" * 50_000]:
        for special in (True, False):
            assert tok.min_token_count(s) <= len(tok.encode(s, add_special_tokens=special)), s[:40]
    assert tok.min_token_count("x" * 1_000_000) >= 4096


def _with_tokenizer_json(d: Path, **fields) -> ModelTokenizer:
    spec = json.loads((d / "tokenizer.json").read_text())
    spec.update(fields)
    (d / "tokenizer.json").write_text(json.dumps(spec))
    return ModelTokenizer(d)


@pytest.mark.parametrize("normalizer,bounded", [
    ({"type": "NFKC"}, True),
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFKD"}]}, True),
    ({"type": "Sequence", "normalizers": []}, True),
    ({"type": "Lowercase"}, False),  # KELVIN SIGN (3 bytes) becomes "k"
    ({"type": "Strip", "strip_left": True, "strip_right": True}, False),
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}, False),
])
def test_min_token_count_under_normalizers(tmp_path, normalizer, bounded):
    """Under a normalizer of Unicode's forms the bound allows for the text they shorten; under one
    that may remove any amount of text there is none (0)."""
    tok = _with_tokenizer_json(_model_dir(tmp_path, "qwen3_moe"), normalizer=normalizer)
    for s in _samples() + SHRINKING:
        assert tok.min_token_count(s) <= len(tok.encode(s)), s[:40]
    assert (tok.min_token_count("x" * 1_000_000) > 0) == bounded


def test_min_token_count_needs_every_byte_kept(tmp_path):
    """A pre-tokenizer that drops what it matches (Split, behavior Removed) allows no bound."""
    d = _model_dir(tmp_path, "qwen3_moe")
    byte_level = json.loads((d / "tokenizer.json").read_text())["pre_tokenizer"]
    drop_spaces = {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed",
                   "invert": False}
    tok = _with_tokenizer_json(d, pre_tokenizer={"type": "Sequence",
                                                 "pretokenizers": [drop_spaces, byte_level]})
    assert len(tok.encode(" " * 1000)) <= 1
    assert tok.min_token_count(" " * 1_000_000) == 0


def test_encode_off_loop_equals_encode(family_dir):
    """encode_off_loop: encode's count, and its ids below the limit only."""
    tok = ModelTokenizer(family_dir)
    for s in _samples(80) + ["a long text, " * 5000]:
        for special in (True, False):
            ids = tok.encode(s, add_special_tokens=special)
            assert tok.encode_off_loop(s, len(ids) + 1, special) == (len(ids), ids), s[:40]
            assert tok.encode_off_loop(s, len(ids), special) == (len(ids), None), s[:40]


EXPECTED_CHAT = {
    "glm4_moe": "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi there<|assistant|>\nHello!"
                "<|user|>\nAnd now?<|assistant|>\n",
    "qwen3_moe": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                 "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
                 "<|im_start|>assistant\n",
    "mixtral": "<s>Be brief.\n\n[INST] Hi there [/INST]Hello!</s>[INST] And now? [/INST]",
    "deepseek_v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi there<｜Assistant｜>Hello!"
                   "<｜end▁of▁sentence｜><｜User｜>And now?<｜Assistant｜>",
    # DeepSeek-V4's encoding in thinking mode (the test template's default, as vLLM's): the last
    # turn opens the reasoning with <think>; the earlier turn's reasoning is dropped (</think>).
    "deepseek_v4": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi there<｜Assistant｜></think>Hello!"
                   "<｜end▁of▁sentence｜><｜User｜>And now?<｜Assistant｜><think>",
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And now?"}]


def test_chat_template_rendering(family_dir):
    tok = ModelTokenizer(family_dir)
    assert tok.render_chat(CHAT) == EXPECTED_CHAT[family_dir.name]
    ids = tok.encode_chat(CHAT)
    assert ids == tok.encode(EXPECTED_CHAT[family_dir.name], add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED_CHAT[family_dir.name]


def test_chat_template_refuses_unknown_role(family_dir):
    from exl3serve_client.frontend.text import ChatTemplateError
    with pytest.raises(ChatTemplateError):
        ModelTokenizer(family_dir).render_chat([{"role": "wizard", "content": "x"}])


def test_transformers_environment_features(tmp_path):
    """The template environment is transformers': trim_blocks/lstrip_blocks, loopcontrols,
    tojson without ASCII escapes, the generation tag."""
    d = _model_dir(tmp_path, "qwen3_moe")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = ModelTokenizer(d).render_chat([{"role": "user", "content": "é"}] * 3)
    assert out == '{"role": "user", "content": "é"}' * 2


def test_same_as_transformers(family_dir):
    """Tokenization and chat rendering equal transformers' AutoTokenizer on the same files."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(family_dir))
    tok = ModelTokenizer(family_dir)
    for s in _samples():
        assert hf(s)["input_ids"] == tok.encode(s), s
        ids = tok.encode(s, add_special_tokens=False)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), s
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        tok.render_chat(CHAT)
    rendered = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    assert list(rendered) == tok.encode_chat(CHAT)


@pytest.mark.parametrize("stops,pieces,want,stopped", [
    (["STOP"], ["ab", "cS", "TO", "Pz"], "abc", True),
    (["STOP"], ["ab", "cS", "TO", "x"], "abcSTOx", False),
    (["\n\n", "END"], ["line\n", "\nnext"], "line", True),
    (["xy", "abc"], ["zab", "cxy"], "z", True),         # the earlier match wins
    ([], ["a", "b"], "ab", False),
    (["é!"], ["caf", "é", "!", "more"], "caf", True),
])
def test_stop_strings_across_pieces(stops, pieces, want, stopped):
    m = StopMatcher(stops)
    out = "".join(m.push(p, final=(i == len(pieces) - 1)) for i, p in enumerate(pieces))
    assert out == want
    assert m.stopped == stopped


def _openai_choice(chat, text, logprobs, finish, *, delta, first=False):
    """One choice of OpenAI's answer objects, as dicts (the reference the renderer is held to)."""
    choice = {"index": 0}
    if chat and delta:
        choice["delta"] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish
    return choice


def _openai_envelope(req, choices, chunk):
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else \
        "text_completion"
    return {"id": req.rid, "object": obj, "created": req.created, "model": req.model,
            "choices": choices}


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_chunk_renderer_equals_json_dumps(chat, include_usage):
    """The streaming loop's pre-rendered SSE events are byte for byte what json.dumps of the
    answer's objects (OpenAI's, as dicts) gives; and so is the whole answer's body."""
    from exl3serve_client.frontend.protocol import Endpoint, FinishReason
    from exl3serve_client.frontend.render import OpenAIRenderer, dumps as _dumps
    from exl3serve_client.frontend.validation import PreparedRequest
    req = PreparedRequest(endpoint=Endpoint.CHAT_COMPLETIONS if chat else Endpoint.COMPLETIONS,
                          model='mod"el/é ✓', prompts=[[1, 2, 3]], engine_request=None, stops=[],
                          stream=True, include_usage=include_usage, logprobs=None,
                          rid="chatcmpl-ab\\c", created=1764600000)
    out = OpenAIRenderer(req, tok=None)
    extra = {"usage": None} if include_usage else {}

    def ref(choices):
        return "data: " + _dumps({**_openai_envelope(req, choices, True), **extra}) + "\n\n"

    def chat_or_completion_logprobs(entries, offset):
        if entries is None:
            return None
        if chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 for e in entries],
                "text_offset": [offset + sum(len(x["token"]) for x in entries[:i])
                                for i in range(len(entries))]}

    if chat:
        assert out.role_event() == ref([_openai_choice(chat, "", None, None, delta=True,
                                                       first=True)])
    usage = {"prompt_tokens": 3, "completion_tokens": 64, "total_tokens": 67}
    for text in ["hi", "", " \"quoted\" \\ back\nslash\t", "é 中文 😀 \u2028 \x00\x1f", "</s>"]:
        for entries in [None, [], [{"token": "a\"", "logprob": -0.5, "bytes": [97, 34],
                                    "top_logprobs": [{"token": "b", "logprob": -1.25e-07,
                                                      "bytes": [98]}]}]]:
            lp_obj = chat_or_completion_logprobs(entries, 3)
            choice = _openai_choice(chat, text, lp_obj, None, delta=True)
            lp = None if entries is None else out.logprobs(entries, 3)
            assert lp is None or lp == _dumps(lp_obj)
            assert out.text_event(text, lp) == ref([choice]), (text, entries)
            for reason in [None, FinishReason.STOP]:
                whole = {**_openai_envelope(req, [_openai_choice(
                    chat, text, lp_obj, reason and reason.value, delta=False)], False),
                    "usage": usage}
                assert out.whole(text, lp, reason, 64) == _dumps(whole).encode(), (text, entries)
    for reason in [FinishReason.STOP, FinishReason.LENGTH]:
        end = _openai_choice(chat, "", None, reason.value, delta=True)
        if chat:
            end["delta"] = {}
        assert out.finish_event(reason) == ref([end])
    assert out.usage(64) == usage
    assert out.usage_event(64) == "data: " + _dumps({**_openai_envelope(req, [], True),
                                                     "usage": usage}) + "\n\n"


def test_echo_and_prompt_logprobs_rendering_equals_json_dumps():
    """Echo's logprobs (the first prompt token's null), vLLM's prompt_logprobs in a completions
    choice and at a chat answer's top level, and the usage's prompt_tokens_details, byte for byte
    json.dumps of the objects."""
    from exl3serve.v1 import exl3serve_pb2 as pb
    from exl3serve_client.frontend.protocol import Endpoint, FinishReason
    from exl3serve_client.frontend.render import OpenAIRenderer, dumps as _dumps
    from exl3serve_client.frontend.validation import Echo, PreparedRequest
    engine_lp = [pb.GeneratedToken(token_id=7, logprob=-2.5, rank=3,
                                   top_logprobs=[pb.TokenLogprob(token_id=9, logprob=-0.5),
                                                 pb.TokenLogprob(token_id=7, logprob=-2.5)])]
    for chat in (False, True):
        req = PreparedRequest(endpoint=Endpoint.CHAT_COMPLETIONS if chat else Endpoint.COMPLETIONS,
                              model="m", prompts=[[5, 7], [8, 9, 10]], engine_request=None,
                              stops=[], stream=False, include_usage=False, logprobs=1,
                              ids_as_tokens=True, rid="cmpl-1", created=1764600000, n=1,
                              echo=None if chat else Echo(["ab", "cde"]), prompt_logprobs=1,
                              prompt_tokens_details=True)
        out = OpenAIRenderer(req, tok=None)
        lp = None  # echo is completions' only
        if not chat:
            lp = out.logprobs(out.echo_entries([5, 7], engine_lp), 0)
            assert lp == _dumps({"tokens": ["token_id:5", "token_id:7"],
                                 "token_logprobs": [None, -2.5],
                                 "top_logprobs": [None, {"token_id:9": -0.5}],
                                 "text_offset": [0, 10]})
        plp = out.prompt_logprobs(engine_lp)
        plp_obj = [None, {"7": {"logprob": -2.5, "rank": 3, "decoded_token": "token_id:7"},
                          "9": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:9"}}]
        assert plp == _dumps(plp_obj)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                 "prompt_tokens_details": {"cached_tokens": 4}}
        choice = out.choice("abx", lp, FinishReason.LENGTH, prompt_logprobs=plp)
        body = out.answer([choice], 2, 4, plp if chat else None)
        obj = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
               "created": 1764600000, "model": "m", "choices": [
                   {"index": 0, **({"message": {"role": "assistant", "content": "abx"}} if chat
                                   else {"text": "abx"}),
                    "logprobs": None if lp is None else json.loads(lp), "finish_reason": "length",
                    **({} if chat else {"prompt_logprobs": plp_obj})}], "usage": usage}
        if chat:
            obj["prompt_logprobs"] = plp_obj
        assert body == _dumps(obj).encode()


@pytest.mark.parametrize("include_usage", [True, False])
def test_tool_call_rendering_equals_json_dumps(include_usage):
    """Tool calls' stream deltas and a whole answer's tool_calls, byte for byte json.dumps of
    OpenAI's objects."""
    from exl3serve_client.frontend.protocol import Endpoint, FinishReason
    from exl3serve_client.frontend.render import OpenAIRenderer, ToolCall, dumps
    from exl3serve_client.frontend.tool_calls import CallArguments, CallStart, Content
    from exl3serve_client.frontend.validation import PreparedRequest
    req = PreparedRequest(endpoint=Endpoint.CHAT_COMPLETIONS, model="m", prompts=[[1]],
                          engine_request=None, stops=[], stream=True, include_usage=include_usage,
                          logprobs=None, rid="chatcmpl-1", created=1764600000)
    out = OpenAIRenderer(req, tok=None)
    extra = {"usage": None} if include_usage else {}

    def event(delta, logprobs=None):
        return "data: " + dumps({**_openai_envelope(req, [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}], True),
            **extra}) + "\n\n"

    lp = {"content": [], "refusal": None}
    events = [Content("Hi \"x\""), CallStart(0, "call_a\\", "get_wé"), CallArguments(0, '{"a": "}\\n"')]
    assert out.delta_events(events, dumps(lp)) == "".join([
        event({"content": 'Hi "x"'}, lp),
        event({"tool_calls": [{"index": 0, "id": "call_a\\", "type": "function",
                               "function": {"name": "get_wé", "arguments": ""}}]}),
        event({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": "}\\n"'}}]})])
    assert out.delta_events([], dumps(lp)) == event({}, lp)
    assert out.delta_events([], None) == ""
    calls = [ToolCall("call_1", "f", '{"x": 1}'), ToolCall("call_2", "g", "{}")]
    for content in ["", "text"]:
        message = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]}
        whole = {**_openai_envelope(req, [{"index": 0, "message": message, "logprobs": None,
                                           "finish_reason": "tool_calls"}], False),
                 "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}
        assert out.whole(content, None, FinishReason.TOOL_CALLS, 5, calls) == dumps(whole).encode()


@pytest.mark.parametrize("include_usage", [True, False])
def test_reasoning_and_choices_rendering_equals_json_dumps(include_usage):
    """The reasoning's stream deltas and a whole answer's reasoning_content, and choices other
    than the first (n > 1), byte for byte json.dumps of the objects vLLM sends."""
    from exl3serve_client.frontend.protocol import Endpoint, FinishReason
    from exl3serve_client.frontend.reasoning import ReasoningFormat, Reasoning
    from exl3serve_client.frontend.render import OpenAIRenderer, ToolCall, dumps
    from exl3serve_client.frontend.tool_calls import Content
    from exl3serve_client.frontend.validation import PreparedRequest, ReasoningSplit
    req = PreparedRequest(endpoint=Endpoint.CHAT_COMPLETIONS, model="m", prompts=[[1]],
                          engine_request=None, stops=[], stream=True, include_usage=include_usage,
                          logprobs=None, rid="chatcmpl-1", created=1764600000,
                          reasoning=ReasoningSplit(ReasoningFormat.GLM45, True, False), n=3)
    outs = [OpenAIRenderer(req, None, i) for i in range(3)]
    extra = {"usage": None} if include_usage else {}

    def event(index, delta, logprobs=None):
        return "data: " + dumps({**_openai_envelope(req, [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}], True),
            **extra}) + "\n\n"

    lp = {"content": [], "refusal": None}
    assert outs[2].delta_events([Reasoning("th\"ink"), Content("ans")], dumps(lp)) == \
        event(2, {"reasoning_content": 'th"ink'}, lp) + event(2, {"content": "ans"})
    assert outs[1].role_event() == event(1, {"role": "assistant", "content": ""})
    usage = {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}
    choices = [
        (outs[0].choice("ans", None, FinishReason.STOP, None, "why"),
         {"role": "assistant", "content": "ans", "reasoning_content": "why"}, "stop"),
        (outs[1].choice("", None, FinishReason.LENGTH, None, "cut"),
         {"role": "assistant", "content": None, "reasoning_content": "cut"}, "length"),
        (outs[2].choice("", None, FinishReason.TOOL_CALLS, [ToolCall("call_1", "f", "{}")], None),
         {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         "tool_calls")]
    whole = {**_openai_envelope(req, [{"index": i, "message": m, "logprobs": None,
                                       "finish_reason": f} for i, (_, m, f) in enumerate(choices)],
                                False), "usage": usage}
    assert outs[0].answer([c for c, _, _ in choices], 9) == dumps(whole).encode()


def test_every_architecture_gets_its_familys_tokenizer(tmp_path):
    """Each architecture make-test-model writes (GLM-MoE-DSA, DeepSeek-V4 and Qwen3-Next too) gets
    a tokenizer and its family's chat template; a *ForConditionalGeneration checkpoint (GLM-5.3-Flash,
    Qwen3.8-Flash-Next) keeps the text model's fields in text_config, beside vision_config, as
    transformers writes it."""
    for arch, family in FAMILIES.items():
        d = tmp_path / arch
        d.mkdir()
        text = {"vocab_size": 512, "max_position_embeddings": 2048}
        cfg = ({"architectures": [arch], "text_config": text, "vision_config": {"depth": 1}}
               if arch.endswith("ForConditionalGeneration") else {"architectures": [arch], **text})
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
        write_tokenizer(d)
        conf = json.loads((d / "tokenizer_config.json").read_text())
        assert conf["chat_template"] == family.template, arch
        assert conf["model_max_length"] == 2048, arch
        tok = ModelTokenizer(d)
        assert tok.vocab_size == 512, arch
        assert tok.tokenizer.id_to_token(1) == family.specials[1], arch


def test_make_tokenizer_knows_every_engine_architecture():
    """make_tokenizer's FAMILIES names exactly the architectures the engine reads (the table of
    model/config/architecture.cc): a model the engine serves gets a tokenizer, and no other."""
    table = (ROOT / "model/config/architecture.cc").read_text()
    engine = set(re.findall(r'\{Architecture::k\w+,\s*"(\w+)"', table))
    assert len(engine) >= 9
    assert set(FAMILIES) == engine


def test_glm5_next_and_qwen4_exp_chat_formats(tmp_path):
    """GLM-5.3-Flash renders GLM's chat format and Qwen3.8-Flash-Next Qwen's (the prompts their
    families' models are trained on)."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    want = {"Glm5NextForConditionalGeneration": "[gMASK]<sop><|system|>\nS<|user|>\nU<|assistant|>\n",
            "Qwen4ExpForConditionalGeneration":
                "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"}
    for arch, prompt in want.items():
        d = tmp_path / arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch], "text_config": {
            "vocab_size": 512, "max_position_embeddings": 4096, "eos_token_id": 1}}))
        write_tokenizer(d)
        assert ModelTokenizer(d).render_chat(msgs, add_generation_prompt=True) == prompt, arch

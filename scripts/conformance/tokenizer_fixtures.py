#!/usr/bin/env python3
"""Tokenizer and chat-template fixtures, with transformers as the judge.

Run with a Python that has transformers (5.x) and the `tokenizers` version pinned in
scripts/checks/frontend/requirements.txt:

    /opt/hfref/bin/python scripts/conformance/tokenizer_fixtures.py --out tests/fixtures/tokenizer

For each family (glm4_moe, qwen3_moe, mixtral, deepseek_v3, deepseek_v4) it writes a small model config
(config.json, generation_config.json as `exl3-tool make-test-model` writes them: vocab 512, bos id 0,
eos id 1), makes its tokenizer files with the package's own code
(clients/python/exl3serve_client/make_tokenizer.py, the code behind `exl3serve-make-tokenizer`),
checks that a second run in a fresh interpreter gives byte-identical files, and records what
transformers' AutoTokenizer makes of them in expected.json: the token ids of a few hundred strings
(with and without special tokens), decode of those ids (skipping special tokens and not), and
apply_chat_template of several conversations (text and token ids, add_generation_prompt true and
false). tests/clients/python/test_tokenizer_fixtures.py checks the package against these files
without transformers. The layout is described in tests/fixtures/tokenizer/README.md.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import tokenizers
import transformers

ROOT = Path(__file__).resolve().parents[2]
MAKE_TOKENIZER = ROOT / "clients/python/exl3serve_client/make_tokenizer.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 512
SEED = 20261201


@functools.lru_cache(maxsize=1)
def load_make_tokenizer():
    """make_tokenizer.py as a module of its own: it needs only `tokenizers`, while the package's
    __init__ also imports grpc, which a transformers environment need not have."""
    spec = importlib.util.spec_from_file_location("exl3serve_make_tokenizer", MAKE_TOKENIZER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_model_config(d: Path, arch: str) -> None:
    """The fields of make-test-model's config.json / generation_config.json that the tokenizer
    reads."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [arch], "vocab_size": VOCAB, "max_position_embeddings": 4096}
    gen = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_in_fresh_process(src: Path, dst: Path) -> None:
    """The tokenizer files of src's config made again by a new interpreter, into dst."""
    dst.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    subprocess.run([sys.executable, __file__, "--make-only", str(dst)], check=True, timeout=300)


# --- the strings ---------------------------------------------------------------------------------

ALL_SPECIALS = sorted({s for f in load_make_tokenizer().FAMILIES.values() for s in f.specials})

HANDWRITTEN = [
    # empty, whitespace only
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n", "\n\n\n\n\n", " \n \n ", "\t\t\t", "\u3000",
    "\u00a0", "\u2009\u200a\u2002", "\u2028\u2029", "\x0b\x0c", " " * 37, "\n" * 17, "\t \n" * 9,
    # ASCII text, leading / trailing / inner runs of whitespace
    "Hello, world!", " Hello", "Hello ", "  two leading", "two trailing  ",
    "a  b   c    d     e", "line one\nline two\n", "para one\n\n\npara two",
    "windows\r\nline\r\nends\r\n", "tab\tseparated\tvalues\t", "mixed \t \n \r\n runs",
    "    def f(x):\n        return x * 2\n", "if (a && b) { return c; } // done",
    "The quick brown fox jumps over the lazy dog.", "ALL CAPS AND 1234567890",
    "3.14159 2.71828 -0.5 1e-10 0x1F 0b1010 1_000_000", "a" * 300, "ab" * 120, "!?" * 40,
    "'s 't 're 've 'm 'll 'd", "don't won't it's I'm you're", "email@example.com https://x.y/z?q=1",
    # Latin with diacritics, composed and decomposed (combining marks)
    "naïve café — déjà vu", "Größe Straße", "señor niño año", "Ærøskøbing Å",
    "e\u0301 vs \u00e9", "n\u0303", "a\u0300\u0301\u0302\u0303\u0304", "Z\u0351\u0352\u0353\u0354\u0355a\u0356\u0357l\u0358g\u0359o",
    unicodedata.normalize("NFD", "Ça déçoit énormément"), "\u0041\u030a\u212b\u00c5",
    "q\u0307\u0323", "ﬁ ﬂ ﬃ", "ｆｕｌｌｗｉｄｔｈ", "Ⅻ ⅷ ①②③",
    # other scripts
    "日本語のテキスト", "中文也有一点。", "繁體中文測試", "한국어도 조금", "ひらがな カタカナ ｶﾀｶﾅ",
    "𠀀𠀁𠀂 𪚥", "Ελληνικά Ωμέγα", "русский текст", "עברית", "العربية مع تشكيل: مُحَمَّد",
    "हिन्दी देवनागरी", "ภาษาไทย", "ქართული", "Հայերեն", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙",
    "mixed 日本 and English and العربية",
    # emoji: single, skin tones, ZWJ sequences, flags, keycaps, variation selectors
    "😀", "😀😀😀😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️‍🔥", "🇫🇷🇯🇵🇺🇸", "1️⃣#️⃣",
    "☺︎ ☺️", "🧪🚀🙂", "emoji 🧪🧪🧪 run", "🙂 between 🙂 words 🙂", "a😀b😀c",
    # symbols, punctuation, invisible characters
    "€ £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ √ π Ω", "∀x∈ℝ: x² ≥ 0", "«guillemets» „Anführung“ “curly”",
    "\u200bzero\u200dwidth\u200cjoiner", "\ufeffbom", "soft\u00adhyphen", "\u202eright-to-left",
    "\x00\x01\x1f\x7f", "\ufffd replacement", "\U0010ffff", "\ue000 private use",
]


def special_strings() -> list[str]:
    """Special tokens written in text: alone, repeated, adjacent, among words and whitespace,
    unfinished."""
    out = []
    for s in ALL_SPECIALS:
        out += [s, s + s, f" {s} ", f"before{s}after", f"\n{s}\n", f"x {s}y", s[:-1], s[1:]]
    out += ["".join(ALL_SPECIALS), " ".join(ALL_SPECIALS),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            "[gMASK]<sop><|user|>\nhello<|assistant|>\n", "<s>[INST] x [/INST]answer</s>",
            "<｜begin▁of▁sentence｜><｜User｜>question<｜Assistant｜>reply<｜end▁of▁sentence｜>",
            "<|endoftext|><|endoftext|>  <|endoftext|>", "<think>\nreasoning\n</think>\n\nanswer",
            "<|im_start|", "|im_start|>", "< |im_start| >", "<|IM_START|>", "[inst]", "<S>",
            "<｜User", "<|user|>\u00e9\u0301😀"]
    return out


def random_strings(n: int, rng: random.Random) -> list[str]:
    """Random mixes of the hard parts: words, whitespace runs, multi-byte characters, specials."""
    parts = ["the", "cat", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "é", "e\u0301", "ß",
             "ж", "中", "文", "日本", "한", "ع", "😀", "🚀", "👍🏽", "👩‍💻", "🇫🇷", "\u00a0", "\u200d",
             "123", "4.5", "<", "|", ">", "[", "]", "{", "}", "'s", "!", "…", *ALL_SPECIALS]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def strings() -> list[str]:
    rng = random.Random(SEED)
    out = HANDWRITTEN + special_strings()
    out += random_strings(max(60, 300 - len(out)), rng)
    seen, unique = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


# --- the conversations ---------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    "multi_turn": [SYSTEM, {"role": "user", "content": "Hi there"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    "ends_with_assistant": [{"role": "user", "content": "Say yes."},
                            {"role": "assistant", "content": "yes"}],
    "long_multi_turn": [SYSTEM] + [
        m for i in range(3) for m in ({"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": f"answer {i}"})
    ] + [{"role": "user", "content": "last question"}],
    "unicode": [{"role": "system", "content": "Réponds en français 🇫🇷."},
                {"role": "user", "content": "日本語で？ 👍🏽 e\u0301"}],
    "whitespace": [{"role": "user", "content": "  leading\n\n\ttabs and trailing  \n"},
                   {"role": "assistant", "content": "\n\nok\n\n"},
                   {"role": "user", "content": " "}],
    "empty_content": [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    "specials_in_content": [{"role": "user", "content": "".join(ALL_SPECIALS)}],
}


# Tool calls, for the families whose template renders them (a `tools` list, assistant `tool_calls`,
# `tool` results, `developer`): the front end passes the request's tools and calls this way.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city, for some days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time: «ISO 8601»",
                                      "parameters": {"type": "object", "properties": {}}}}]
_CALLS = [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "units": {"t": "C"}}}},
    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]
TOOL_CONVERSATIONS = {
    "tools_offered": [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}],
    "tools_no_system": [{"role": "user", "content": "What time is it?"}],
    "tool_round_trip": [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Zürich, and the time?"},
        {"role": "assistant", "content": "", "tool_calls": _CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\"}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "assistant", "content": "Clear, and it is noon."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": _CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
}


# Thinking modes, for the templates that read them (DeepSeek-V4's: `thinking` / `enable_thinking`,
# `drop_thinking`, `reasoning_effort` among the template kwargs, as chat_template_kwargs pass them):
# assistant turns with reasoning_content, each conversation rendered with every set of kwargs.
THINKING_KWARGS = [{}, {"thinking": False}, {"enable_thinking": True}, {"thinking": True},
                   {"thinking": True, "drop_thinking": False}, {"reasoning_effort": "max"},
                   {"enable_thinking": True, "reasoning_effort": "none"}]
THINKING_CONVERSATIONS = {
    "reasoning_history": [SYSTEM, {"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": "Hello!",
                           "reasoning_content": "A greeting; greet back."},
                          {"role": "user", "content": "Tell me a joke."}],
    "reasoning_developer": [{"role": "developer", "content": "Be kind."},
                            {"role": "user", "content": "q1"},
                            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                            {"role": "developer", "content": "Be brief."},
                            {"role": "user", "content": "q2"}],
    # A developer message between two user messages: left out with the reasoning dropped, the
    # user messages stay two turns (the encoding merges before it drops).
    "reasoning_developer_between_users": [{"role": "user", "content": "q1"},
                                          {"role": "developer", "content": "Be brief."},
                                          {"role": "user", "content": "q2"}],
    "reasoning_ends_with_assistant": [{"role": "user", "content": "Say yes."},
                                      {"role": "assistant", "content": "yes",
                                       "reasoning_content": "Easy."}],
}
# With tools: every turn keeps its reasoning (the encoding drops none where tools are offered).
THINKING_TOOL_CONVERSATIONS = {
    "reasoning_tool_round_trip": [
        SYSTEM, {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
         "tool_calls": _CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "It said sunny."},
        {"role": "user", "content": "Thanks."}],
}


def reads_thinking(hf) -> bool:
    return "thinking" in (hf.chat_template or "")


def renders_tools(hf) -> bool:
    template = hf.chat_template or ""
    return "<tool_call>" in template or "<｜tool▁call▁begin｜>" in template or "｜DSML｜" in template


def chat_ids(hf, messages, add_generation_prompt: bool, tools=None, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                 tools=tools, **kwargs)
    if hasattr(out, "keys"):  # a BatchEncoding (return_dict)
        out = out["input_ids"]
    return [int(i) for i in out]


def record(model_dir: Path, family: str, sha: dict[str, str]) -> dict:
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    cases = []
    for s in strings():
        ids = [int(i) for i in hf(s)["input_ids"]]
        plain = [int(i) for i in hf(s, add_special_tokens=False)["input_ids"]]
        cases.append({"text": s, "ids": ids, "ids_no_special": plain,
                      "decode": hf.decode(ids, skip_special_tokens=False),
                      "decode_skip_special": hf.decode(ids, skip_special_tokens=True)})
    chats = []
    for name, messages in CONVERSATIONS.items():
        for gen in (True, False):
            chats.append({"name": name, "add_generation_prompt": gen, "messages": messages,
                          "text": hf.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=gen),
                          "ids": chat_ids(hf, messages, gen)})
    for name, messages in (TOOL_CONVERSATIONS.items() if renders_tools(hf) else ()):
        for gen in (True, False):
            chats.append({"name": name, "add_generation_prompt": gen, "messages": messages,
                          "tools": TOOLS,
                          "text": hf.apply_chat_template(messages, tokenize=False, tools=TOOLS,
                                                         add_generation_prompt=gen),
                          "ids": chat_ids(hf, messages, gen, TOOLS)})
    thinking = [(n, m, None) for n, m in THINKING_CONVERSATIONS.items()] + \
        [(n, m, TOOLS) for n, m in THINKING_TOOL_CONVERSATIONS.items()]
    for name, messages, tools in (thinking if reads_thinking(hf) else ()):
        for kwargs in THINKING_KWARGS:
            for gen in (True, False):
                case = {"name": name, "add_generation_prompt": gen, "messages": messages,
                        "kwargs": kwargs}
                if tools:
                    case["tools"] = tools
                case["text"] = hf.apply_chat_template(messages, tokenize=False, tools=tools,
                                                      add_generation_prompt=gen, **kwargs)
                case["ids"] = chat_ids(hf, messages, gen, tools, **kwargs)
                chats.append(case)
    return {"family": family, "tokenizer_class": type(hf).__name__,
            "generated_with": {"transformers": transformers.__version__,
                               "tokenizers": tokenizers.__version__},
            "sha256": sha, "strings": cases, "chats": chats}


def dump(doc: dict) -> str:
    """JSON with one string case or conversation per line: small and readable in a diff."""
    head = {k: v for k, v in doc.items() if k not in ("strings", "chats")}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    for key in ("strings", "chats"):
        rows = [json.dumps(c, ensure_ascii=False) for c in doc[key]]
        lines.append(f' "{key}": [')
        lines += [f"  {r}," for r in rows[:-1]] + [f"  {rows[-1]}"]
        lines.append(" ]," if key == "strings" else " ]")
    return "\n".join(lines + ["}"]) + "\n"


def make_family(arch: str, family: str, out: Path, mt) -> None:
    d = out / family
    write_model_config(d, arch)
    mt.write_tokenizer(d, force=True)
    with tempfile.TemporaryDirectory() as tmp:
        again = Path(tmp) / family
        make_in_fresh_process(d, again)
        for name in TOKENIZER_FILES:
            if (d / name).read_bytes() != (again / name).read_bytes():
                sys.exit(f"{family}: a second run wrote a different {name}: the tokenizer is not "
                         "deterministic")
    sha = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in TOKENIZER_FILES}
    doc = record(d, family, sha)
    json.loads(dump(doc))  # the writer's output is JSON
    (d / "expected.json").write_text(dump(doc))
    print(f"{family}: {len(doc['strings'])} strings, {len(doc['chats'])} chat renderings "
          f"({doc['tokenizer_class']})", flush=True)


def main() -> None:
    mt = load_make_tokenizer()
    by_name: dict[str, str] = {}
    for arch, f in mt.FAMILIES.items():  # a family's fixture names its first architecture
        by_name.setdefault(f.name, arch)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/tokenizer")
    ap.add_argument("--families", default=",".join(by_name),
                    help=f"comma-separated, of {', '.join(by_name)}")
    ap.add_argument("--make-only", type=Path, metavar="DIR",
                    help="only write DIR's tokenizer files (the determinism check's second run)")
    args = ap.parse_args()
    if args.make_only:
        mt.write_tokenizer(args.make_only)
        return
    for family in args.families.split(","):
        if family not in by_name:
            sys.exit(f"unknown family {family} (known: {', '.join(by_name)})")
        make_family(by_name[family], family, args.out, mt)


if __name__ == "__main__":
    main()

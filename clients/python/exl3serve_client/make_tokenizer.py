"""Gives a generated test model (exl3-tool make-test-model) a tokenizer: tokenizer.json, a byte-level
BPE trained with Hugging Face `tokenizers` on a small built-in text, its vocabulary exactly the
model's vocab_size with the family's special tokens inside it, and tokenizer_config.json with a chat
template in the family's style (picked from config.json's architectures).

    exl3serve-make-tokenizer --model DIR [--force]

The special tokens take the lowest ids, placed so that the ids of generation_config.json's
bos_token_id / eos_token_id are the family's begin / end tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


# Templates use the names transformers' apply_chat_template passes (messages, add_generation_prompt,
# bos_token, eos_token, raise_exception) and are rendered with its jinja2 settings
# (trim_blocks, lstrip_blocks): they are kept on one line so that no newline depends on those.
# Qwen's, GLM's and DeepSeek's templates also render `tools` (the request's function list),
# assistant messages' `tool_calls` and `tool` results in their families' formats, which the front
# end parses back (frontend/tool_calls.py: hermes, glm45, deepseek_v3, deepseek_v4); `developer` is
# a system message (DeepSeek-V4's: a user turn, as its encoding renders it). A call's `arguments` reach Qwen's and GLM's templates as an object (the front end
# decodes OpenAI's JSON text), DeepSeek's as JSON text (its own template concatenates them; an
# object is written as JSON here too).
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
)
_GLM_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n" + _TOOLS_INTRO +
    "For each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>"
    "{arg-value-1}</arg_value>\n...\n</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ['system', 'developer'] %}<|system|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined "
    "else c %}{{ '\\n' }}<tool_call>{{ f['name'] }}{% for k, v in f['arguments'].items() %}"
    "{{ '\\n' }}<arg_key>{{ k }}</arg_key>{{ '\\n' }}<arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}{{ '\\n' }}</tool_call>"
    "{% endfor %}"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != "
    "'tool' %}<|observation|>{% endif %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m['content'] }}"
    "{{ '\\n' }}</tool_response>"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] in ['system', 'developer'] %}"
    "{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}" + _TOOLS_INTRO +
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% if m['role'] in ['system', 'developer'] %}{% if not (tools and loop.first) %}"
    "<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != "
    "'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m['content'] }}"
    "{{ '\\n' }}</tool_response>{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined "
    "else c %}{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>"
    "{{ '\\n' }}{\"name\": \"{{ f['name'] }}\", \"arguments\": {{ f['arguments'] | tojson }}}"
    "{{ '\\n' }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
)
_DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% if tools %}## Tools\nYou may call functions to assist with the user query. "
    "The functions:\n{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "To call functions, write:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "{function-name}\n```json\n{arguments-json-object}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>{{ '\\n\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ['system', 'developer'] %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}"
    "{% if m['tool_calls'] %}<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "{{ f['name'] }}{{ '\\n' }}```json{{ '\\n' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{{ '\\n' }}```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}"
    "<｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != "
    "'tool' %}<｜tool▁outputs▁begin｜>{% endif %}<｜tool▁output▁begin｜>{{ m['content'] }}"
    "<｜tool▁output▁end｜>{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "<｜tool▁outputs▁end｜>{% endif %}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

# DeepSeek-V4's chat format as its published encoding writes it (DeepSeek-V4's model repositories
# ship it as a Python encoding script, encoding/encoding_dsv4.py, not as a Jinja template; this is
# the same rendering, the instructions' wording ours), with its two modes. The mode comes from the
# template kwargs (chat_template_kwargs) as vLLM reads them for DeepSeek-V4: thinking where
# `thinking` or `enable_thinking` is true or neither is given, chat where those given are false or
# `reasoning_effort` is "none" (frontend/reasoning.py thinking_mode reads them the same way).
# - The request's tools go with the first message where it is a system or developer message
#   (after its content, "\n\n## Tools", the DSML call syntax, the schemas one JSON per line), else
#   in a system part of their own before the conversation.
# - user, `tool` and following user messages are one <｜User｜> turn, their parts joined by "\n\n",
#   each tool result as <tool_result>…</tool_result>; `developer` is a <｜User｜> turn of its own.
# - After a user-side turn that an assistant turn follows (or the generation prompt):
#   <｜Assistant｜>, then <think> in thinking mode (the answer opens inside the reasoning) or
#   </think> in chat mode (the answer follows at once).
# - An assistant turn: in thinking mode its reasoning_content and </think>, then its content, its
#   calls as a DSML block after "\n\n", and <｜end▁of▁sentence｜>.
# - Earlier reasoning is dropped in thinking mode (`drop_thinking`, default true, and without
#   tools: with tools every turn keeps it): the turns before the last user-side turn get
#   <｜Assistant｜></think> and no reasoning, and the `developer` messages before it are left out
#   (as the encoding drops them); the last turn's transition is <｜Assistant｜><think>.
# - `reasoning_effort` "max" in thinking mode puts an instruction to think exhaustively first.
# The encoding also orders tool results by their calls' ids: the front end does that before
# rendering (frontend/validation.py), as this template keeps the messages' order.
_DSML_EXAMPLE = (
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter "
    "name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
_DEEPSEEK_V4_TOOLS = (
    "{% set tools_text %}{% if tools %}{{ '\\n\\n' }}## Tools{{ '\\n\\n' }}You can call the tools "
    "below. To call tools, write a \"<｜DSML｜tool_calls>\" block like this one:{{ '\\n\\n' }}" +
    _DSML_EXAMPLE.replace("\n", "{{ '\\n' }}") +
    "{{ '\\n\\n' }}Write a string parameter as it is, with string=\"true\"; any other value "
    "(a number, boolean, array or object) as JSON, with string=\"false\".{{ '\\n\\n' }}"
    "In thinking mode (the answer opens after <think>), reason inside <think>...</think> first, "
    "then write the calls or the answer; otherwise write them right after </think>.{{ '\\n\\n' }}"
    "### Available Tool Schemas{{ '\\n\\n' }}"
    "{% for t in tools %}{{ (t['function'] if t['function'] is defined else t) | tojson }}"
    "{{ '\\n' }}{% endfor %}{{ '\\n' }}Call only these tools, with their parameters as "
    "defined.{{ '\\n' }}{% endif %}{% endset %}"
)
_DEEPSEEK_V4_TEMPLATE = (
    # The mode, and whether earlier reasoning is dropped.
    "{% set given = thinking is defined or enable_thinking is defined %}"
    "{% set think = (thinking is defined and thinking) or (enable_thinking is defined and "
    "enable_thinking) or not given %}"
    "{% if reasoning_effort is defined and reasoning_effort == 'none' %}{% set think = false %}"
    "{% endif %}"
    "{% set drop = think and not tools and (drop_thinking if drop_thinking is defined else true) %}"
    + _DEEPSEEK_V4_TOOLS +
    # The messages rendered: with reasoning dropped, not the developer messages before the last
    # user-side message. The turns are those of all the messages (the encoding merges user-side
    # messages into turns before it drops any): ns.prev / ns.next hold each rendered message's
    # neighbours' roles among all of them. ns.last: the last user-side message's index among the
    # rendered ones.
    "{% set ns = namespace(msgs=[], prev=[], next=[], last=-1) %}"
    "{% for m in messages %}{% if m['role'] in ['user', 'tool', 'developer'] %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if not (drop and m['role'] == 'developer' and "
    "loop.index0 < ns.last) %}{% set ns.msgs = ns.msgs + [m] %}"
    "{% set ns.prev = ns.prev + [messages[loop.index0 - 1]['role'] if not loop.first else none] %}"
    "{% set ns.next = ns.next + [messages[loop.index0 + 1]['role'] if not loop.last else none] %}"
    "{% endif %}{% endfor %}"
    "{% set ns.last = -1 %}"
    "{% for m in ns.msgs %}{% if m['role'] in ['user', 'tool', 'developer'] %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{{ bos_token }}"
    "{% if think and reasoning_effort is defined and reasoning_effort == 'max' %}"
    "Reasoning effort: maximum. Think the problem through exhaustively before answering: break it "
    "into its parts, check every step, weigh the alternatives and the edge cases, and verify the "
    "answer.{{ '\\n\\n' }}{% endif %}"
    "{% if tools and (not ns.msgs or ns.msgs[0]['role'] not in ['system', 'developer']) %}"
    "{{ tools_text }}{% endif %}"
    "{% for m in ns.msgs %}"
    "{% if m['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% set prev = ns.prev[loop.index0] %}"
    "{% set next = ns.msgs[loop.index0 + 1]['role'] if not loop.last else none %}"
    "{% set with_tools = tools and loop.first %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}{% if with_tools %}{{ tools_text }}{% endif %}"
    "{% elif m['role'] == 'assistant' %}"
    "{% if think and (not drop or loop.index0 > ns.last) %}"
    "{{ m['reasoning_content'] or m['reasoning'] or '' }}</think>{% endif %}"
    "{{ m['content'] }}"
    "{% if m['tool_calls'] %}{{ '\\n\\n' }}<｜DSML｜tool_calls>{{ '\\n' }}"
    "{% for c in m['tool_calls'] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<｜DSML｜invoke name=\"{{ f['name'] }}\">"
    "{{ '\\n' }}{% for k, v in f['arguments'].items() %}{% if not loop.first %}{{ '\\n' }}"
    "{% endif %}<｜DSML｜parameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else "
    "'false' }}\">{{ v if v is string else v | tojson }}</｜DSML｜parameter>{% endfor %}"
    "{{ '\\n' }}</｜DSML｜invoke>{% endfor %}{{ '\\n' }}</｜DSML｜tool_calls>{% endif %}"
    "<｜end▁of▁sentence｜>"
    "{% else %}"
    "{% if m['role'] == 'developer' or prev not in ['user', 'tool'] %}<｜User｜>"
    "{% else %}{{ '\\n\\n' }}{% endif %}"
    "{% if m['role'] == 'tool' %}<tool_result>{{ m['content'] }}</tool_result>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'developer' and with_tools %}{{ tools_text }}{% endif %}"
    "{% if m['role'] == 'developer' or ns.next[loop.index0] not in ['user', 'tool'] %}"
    "{% if next == 'assistant' or (next is none and add_generation_prompt) %}<｜Assistant｜>"
    "{{ '<think>' if think and (not drop or loop.index0 >= ns.last) else '</think>' }}"
    "{% endif %}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    specials: tuple[str, ...]  # [0]: begin token, [1]: end token (end of text / turn)
    template: str
    bos_token: Optional[str]   # tokenizer_config's bos_token (None: the family has none)
    add_bos: bool              # the post-processor puts bos_token before every encoded text


_GLM = Family(
    "glm4_moe", ("<sop>", "<|endoftext|>", "[gMASK]", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|observation|>"), _GLM_TEMPLATE, None, False)
_QWEN = Family(
    "qwen3_moe", ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>"),
    _QWEN_TEMPLATE, None, False)
_MIXTRAL = Family(
    "mixtral", ("<s>", "</s>", "<unk>", "[INST]", "[/INST]"), _MIXTRAL_TEMPLATE, "<s>", True)
_DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
_DEEPSEEK = Family(
    "deepseek_v3", _DEEPSEEK_SPECIALS, _DEEPSEEK_TEMPLATE, "<｜begin▁of▁sentence｜>", True)
# DeepSeek-V4's tokenizer for the test models: DeepSeek-V3's special tokens (the DSML tags and
# </think> are text), its own chat format.
_DEEPSEEK_V4 = Family(
    "deepseek_v4", _DEEPSEEK_SPECIALS, _DEEPSEEK_V4_TEMPLATE, "<｜begin▁of▁sentence｜>", True)

# By config.json's architectures[0]: every architecture of model/config/architecture.cc (the
# engine's list; tests/clients/python/test_text.py holds the two in step). The newer families speak
# their predecessors' chat format (GLM-MoE-DSA and GLM-5.3-Flash: GLM's, [gMASK]<sop><|user|>...;
# Qwen3-Next and Qwen3.8-Flash-Next: Qwen's, <|im_start|>...) and get the same tokenizer;
# DeepSeek-V4 its own format (DSML tool calls) with DeepSeek-V3's tokens.
FAMILIES = {
    "Glm4MoeForCausalLM": _GLM,
    "GlmMoeDsaForCausalLM": _GLM,
    "Glm5NextForConditionalGeneration": _GLM,
    "Qwen3MoeForCausalLM": _QWEN,
    "Qwen3NextForCausalLM": _QWEN,
    "Qwen4ExpForConditionalGeneration": _QWEN,
    "MixtralForCausalLM": _MIXTRAL,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "DeepseekV4ForCausalLM": _DEEPSEEK_V4,
}

_TEXT = """\
A mixture of experts model sends every token to a few of its experts. The router picks them,
the workers hold them, and the answers come back as partial sums that are added in order.
Attention reads its weights densely; the experts are read sparsely, a few at a time.
The quick brown fox jumps over the lazy dog, and then it runs back again over the hill.
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 3.14 2.718.
Punctuation (brackets), [lists], {braces}, "quotes", 'apostrophes', semi-colons; colons: dashes -
slashes / back\\slashes * stars & ampersands % percent # hash @ at = equals + plus ? question!
def forward(self, x): return self.down(self.act(self.gate(x)) * self.up(x))
for i in range(10): print(i, i * i)
Il était une fois un petit chat qui aimait le café crème. Größe, Straße, naïve, déjà vu, señor.
日本語の文章も少し入れておく。中文也有一点。한국어도 조금. Ελληνικά, русский текст, עברית, العربية.
Emoji: 🙂 🚀 👍🏽 🧪 ❤️ 🇫🇷 — and symbols: € £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ √ π Ω.
Tabs\tand  double  spaces,   triple   spaces, and
newlines


and blank lines are text as well.
"""

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "is", "um",
              "ba", "de", "fu", "gi", "ho", "ju", "ze", "qu", "xy", "wo", "va")


def _corpus(extra_words: int) -> list[str]:
    """The built-in text plus `extra_words` made-up words (a fixed seed: the same tokenizer every run)."""
    rng = random.Random(1234)
    words = [" " + "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
             for _ in range(extra_words)]
    lines = _TEXT.splitlines(keepends=True)
    return lines + ["".join(words[i:i + 12]) for i in range(0, len(words), 12)]


def _place(specials: tuple[str, ...], bos_id: Optional[int], eos_id: Optional[int]) -> list[str]:
    """Orders the special tokens so that bos_id holds specials[0] and eos_id specials[1]."""
    out = list(specials)
    for want, tok in ((eos_id, specials[1]), (bos_id, specials[0])):
        if isinstance(want, int) and 0 <= want < len(out):
            j = out.index(tok)
            out[want], out[j] = out[j], out[want]
    return out


def build_tokenizer(family: Family, vocab_size: int, bos_id: Optional[int] = None,
                    eos_id: Optional[int] = None) -> tuple[Tokenizer, list[str]]:
    """A byte-level BPE whose vocabulary is exactly vocab_size; returns it and its special tokens."""
    specials = _place(family.specials, bos_id, eos_id)
    floor = 256 + len(specials)
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is below {floor} (256 bytes + special tokens)")
    extra = 0
    for _ in range(12):  # each round doubles the made-up words: bounded
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1,
                                      special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_corpus(extra), trainer=trainer)
        if tok.get_vocab_size(with_added_tokens=True) == vocab_size:
            break
        extra = max(2 * extra, 2048)
    else:
        raise ValueError(f"could not train a vocabulary of {vocab_size} tokens")
    if family.add_bos:
        bos = family.bos_token
        if bos is None:
            raise ValueError(f"{family.name}: add_bos without a bos_token")
        bid = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bid)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, specials


def tokenizer_config(family: Family, max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos_token,
        "eos_token": family.specials[1],
        "pad_token": family.specials[1],
        "unk_token": None,
        "add_bos_token": family.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": family.template,
    }


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields of a config.json: a *ForConditionalGeneration checkpoint's
    text_config (GLM-5.3-Flash, Qwen3.8-Flash-Next: the vision tower's beside it) with the top
    level's fields it lacks, else the top level (as model/config/architecture.h places them)."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def write_tokenizer(model_dir: Path, force: bool = False) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in FAMILIES:
        raise ValueError(f"{model_dir}/config.json: architecture {arch!r} is not one of "
                         f"{', '.join(sorted(FAMILIES))}")
    out = model_dir / "tokenizer.json"
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (--force replaces it)")
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    text = text_model_config(cfg)
    eos: Any = gen.get("eos_token_id", text.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) and eos else eos
    family = FAMILIES[arch]
    tok, _ = build_tokenizer(family, int(text["vocab_size"]), gen.get("bos_token_id"), eos)
    tok.save(str(out))
    conf = tokenizer_config(family, int(text.get("max_position_embeddings", 4096)))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    # Imported here: scripts/conformance/tokenizer_fixtures.py loads this file alone, outside the
    # package, and needs only the code above.
    from .package_version import package_version
    ap = argparse.ArgumentParser(prog="exl3serve-make-tokenizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    ap.add_argument("--model", required=True, type=Path, help="model directory with config.json")
    ap.add_argument("--force", action="store_true", help="replace an existing tokenizer.json")
    args = ap.parse_args(argv)
    try:
        out = write_tokenizer(args.model, args.force)
    except (OSError, ValueError, KeyError) as e:
        print(f"exl3serve-make-tokenizer: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} and {out.parent / 'tokenizer_config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

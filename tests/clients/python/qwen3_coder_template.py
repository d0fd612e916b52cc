"""A chat template in the layout of Qwen3-Coder's and the later Qwen templates' tool calls (the
qwen3_coder format: docs/frontend.md, Tool calls), for tests: the test families' Qwen template
writes hermes calls. Written here, in our words, from the published templates' layout:

- an assistant turn's calls after its content ("\\n\\n" first where the content is not blank),
  each `<tool_call>\\n<function=NAME>\\n`, per argument `<parameter=K>\\nV\\n</parameter>\\n`, then
  `</function>\\n</tool_call>`, later calls after a "\\n"; V an object's or a list's JSON
  (`tojson`), any other value as Jinja's `string` filter writes it (`True`, `None`, `2`);
- consecutive `tool` results in one user turn, each `\\n<tool_response>\\n…\\n</tool_response>`;
- the tools in the system turn, each as `<function>` with its name, description and parameters.

with_qwen3_coder_template(model_dir) puts it into a model directory's tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_CODER_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] in ['system', 'developer'] %}"
    "{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}# Tools{{ '\\n\\n' }}You can call these "
    "functions:{{ '\\n\\n' }}<tools>{% for t in tools %}{% set f = t['function'] %}{{ '\\n' }}"
    "<function>{{ '\\n' }}<name>{{ f['name'] }}</name>{{ '\\n' }}<description>"
    "{{ f['description'] or '' }}</description>{{ '\\n' }}<parameters>"
    "{{ (f['parameters'] or {}) | tojson }}</parameters>{{ '\\n' }}</function>{% endfor %}"
    "{{ '\\n' }}</tools>{{ '\\n\\n' }}To call a function, reply in this format:{{ '\\n\\n' }}"
    "<tool_call>{{ '\\n' }}<function=example_function_name>{{ '\\n' }}"
    "<parameter=example_parameter_1>{{ '\\n' }}value_1{{ '\\n' }}</parameter>{{ '\\n' }}"
    "</function>{{ '\\n' }}</tool_call><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% if m['role'] in ['system', 'developer'] %}{% if not (tools and loop.first) %}"
    "<|im_start|>system{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != "
    "'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m['content'] }}"
    "{{ '\\n' }}</tool_response>{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined "
    "else c %}{% if not loop.first %}{{ '\\n' }}{% elif m['content'] | trim %}{{ '\\n\\n' }}"
    "{% endif %}<tool_call>{{ '\\n' }}<function={{ f['name'] }}>{{ '\\n' }}"
    "{% for k, v in f['arguments'].items() %}<parameter={{ k }}>{{ '\\n' }}"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
    "{{ '\\n' }}</parameter>{{ '\\n' }}{% endfor %}</function>{{ '\\n' }}</tool_call>{% endfor %}"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def with_qwen3_coder_template(model_dir: Path) -> Path:
    """The model directory (a Qwen tokenizer's) with this template as its chat template."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = QWEN3_CODER_TEMPLATE
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return model_dir

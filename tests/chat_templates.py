"""Chat templates written the way published checkpoints write them, for tokenizer folders built in tests."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.engine.loading.model_store import resolve_model

# Llama 3.1 style: system message pulled out, a date from strftime_now, bos_token from the special tokens, trim.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2.5 style: a default system prompt, tools rendered with tojson, im_start/im_end turns.
QWEN2 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 2 / Mistral style: refuses conversations whose roles do not alternate.
ALTERNATING = """{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}
    {%- else %}{{ message['content'] + eos_token }}{% endif %}
{%- endfor %}
"""


def tokenizer_dir(path: Path, template: str | None, *, as_jinja_file: bool, bos: str | None = None) -> Path:
    """The default model's tokenizer with `template` in chat_template.jinja or in tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    src = resolve_model(None).tokenizer_dir
    (path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    if bos is not None:
        config["bos_token"] = bos
    if template is not None and not as_jinja_file:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and as_jinja_file:
        (path / "chat_template.jinja").write_text(template)
    return path


def conversation(turns: int, system: bool) -> list[dict[str, str]]:
    """`turns` user messages with assistant answers between them, ending on a user message."""
    messages = [{"role": "system", "content": "  You answer briefly; ünïcödé and émojis 🙂 are fine.\n"}] if system else []
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"Answer {turn}: Paris.\n\n  "})
        messages.append({"role": "user", "content": f"Question {turn + 1}: what is the capital of France?"})
    return messages

"""Chat templates that render tools, assistant tool calls and tool results the way each model family's published
template does (Qwen 2.5 / Hermes, Llama 3.1 JSON, Mistral v3, Llama 3.2 pythonic, Qwen3-Coder XML), around SmolLM2's own turn
markers where the family has none of its own in SmolLM2's vocabulary. Each one is paired with its parser name."""

from __future__ import annotations

# Qwen's ChatML frame, shared by the Hermes (Qwen 2.5 / 3) and Qwen3-Coder templates: the system turn's opening,
# and, after each family's assistant turn (its calls in its own format), tool results as <tool_response> blocks in
# one user turn, other roles as they are, and the generation prompt.
_QWEN_SYSTEM = """{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
"""
_QWEN_TURNS = """        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

HERMES = _QWEN_SYSTEM + """{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with '
        'function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
""" + _QWEN_TURNS

LLAMA3_JSON = """{{- '<|im_start|>system\\nEnvironment: ipython\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- set ns = namespace(tools_written=false) %}
{%- for message in messages %}
    {%- if message.role == 'user' and tools and not ns.tools_written %}
        {%- set ns.tools_written = true %}
        {{- '<|im_start|>user\\nGiven the following functions, please respond with a JSON for a function call with '
            'its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function '
            'name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
        {%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
        {{- message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
            {%- if not loop.last %}{{- '; ' }}{%- endif %}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>ipython\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {%- if call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with '
                                                                'length 9!') }}{%- endif %}
            {{- '{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson }}
            {{- ', "id": "' + call.id + '"}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' + message.tool_call_id }}
        {{- '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, assistant and tool roles are supported') }}
    {%- endif %}
{%- endfor %}
"""

PYTHONIC = """{{- '<|im_start|>system\\nYou are an expert in composing functions. You are given a question and a set of '
    'possible functions. If you decide to invoke any of the function(s), you MUST put it in the format of '
    '[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. You SHOULD NOT '
    'include any other text in the response if you call a function.' }}
{%- if tools %}
    {{- '\\nHere is a list of functions in JSON format that you can invoke.\\n' + tools | tojson(indent=4) }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n[' }}
        {%- for call in message.tool_calls %}
            {{- call.function.name + '(' }}
            {%- for name, value in call.function.arguments.items() %}
                {{- name + '=' + value | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>ipython\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

QWEN3_CODER = _QWEN_SYSTEM + """{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n<function>\\n<name>' + tool.function.name + '</name>' }}
        {%- if tool.function.description %}{{- '\\n<description>' + tool.function.description + '</description>' }}{%- endif %}
        {{- '\\n<parameters>' }}
        {%- for name, spec in (tool.function.parameters.properties or {}).items() %}
            {{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + (spec.type or 'string') + '</type>' }}
            {%- if spec.enum %}{{- '\\n<enum>' + spec.enum | tojson + '</enum>' }}{%- endif %}
            {{- '\\n</parameter>' }}
        {%- endfor %}
        {{- '\\n</parameters>\\n</function>' }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n'
        '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n'
        '</function>\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
            {%- for name, value in call.function.arguments.items() %}
                {{- '<parameter=' + name + '>\\n' }}
                {%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
""" + _QWEN_TURNS

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL, "pythonic": PYTHONIC,
             "qwen3_coder": QWEN3_CODER}

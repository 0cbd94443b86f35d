"""The Qwen-style ChatML template shared by every embedded tiny model.

It follows Qwen3's template (the `# Tools` system block, `<tool_call>` rendering,
consecutive `tool` messages grouped into one user turn of `<tool_response>`s)
with two deliberate differences:

- earlier assistant turns are rendered verbatim, `<think>` blocks included, so
  appending turns one by one yields exactly the tokens of a full re-render (the
  rollout manager builds observations from the chat-template delta);
- content may be a string or a list of text / image / audio / video parts; media
  parts become the placeholders the Qwen3-VL, Qwen2-Audio and Qwen3-Omni processors expand.

Every tag trims the whitespace around it, so only the quoted strings are output.
"""

CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type == 'image' -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'audio' -%}
                {{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}
            {%- elif part.type == 'video' -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}

{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content is string -%}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- else -%}
                {{- call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()

#: chat templates that `--chat-template` / `model.chat_template` take by name instead of a file: "chatml-tools" is
#: this template, for ChatML checkpoints whose own template ignores `tools` (SmolLM2's): the schemas go in the
#: system turn and calls come back as `<tool_call>` JSON, as Qwen2.5 / Hermes models write them
BUNDLED_TEMPLATES: dict[str, str] = {"chatml-tools": CHAT_TEMPLATE}

#!/usr/bin/env python3
"""Generate the chat-template / loss-mask / tiktoken parity fixtures under tests/fixtures/chat/.

Run by hand (not in CI) from the repository root:

    venv/bin/python scripts/make_chat_fixtures.py      # add -v for a per-conversation summary

Needs transformers 5.x, tokenizers, tiktoken and jinja2; nothing is downloaded (no hub, no network).
The output is deterministic: running it twice gives the same bytes. It (re)writes:

  tests/fixtures/chat/
    tokenizer.json, tokenizer_config.json
        A byte-level BPE (GPT-2 style ByteLevel pre-tokenizer and decoder, no normalizer, no
        post-processor) trained by `tokenizers` on CORPUS below: 256 byte tokens (ids 0..255, in
        the ByteLevel alphabet's character order) + 144 merges (ids 256..399), then the added
        tokens SPECIAL (special=True, ids 400..409) and NON_SPECIAL (special=False, ids 410..415).
        bos <|begin_of_text|>, eos <|im_end|>, pad <|endoftext|>.
    templates/{llama3,llama3_2,chatml,qwen3,generation}.jinja
        Real chat templates, byte for byte (see TEMPLATE_SOURCES), plus a ChatML template with
        {% generation %} markers for transformers' return_assistant_tokens_mask. llama3 is the
        original Llama 3.1 Instruct template (builtin_tools, <|python_tag|>, <|eom_id|>, fixed
        date_string "26 Jul 2024"); it never calls strftime_now, so the Llama 3.2 template (which
        does) is here too, with expected outputs for the OpenAI style only.
    conversations.sharegpt.jsonl, conversations.openai.jsonl
        The same 14 conversations in both styles, one {"id": ...} per line (see CONVERSATIONS:
        ShareGPT carries reasoning inline as <think>..</think> and tool calls as <tool_call> text).
    expected/{llama3,chatml,qwen3}.{sharegpt,openai}.jsonl, expected/llama3_2.openai.jsonl
        One line per input conversation, in input order:
        {"id", "skip", "error", "stable", "per_turn", "per_conversation", "auto"} computed by the
        render-boundary algorithm (see boundary_rows) on transformers' rendering and tokenisation.
    expected/chatml.openai.max48.jsonl
        The same for max_seq_len = 48, plus "long_prompt_turns" (see max_len_record).
    expected/generation.{sharegpt,openai}.jsonl
        transformers' assistant_masks ("input_ids", "loss_mask") beside the boundary outputs.
    tiktoken/tiktoken.model, tiktoken/tokenizer_config.json, tiktoken/pattern.txt, tiktoken/expected.jsonl
        The same BPE in tiktoken's format (ranks 0..255 the single bytes, then merges in merge
        order), Kimi-K2-style special tokens and Kimi's pat_str, with tiktoken's own
        encode(text, allowed_special="all") of tiktoken_texts(). As in Kimi's tokenization_kimi.py,
        ids len(ranks)..len(ranks)+255 are special: the ones named in added_tokens_decoder, the
        rest "<|reserved_token_{id}|>" with the absolute id (e.g. <|reserved_token_405|>).

Reference conventions (what the Rust side must reproduce):
  * roles: human/user -> user, gpt/assistant -> assistant, system -> system, tool -> tool,
    anything else -> assistant. OpenAI messages keep their other keys (tool_calls,
    reasoning_content, name, tool_call_id); ShareGPT messages are {role, content}.
  * trailing non-assistant turns are dropped; a conversation with no messages is skipped as
    "empty", one with no assistant turn as "no-assistant".
  * rendering: tok.apply_chat_template(msgs, chat_template=TEXT, tokenize=False,
    add_generation_prompt=..., tools=tools or None); ids = tok(text, add_special_tokens=False).
  * strftime_now renders datetime.date(2026, 1, 15) (only llama3_2.jinja calls it:
    "15 Jan 2026"). transformers 5.x turns callable template kwargs into the string
    "<function>", so the date is fixed by patching the datetime its built-in strftime_now uses.
  * transformers' assistant_masks: a token is 1 when its character offsets overlap a
    {% generation %} span; here the "\n" after <|im_end|> lies outside the span (0) but inside
    the boundary algorithm's row suffix (1), and an assistant turn at index 0 is 1 there only.
"""
import base64
import copy
import datetime
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

# One thread for the BPE trainer; its result does not depend on it, but be safe.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# No tiktoken file cache (it would serve a stale tiktoken.model from an earlier run).
os.environ["TIKTOKEN_CACHE_DIR"] = ""

import jinja2  # noqa: E402
import tiktoken  # noqa: E402
import tiktoken.load  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import chat_template_utils  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"

FIXED_DATE = datetime.date(2026, 1, 15)
MAX_SEQ_LEN = 48
VOCAB_SIZE = 400  # 256 byte tokens + 144 merges

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|eom_id|>", "<|python_tag|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
NON_SPECIAL = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ---------------------------------------------------------------------------------------------
# Training text for the BPE (a few KB: English, French/German, Chinese, emoji, code, numbers).
# Sections are separated by lines holding only "%%"; each section is one training sequence.
# ---------------------------------------------------------------------------------------------
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog does not mind; it is a very lazy dog.
You are a helpful assistant. Answer the question of the user as well as you can, and keep
the answer short. If you do not know the answer, say that you do not know it.
What is the capital of France? The capital of France is Paris. What is the capital of Germany?
The capital of Germany is Berlin. Thank you! You're welcome. I'm happy to help.
%%
Hello! How can I help you today? Hi there, I would like to know the weather in Paris.
The weather in Paris is clear and the temperature is 18 degrees. It is a nice day for a walk.
Can you tell me a joke? Why did the chicken cross the road? To get to the other side!
Tell me another one, please. I don't have another one, but I can try to write a poem for you.
%%
Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024

You have access to the following functions. To call a function, please respond with JSON
for a function call with its proper arguments that best answers the given prompt.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
Do not use variables.
%%
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within XML tags:
{"name": "get_weather", "arguments": {"city": "Paris"}}
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
%%
Given the following functions, please respond with a JSON for a function call with its proper
arguments that best answers the given prompt. The function returns the weather in the city.
{
    "function": {
        "description": "Get the weather in a city",
        "name": "get_weather",
        "parameters": {
            "properties": {
                "city": {
                    "type": "string"
                }
            },
            "required": [
                "city"
            ],
            "type": "object"
        }
    },
    "type": "function"
}
{"sky": "clear", "temp_c": 18} {"type": "function", "function": {"name": "get_weather"}}
%%
system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
user
Hi! What is the weather in Paris?
assistant
Hello! The weather in Paris is clear.
system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
user
Tell me a joke.
assistant
Why did the chicken cross the road?
system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
user
Thank you!
assistant
You're welcome.
system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
user
What is 7 * 6?
assistant
7 * 6 = 42.
%%
Bonjour ! Ça va très bien, merci. Où est la gare ? Elle est à côté du café, près de l'église.
Le garçon a mangé une crème brûlée à Noël. Les élèves étudient le français et l'allemand.
Guten Tag! Wie geht es Ihnen? Mir geht es gut, danke. Grüße aus München und Köln.
Die Straße ist schön, aber das Wetter ist schlecht. Übung macht den Meister. Äpfel und Öl.
%%
你好，世界！今天天气很好。我们一起去公园散步吧。
中文是一种很有意思的语言。我喜欢学习新的知识。
这是一个测试句子，用来训练分词器。谢谢你的帮助！
北京是中国的首都。上海是一个很大的城市。
%%
Emoji time: 😀 😃 😄 😁 😆 👍 👍🏽 🎉 🚀 ❤️ 🇫🇷 🇩🇪 🇨🇳 ✨ 🙂 🙃 🤖 🐍 🦀
I love it! 😀🎉 Great job 👍 Ship it 🚀 Rust 🦀 and Python 🐍 work together.
%%
def add(a, b):
    return a + b


def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


for i in range(10):
    print(i, add(i, i), fibonacci(i))
%%
fn main() {
    let numbers = vec![1, 2, 3, 4, 5];
    let total: i32 = numbers.iter().sum();
    println!("total = {}", total);
}
%%
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2024 2025 2026 12345678 3.14159 2.71828
The answer is 42. In 2024 there were 366 days; 2025 has 365 days. 1,000,000 is one million.
2 + 2 = 4, 7 * 6 = 42, 17 is prime, 21 = 3 * 7, 100 / 4 = 25, 3.5 + 1.5 = 5.
"""

# ---------------------------------------------------------------------------------------------
# Templates. Each text is byte-identical to its source file (checked by sha256 for the copies).
# ---------------------------------------------------------------------------------------------
TRL = "huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8"
TEMPLATE_SOURCES = {
    "llama3": f"{TRL}: trl/chat_templates/llama3_1.jinja (original Llama 3.1 Instruct template)",
    "llama3_2": f"{TRL}: trl/chat_templates/llama3_2.jinja (original Llama 3.2 Instruct template)",
    "chatml": f"{TRL}: trl/chat_templates/qwen2_5.jinja (original Qwen2.5 Instruct template)",
    "qwen3": f"{TRL}: trl/chat_templates/qwen3.jinja (original Qwen3 template)",
    "generation": "huggingface/transformers tests/test_tokenization_common.py "
                  "(test_chat_template_return_assistant_tokens_mask dummy_template) "
                  "+ a ChatML add_generation_prompt clause",
}
TEMPLATE_SHA256 = {
    "llama3": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "llama3_2": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    "chatml": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
}

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA3_2_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# transformers' test template, with the Jinja "\n" escape instead of a raw newline inside the
# string literals (same output), and a generation prompt so the boundary algorithm has a prompt.
# The "\n" after <|im_end|> is outside {% generation %}: the two masks differ there.
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] != 'assistant') %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant')%}"
    "{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% generation %}"
    "{{message['content'] + '<|im_end|>'}}"
    "{% endgeneration %}"
    "{{'\\n'}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
)

TEMPLATES = {
    "llama3": LLAMA3_TEMPLATE,
    "llama3_2": LLAMA3_2_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
    "qwen3": QWEN3_TEMPLATE,
    "generation": GENERATION_TEMPLATE,
}
BOUNDARY_TEMPLATES = ["llama3", "llama3_2", "chatml", "qwen3"]

# ---------------------------------------------------------------------------------------------
# Conversations, OpenAI style. The ShareGPT copies come from to_sharegpt(). Dict keys of tools
# and arguments are in sorted order, so sorted and insertion-ordered JSON maps render the same.
# ---------------------------------------------------------------------------------------------
WEATHER_TOOL = {
    "function": {
        "description": "Get the weather in a city",
        "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
    },
    "type": "function",
}


def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


CONVERSATIONS = [
    {"id": "single", "messages": [u("Hi!"), a("Hello! How can I help you today? Ask me anything.")]},
    {"id": "multi", "messages": [
        u("What is the capital of France?"), a("Paris."),
        u("And of Germany?"), a("Berlin."),
        u("Thank you!"), a("You're welcome.")]},
    {"id": "system", "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        u("Tell me a joke."), a("Why did the chicken cross the road? To get to the other side!")]},
    {"id": "unicode", "messages": [
        u("Ça va? Grüße aus München! 你好，世界 👋🏽 Cafe\u0301 ñ"),
        a("Très bien, danke! 我很好 😀🎉 Zoë, naïve, e\u0301\u0300.")]},
    {"id": "empty-turns", "messages": [
        u(""), a("Hello? Your message was empty."),
        u("Reply with nothing."), a(""),
        u("Thanks."), a("You're welcome.")]},
    {"id": "assistant-first", "messages": [
        a("Hi! I am a test bot."), u("What is 7 * 6?"), a("7 * 6 = 42.")]},
    {"id": "trailing-user", "messages": [
        u("Is 2 + 2 = 4?"), a("Yes."), u("One more thing...")]},
    {"id": "no-assistant", "messages": [
        {"role": "system", "content": "You are a helpful assistant."}, u("Hello?")]},
    {"id": "empty", "messages": []},
    {"id": "unknown-role", "messages": [
        u("Tell me a joke."), a("Why did the chicken cross the road?"),
        {"role": "narrator", "content": "To get to the other side!"}]},
    {"id": "reasoning", "messages": [
        u("Is 17 prime?"),
        a("Yes, 17 is prime.", reasoning_content="Check 2, 3 and 4: none divides 17."),
        u("And 21?"),
        a("No: 21 = 3 * 7.", reasoning_content="21 = 3 * 7.")]},
    {"id": "tools", "tools": [WEATHER_TOOL], "messages": [
        u("What is the weather in Paris?"),
        a("", tool_calls=[{"id": "call_0", "type": "function",
                           "function": {"arguments": {"city": "Paris"}, "name": "get_weather"}}]),
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": '{"sky": "clear", "temp_c": 18}'},
        a("It is 18 °C and clear in Paris.")]},
    {"id": "code", "messages": [
        u("Write a Python function that adds two numbers."),
        a("```python\ndef add(a, b):\n    return a + b\n```\n\nadd(12345678, 3.14159)")]},
    {"id": "whitespace", "messages": [
        u("  Spaces around me.  "), a("    Four leading spaces, three trailing.   "),
        u("\tTab\n"), a("\n\nLeading newlines.")]},
]

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}


def to_sharegpt(conv):
    """ShareGPT copy: reasoning inline as <think>...</think>, tool calls as Hermes <tool_call> text,
    an unknown role as "from": "bot", no tools field."""
    out = []
    for m in conv["messages"]:
        value = m["content"]
        if m.get("reasoning_content"):
            value = "<think>\n" + m["reasoning_content"] + "\n</think>\n\n" + value
        for call in m.get("tool_calls", []):
            f = call["function"]
            text = "<tool_call>\n" + json.dumps({"name": f["name"], "arguments": f["arguments"]}) + "\n</tool_call>"
            value = value + "\n" + text if value else text
        out.append({"from": SHAREGPT_FROM.get(m["role"], "bot"), "value": value})
    return {"id": conv["id"], "conversations": out}


# ---------------------------------------------------------------------------------------------
# tiktoken / Kimi-K2
# ---------------------------------------------------------------------------------------------
# Kimi-K2's tokenization_kimi.py (TikTokenTokenizer.pat_str), verbatim.
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
# Offsets from len(ranks), as in Kimi-K2-Instruct's tokenizer_config.json (163584 + offset).
KIMI_NAMED = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    254: "[UNK]", 255: "[PAD]",
}


def tiktoken_texts(n_ranks):
    return [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "don't, can't, it's, we've, they're, I'm, you'd",
        "I'LL DON'T SHE'S We'Re",
        "MixedCASEWords likeThis AndTHAT camelCase HTTPServer",
        "你好世界",
        "中文和English混合text，还有数字123",
        "Kimi是一个AI助手。它会说中文。",
        "日本語のテキストとカタカナ",
        "한국어 텍스트",
        "12345678",
        "3.14159 and 1,000,000 and 2026-01-15",
        "\n\n  \n",
        "   leading spaces",
        "trailing spaces   ",
        "tabs\tand\r\nCRLF\r\n",
        "a  b   c    d",
        "!!!???... (a+b)*c = d; {x: [1, 2]}",
        "emoji 😀👍🏽 🇫🇷 ❤️ 🦀",
        "Ça va? Grüße aus München, naïve café",
        "Cafe\u0301 e\u0301\u0300 combining marks",
        "ΑΒΓ αβγ Привет мир",
        "ＡＢＣ全角１２３",
        "def add(a, b):\n    return a + b\n",
        "<|im_user|>hi<|im_end|>",
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_assistant|>assistant<|im_middle|>",
        "[BOS]text[EOS][PAD][UNK]",
        f"<|reserved_token_{n_ranks + 5}|> is special, <|reserved_token_5|> is not",
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "<|im_end",
        "",
    ]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def write_bytes(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_text(path, text):
    write_bytes(path, text.encode("utf-8"))


def write_jsonl(path, rows):
    write_text(path, "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows))


def write_json(path, obj):
    write_text(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def bytes_to_unicode():
    """GPT-2's byte <-> printable-character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(FIXED_DATE.year, FIXED_DATE.month, FIXED_DATE.day)


# ---------------------------------------------------------------------------------------------
# 1. Tokenizer
# ---------------------------------------------------------------------------------------------
def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    sections = [s.strip("\n") + "\n" for s in CORPUS.split("%%\n")]
    tok.train_from_iterator(sections, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    assert tok.get_vocab_size() == VOCAB_SIZE + len(SPECIAL) + len(NON_SPECIAL) < 500
    data = json.loads(tok.to_str())
    assert data["normalizer"] is None and data["post_processor"] is None
    write_text(OUT / "tokenizer.json", json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    write_json(OUT / "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    return data


def load_hf_tokenizer():
    tok = AutoTokenizer.from_pretrained(str(OUT))
    direct = PreTrainedTokenizerFast(tokenizer_file=str(OUT / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    raw = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    probe = "<|im_start|>user\nHi <think>x</think> 你好 😀<|im_end|>\n  \n"
    ids = tok(probe, add_special_tokens=False)["input_ids"]
    assert ids == direct(probe, add_special_tokens=False)["input_ids"] == raw.encode(probe, add_special_tokens=False).ids
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    return tok, raw


# ---------------------------------------------------------------------------------------------
# 2./4. Rendering and the reference
# ---------------------------------------------------------------------------------------------
CANON_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "system": "system", "tool": "tool"}


def normalise(style, row):
    """-> (messages, tools, skip)"""
    if style == "sharegpt":
        raw = row["conversations"]
        msgs = [{"role": CANON_ROLE.get(m["from"], "assistant"), "content": m["value"]} for m in raw]
        tools = None
    else:
        raw = row["messages"]
        msgs = []
        for m in raw:
            msg = {"role": CANON_ROLE.get(m["role"], "assistant"), "content": m["content"]}
            msg.update({k: v for k, v in m.items() if k not in ("role", "content") and v is not None})
            # As speculators does: reasoning under either key is given under both.
            reasoning = msg.get("reasoning_content", msg.get("thinking"))
            if reasoning is not None:
                msg["reasoning_content"] = msg["thinking"] = reasoning
            msgs.append(msg)
        tools = row.get("tools")
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not raw:
        return [], tools, "empty"
    if not msgs:
        return [], tools, "no-assistant"
    return msgs, tools, None


class Renderer:
    def __init__(self, tok, raw, template):
        self.tok, self.raw, self.template = tok, raw, template

    def text(self, msgs, gen, tools):
        return self.tok.apply_chat_template(copy.deepcopy(msgs), chat_template=self.template, tokenize=False,
                                            add_generation_prompt=gen, tools=copy.deepcopy(tools))

    def ids(self, msgs, gen, tools):
        text = self.text(msgs, gen, tools)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        assert ids == self.raw.encode(text, add_special_tokens=False).ids, "transformers and tokenizers disagree"
        return ids


def is_prefix(p, s):
    return len(p) <= len(s) and s[:len(p)] == p


def common_prefix(p, s):
    n = 0
    while n < min(len(p), len(s)) and p[n] == s[n]:
        n += 1
    return n


def boundary_rows(r, msgs, tools, max_len=None):
    """-> ([(j, row_ids, boundary, prompt_len)], long_turns, error). One row per assistant turn at index j > 0.
    With max_len, a turn whose prompt (its generation-prompt render) has >= max_len tokens is left out before its
    row is rendered or checked, as speculators skips it; it is listed in long_turns."""
    rows, long_turns = [], []
    for j, m in enumerate(msgs):
        if m["role"] != "assistant" or j == 0:
            continue
        try:
            prompt = r.ids(msgs[:j], True, tools)
            if max_len is not None and len(prompt) >= max_len:
                long_turns.append(j)
                continue
            row = r.ids(msgs[:j + 1], False, tools)
            if is_prefix(prompt, row):
                boundary = len(prompt)
            else:
                # speculators' fallback: the common prefix, valid only when the history rendered
                # without the generation prompt starts the row and ends within the common prefix.
                boundary = common_prefix(prompt, row)
                hist = r.ids(msgs[:j], False, tools)
                if not is_prefix(hist, row) or boundary < len(hist):
                    return [], [], f"turn {j}: neither the prompt nor the rendered history is a token prefix of the row"
        except jinja2.TemplateError as e:
            return [], [], f"turn {j}: template error: {e}"
        rows.append((j, row, boundary, len(prompt)))
    return rows, long_turns, None


def mask_of(row, boundary):
    return [0] * boundary + [1] * (len(row) - boundary)


def union(rows, length):
    out = [0] * length
    for _, row, b, _ in rows:
        for i, bit in enumerate(mask_of(row, b)):
            out[i] |= bit
    return out


def is_stable(rows):
    last = rows[-1][1]
    return all(is_prefix(row, last) for _, row, _, _ in rows)


def record(conv_id, skip, rows, error):
    rec = {"id": conv_id, "skip": skip, "error": error, "stable": False, "per_turn": [], "per_conversation": None,
           "auto": []}
    if skip or error or not rows:
        return rec
    per_turn = [{"turn": j, "input_ids": row, "loss_mask": mask_of(row, b)} for j, row, b, _ in rows]
    stable = is_stable(rows)
    per_conv = None
    if stable:
        last = rows[-1][1]
        per_conv = {"input_ids": last, "loss_mask": union(rows, len(last))}
    rec.update(stable=stable, per_turn=per_turn, per_conversation=per_conv,
               auto=[per_conv] if stable else per_turn)
    return rec


def max_len_record(conv_id, skip, r, msgs, tools, max_len):
    """Length-limited variant: a turn whose prompt (its generation-prompt render) has >= max_len tokens gives no row
    (listed in long_prompt_turns) and is not rendered further, as speculators skips it; rows and masks are cut on the
    right to max_len tokens. The rows are stable when every kept turn's row, cut to max_len, starts the whole
    conversation's row (through its last assistant turn) cut to max_len: past the limit nothing is stored.
    per_conversation is that cut row with the union of the kept turns' masks (null when no turn is kept)."""
    rec = {"id": conv_id, "skip": skip, "error": None, "long_prompt_turns": [], "stable": False, "per_turn": [],
           "per_conversation": None, "auto": []}
    if skip:
        return rec
    kept, long_turns, error = boundary_rows(r, msgs, tools, max_len)
    rec["error"] = error
    if error or not (kept or long_turns):
        return rec
    rec["long_prompt_turns"] = long_turns
    per_turn = [{"turn": j, "input_ids": row[:max_len], "loss_mask": mask_of(row, b)[:max_len]}
                for j, row, b, _ in kept]
    last_turn = max(j for j, m in enumerate(msgs) if m["role"] == "assistant")
    last = r.ids(msgs[:last_turn + 1], False, tools)
    stable = all(is_prefix(row[:max_len], last[:max_len]) for _, row, _, _ in kept)
    per_conv = None
    if stable and kept:
        per_conv = {"input_ids": last[:max_len], "loss_mask": union(kept, len(last))[:max_len]}
    rec.update(stable=stable, per_turn=per_turn, per_conversation=per_conv,
               auto=[per_conv] if stable else per_turn)
    return rec


# ---------------------------------------------------------------------------------------------
# 5. tiktoken
# ---------------------------------------------------------------------------------------------
def build_tiktoken(tok_data):
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def raw_bytes(token):
        return bytes(byte_of[c] for c in token)

    ranks = {bytes([b]): b for b in range(256)}
    for merge in tok_data["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        lb, rb = raw_bytes(left), raw_bytes(right)
        token = lb + rb
        assert lb in ranks and rb in ranks, merge
        if token not in ranks:
            ranks[token] = len(ranks)
            assert ranks[lb] < ranks[token] and ranks[rb] < ranks[token]
    assert len(ranks) == VOCAB_SIZE, len(ranks)
    n = len(ranks)

    model_path = OUT / "tiktoken" / "tiktoken.model"
    lines = [base64.b64encode(t).decode("ascii") + " " + str(r) for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    write_text(model_path, "\n".join(lines) + "\n")
    assert tiktoken.load.load_tiktoken_bpe(str(model_path)) == ranks

    added_tokens_decoder = {
        str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                       "special": True}
        for off, name in sorted(KIMI_NAMED.items())
    }
    write_json(OUT / "tiktoken" / "tokenizer_config.json", {
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 131072,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    })
    write_text(OUT / "tiktoken" / "pattern.txt", KIMI_PAT)

    # tokenization_kimi.py: {special_tokens_mapping.get(i, f"<|reserved_token_{i}|>"): i
    #                        for i in range(num_base_tokens, num_base_tokens + num_reserved_special_tokens)}
    mapping = {int(i): v["content"] for i, v in added_tokens_decoder.items()}
    special = {mapping.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
    assert len(special) == NUM_RESERVED_SPECIAL_TOKENS
    enc = tiktoken.Encoding(name="strata-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=special)
    rows = []
    for text in tiktoken_texts(n):
        ids = enc.encode(text, allowed_special="all")
        assert enc.decode(ids) == text
        rows.append({"text": text, "ids": ids})
    write_jsonl(OUT / "tiktoken" / "expected.jsonl", rows)


# ---------------------------------------------------------------------------------------------
def main():
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__
    # transformers' built-in strftime_now calls chat_template_utils.datetime.now(); fix the date.
    chat_template_utils.datetime = FixedDatetime

    if OUT.exists():
        shutil.rmtree(OUT)
    tok_data = build_tokenizer()
    tok, raw = load_hf_tokenizer()

    for name, text in TEMPLATES.items():
        if name in TEMPLATE_SHA256:
            assert hashlib.sha256(text.encode("utf-8")).hexdigest() == TEMPLATE_SHA256[name], name
        write_text(OUT / "templates" / f"{name}.jinja", text)

    styles = {
        "openai": [{k: c[k] for k in ("id", "messages", "tools") if k in c} for c in CONVERSATIONS],
        "sharegpt": [to_sharegpt(c) for c in CONVERSATIONS],
    }
    for style, rows in styles.items():
        write_jsonl(OUT / f"conversations.{style}.jsonl", rows)

    summary = []
    for style in ("sharegpt", "openai"):
        rows = [json.loads(line) for line in (OUT / f"conversations.{style}.jsonl").read_text("utf-8").splitlines()]
        normalised = [(row["id"],) + normalise(style, row) for row in rows]
        for name in BOUNDARY_TEMPLATES + ["generation"]:
            if name == "llama3_2" and style != "openai":
                continue  # only here for strftime_now; one style is enough
            r = Renderer(tok, raw, TEMPLATES[name])
            out, out48 = [], []
            for conv_id, msgs, tools, skip in normalised:
                brows, _, error = boundary_rows(r, msgs, tools) if not skip else ([], [], None)
                rec = record(conv_id, skip, brows, error)
                if name == "generation":
                    gen = {"id": conv_id, "skip": skip, "input_ids": None, "loss_mask": None}
                    if not skip:
                        enc = tok.apply_chat_template(copy.deepcopy(msgs), chat_template=r.template, tokenize=True,
                                                      return_dict=True, return_assistant_tokens_mask=True,
                                                      add_generation_prompt=False, tools=copy.deepcopy(tools))
                        assert list(enc["input_ids"]) == r.ids(msgs, False, tools)
                        gen["input_ids"], gen["loss_mask"] = list(enc["input_ids"]), list(enc["assistant_masks"])
                    rec = {**gen, **{k: v for k, v in rec.items() if k not in ("id", "skip")}}
                out.append(rec)
                if name == "chatml" and style == "openai":
                    out48.append(max_len_record(conv_id, skip, r, msgs, tools, MAX_SEQ_LEN))
                lens = [len(row) for _, row, _, _ in brows]
                summary.append((name, style, conv_id, skip, error, rec["stable"], lens))
            write_jsonl(OUT / "expected" / f"{name}.{style}.jsonl", out)
            if out48:
                write_jsonl(OUT / "expected" / f"chatml.openai.max{MAX_SEQ_LEN}.jsonl", out48)

    build_tiktoken(tok_data)

    if "-v" in sys.argv:
        for s in summary:
            print(*s)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {sum(1 for p in OUT.rglob('*') if p.is_file())} files, {total} bytes under {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

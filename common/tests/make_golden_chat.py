"""Writes the chat-template golden strings that common/src/text/chat_template.rs checks.

Each case's messages go to golden_chat/cases.json, and the prompt that
transformers' apply_chat_template(..., tokenize=False) renders for it goes to
golden_chat/<name>.txt, byte for byte.

Run with the project's venv:
    .venv/bin/python common/tests/make_golden_chat.py [MODEL_DIR]
MODEL_DIR defaults to $SLUICE_MODEL_DIR, $SLUICE_CACHE/models/SmolLM2-135M-Instruct,
then ~/.cache/sluice/models/SmolLM2-135M-Instruct.
"""

import json
import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

MODEL = "SmolLM2-135M-Instruct"
OUT_DIR = Path(__file__).resolve().parent / "golden_chat"

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER_AGAIN = {"role": "user", "content": "And of Japan? Answer in Japanese too: 日本の首都は？"}

CASES = [
    ("user_only", [USER], False),
    ("user_only_generation_prompt", [USER], True),
    ("system_user", [SYSTEM, USER], False),
    ("system_user_generation_prompt", [SYSTEM, USER], True),
    ("multi_turn_generation_prompt", [USER, ASSISTANT, USER_AGAIN], True),
    ("system_multi_turn_generation_prompt", [SYSTEM, USER, ASSISTANT, USER_AGAIN], True),
    ("system_multi_turn", [SYSTEM, USER, ASSISTANT], False),
    (
        "whitespace_and_unicode_generation_prompt",
        [{"role": "user", "content": "  leading and trailing spaces \n\n👋🏽 e\u0301 مرحبا\t"}],
        True,
    ),
    ("empty_content_generation_prompt", [{"role": "user", "content": ""}], True),
]


def model_dir() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    if "SLUICE_MODEL_DIR" in os.environ:
        return Path(os.environ["SLUICE_MODEL_DIR"])
    if "SLUICE_CACHE" in os.environ:
        return Path(os.environ["SLUICE_CACHE"]) / "models" / MODEL
    return Path.home() / ".cache" / "sluice" / "models" / MODEL


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    OUT_DIR.mkdir(exist_ok=True)
    cases = []
    for name, messages, add_generation_prompt in CASES:
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # newline="" keeps the bytes exactly as rendered on every platform.
        with open(OUT_DIR / f"{name}.txt", "w", encoding="utf-8", newline="") as f:
            f.write(prompt)
        cases.append(
            {"name": name, "messages": messages, "add_generation_prompt": add_generation_prompt}
        )
    with open(OUT_DIR / "cases.json", "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {OUT_DIR}")


if __name__ == "__main__":
    main()

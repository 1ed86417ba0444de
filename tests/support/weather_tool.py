"""The one tool the e2e tests of every API call: get_weather(city), as each API spells a tool."""

from __future__ import annotations

from typing import Any

NAME = "get_weather"
DESCRIPTION = "The current weather in a city"
# A short city name and nothing else, so that a call the schema allows is easy to check.
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}

# Chat completions' tool.
CHAT_TOOL = {
    "type": "function",
    "function": {"name": NAME, "description": DESCRIPTION, "parameters": PARAMETERS},
}
# The Responses API's tool.
RESPONSES_TOOL = {"type": "function", "name": NAME, "description": DESCRIPTION, "parameters": PARAMETERS}
# Anthropic's tool.
ANTHROPIC_TOOL = {"name": NAME, "description": DESCRIPTION, "input_schema": PARAMETERS}

"""Twenty JSON schemas for structured output tests and the benchmark, each with a chat prompt.

Strings and arrays are bounded (maxLength, maxItems), so that every output fits a modest max_tokens:
the test then asserts that each output parses and validates, every time.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "Describe a person.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a city and its country.",
        {
            "type": "object",
            "properties": {"city": NAME, "country": NAME},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "Rate a film from 1 to 5.",
        {
            "type": "object",
            "properties": {"title": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["title", "stars"],
            "additionalProperties": False,
        },
    ),
    (
        "What colour is the sky?",
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue", "grey"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
    ),
    (
        "List up to three fruits.",
        {
            "type": "object",
            "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    (
        "Give the temperature in Celsius.",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
            "additionalProperties": False,
        },
    ),
    (
        "Is water wet?",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 40}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe a book with its author.",
        {
            "type": "object",
            "properties": {
                "book": {
                    "type": "object",
                    "properties": {
                        "title": NAME,
                        "author": {
                            "type": "object",
                            "properties": {"first": NAME, "last": NAME},
                            "required": ["first", "last"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["title", "author"],
                    "additionalProperties": False,
                }
            },
            "required": ["book"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a US zip code.",
        {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a date.",
        {
            "type": "object",
            "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
            "required": ["date"],
            "additionalProperties": False,
        },
    ),
    (
        "Give two points.",
        {
            "type": "object",
            "properties": {
                "points": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "x": {"type": "integer", "minimum": -10, "maximum": 10},
                            "y": {"type": "integer", "minimum": -10, "maximum": 10},
                        },
                        "required": ["x", "y"],
                        "additionalProperties": False,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["points"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe a user account.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "active": {"type": "boolean"},
            },
            "required": ["username", "role", "active"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a product with an optional discount.",
        {
            "type": "object",
            "properties": {
                "product": NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "discount": {"type": "integer", "minimum": 0, "maximum": 90},
            },
            "required": ["product", "price"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a list of numbers.",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5},
    ),
    (
        "Give a hex colour.",
        {
            "type": "object",
            "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
            "required": ["hex"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe the weather.",
        {
            "type": "object",
            "properties": {
                "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                "warnings": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
            },
            "required": ["sky", "wind_kmh", "warnings"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a number or nothing.",
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}
            },
            "required": ["value"],
            "additionalProperties": False,
        },
    ),
    (
        "Give an email address.",
        {
            "type": "object",
            "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}},
            "required": ["email"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe a team of people.",
        {
            "type": "object",
            "properties": {
                "team": NAME,
                "members": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "lead": {"type": "boolean"}},
                        "required": ["name", "lead"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["team", "members"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a version number.",
        {
            "type": "object",
            "properties": {
                "major": {"type": "integer", "minimum": 0, "maximum": 20},
                "minor": {"type": "integer", "minimum": 0, "maximum": 50},
                "tag": {"enum": ["alpha", "beta", "stable"]},
            },
            "required": ["major", "minor"],
            "additionalProperties": False,
        },
    ),
]

assert len(SCHEMAS) == 20

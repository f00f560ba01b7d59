"""What the agent tests ask the tiny agent model (tests/support/tiny_models.py): the
question and the tool schemas, bounded so that random sampling at temperature 1 ends."""

from __future__ import annotations

ASK = [{"role": "user", "content": "What is the weather and the time in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"enum": ["Europe/Paris", "UTC"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}

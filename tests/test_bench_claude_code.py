"""bench.claude_code's pieces that need no server: the request as chat text, the model
with more positions."""

from __future__ import annotations

import json

from bench.claude_code import as_chat, long_variant

REQUEST = {
    "system": [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "Be"}],
    "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<env>"}, {"type": "text", "text": "Q"}],
        }
    ],
}


def test_the_request_becomes_the_same_text_for_both_servers():
    system, question = as_chat(REQUEST)
    assert system.startswith("You are Claude Code.\n\nBe\n\n# Tools\n")
    assert json.loads(system.split("# Tools\n")[1]) == REQUEST["tools"][0]
    assert question == "<env>\nQ"


def test_the_long_variant_links_the_weights_and_raises_the_positions(tmp_path):
    source = tmp_path / "m"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    (source / "model.safetensors").write_bytes(b"weights")
    target = long_variant(source, tmp_path / "long", 32768)
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 32768
    assert (target / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    assert json.loads((source / "config.json").read_text())["max_position_embeddings"] == 8192

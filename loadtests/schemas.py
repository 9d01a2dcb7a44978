"""The shipped structured-output workload: ~20 JSON schemas (loadtests/data/schemas/, objects, enums, arrays,
nesting, $ref, numbers with bounds, strings with patterns), each with a chat prompt built from its
description. Used by the structured-output benchmarks and the SmolLM2 validity test."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMAS_DIR = Path(__file__).parent / "data" / "schemas"


def load_schemas() -> list[dict]:
    """Every shipped schema, by file name."""
    return [json.loads(p.read_text()) for p in sorted(SCHEMAS_DIR.glob("*.json"))]


def chat_messages(schema: dict) -> list[dict[str, str]]:
    """A user turn asking for the schema's description as JSON, the schema shown (it helps a small model
    pick sensible values; the token mask alone guarantees the shape)."""
    return [{"role": "user", "content": f"{schema['description']} Reply with JSON only, following this "
                                        f"schema: {json.dumps(schema)}"}]

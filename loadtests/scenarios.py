"""Scenario names of `attnserve loadtest --scenario` -> Locust user classes in locustfile.py.
Kept apart from the locustfile so the CLI never imports Locust (gevent patches the process)."""

SCENARIOS: dict[str, str] = {
    "generate": "GenerateUser",  # native /v1/generate, whole answer at once
    "generate-stream": "GenerateStreamUser",  # native /v1/generate, SSE
    "chat-stream": "ChatStreamUser",  # OpenAI /v1/chat/completions, SSE with usage
    "translate": "TranslateUser",  # /v1/translate, one sentence, zh->en or en->zh at random
    "translate-batch": "TranslateBatchUser",  # /v1/translate, 8 sentences of one direction
    "mixed": "MixedUser",  # chat 4 : generate 1 : translate 2 : translate-batch 1
}

STREAMING = {"generate-stream", "chat-stream"}  # scenarios that report TTFT and ITL

"""The HTTP gateway: OpenAI-compatible API, tokenizer and chat template, engine discovery and routing
(one line per module: docs/design/structure.md)."""

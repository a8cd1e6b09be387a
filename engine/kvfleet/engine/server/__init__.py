"""The serving process: OpenAI-compatible HTTP API over `AsyncLLM` (`kvfleet serve`)."""

"""The OpenAI-compatible HTTP server (SPEC §6.4).

``k3 serve CKPT [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--allow-missing-reasoning]``
(``k3.cli.serve``) runs ``create_app`` (``k3.serve.app``) under uvicorn over one ``Engine``.

- ``POST /v1/chat/completions``: messages rendered by ``k3.data.chat.ChatFormat`` (history may carry
  ``reasoning_content`` or ``reasoning``; an assistant turn with ``tool_calls`` and no reasoning is a
  400 unless ``--allow-missing-reasoning``); ``reasoning_effort`` low | high | max (default max) is
  rendered in the system turn and caps the thinking (``--thinking-cap-low/-high``; max: none) — at
  the cap the engine writes ``</think>`` itself. Replies carry ``reasoning_content``, ``content`` and
  ``tool_calls`` (OpenAI schema), whole or streamed (SSE; ``stream_options.include_usage``).
  ``tool_choice``: auto, none (tools not shown to the model), required / a named function (the
  server writes the call start after the thinking, ``k3.serve.forcing``). ``stop`` is not accepted
  on chat (400): the reply ends at ``<|im_end|>``.
- ``POST /v1/completions``: a string, one-string list or token-id list prompt; ``stop`` strings.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, ``k3.serve.metrics``),
  ``GET /`` (the chat page, ``k3.serve.page``).
- Unknown request fields are a 400 (nothing is silently ignored); ``ignore_eos`` is an extension.
  Every error is ``{"error": {message, type, param, code}}``, bad input always 4xx.
"""

"""The pieces of ``hsdjax serve``: OpenAI wire format (``protocol``), stop-string aware text streaming
(``text``), the batching scheduler (``scheduler``), metrics (``metrics``) and the FastAPI app (``app``).
The policy is described in ``hsdjax.frontends.serve``."""

MAX_BODY_BYTES = 1 << 20  # default request-body limit (``--max-body-bytes``); larger bodies get 413
BODY_TIMEOUT_S = 30.0  # default pause allowed mid-body (``--body-timeout-s``) before a 408

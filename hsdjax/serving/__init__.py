"""The pieces of ``hsdjax serve``: OpenAI wire format (``protocol``), stop-string aware text streaming
(``text``), the batching scheduler (``scheduler``), metrics (``metrics``) and the FastAPI app (``app``).
The policy is described in ``hsdjax.serve``."""

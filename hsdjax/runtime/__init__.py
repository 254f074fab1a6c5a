"""The model runtime: model configs (``config``), the forward pass with its KV cache and tree attention
(``model``), weights in each form (``weights``), tokenizers (``tokenizer``), the model registry and
installer (``registry``), loading a target (``loading``) and device meshes (``sharding``).

It builds on ``hsdjax.kernels`` only: nothing here knows about drafting or the front ends."""

"""The decoding core: the engine's jitted draft -> verify -> accept -> reuse loop (``engine``), token trees
(``tree``), verification over trees (``verify``), sampling (``sampling``), the methods that pair a target
with a drafter (``methods``), the row pool of continuous batching (``batch``) and the drafters (``drafters``).

It builds on the model runtime (``hsdjax.runtime``) and knows nothing of the front ends."""

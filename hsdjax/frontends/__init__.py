"""The front ends over the decoding core: the Python API (``api``), the command line (``cli``), the
OpenAI-compatible server (``serve``, ``serving``), benchmarks (``bench``, ``peers``) and tree tuning (``tune``)."""

"""Every method on the real model, on every path a user takes: greedy `pld`, `sps`, `hsd` (its tuned tree
and the registry's default tree) and `eagle` give `ar`'s tokens on SmolLM2-135M through XLA's dot and
through hsdjax's CPU kernels; `sps` and `eagle` also through the server (the real uvicorn app on
127.0.0.1 and the official `openai` client, concurrent requests sharing the scheduler's batch; `pld`
there: tests/test_serve.py). On a mesh: tests/test_sharding.py.

What it costs is XLA compilation (cold in CI), so: three prompts of 32 tokens decoded as one batch, one
loaded model per path shared by every method (``smollm_xla`` / ``smollm_kernel`` in conftest.py), one
compiled program set per method and path. Both paths run the layers under ``lax.scan`` (GPU and TPU's
layer loop, compiled in half the time of the unrolled one); the unrolled loop ``load_model`` picks on a CPU runs `pld` and `hsd` in the default-load tests (the demo in
tests/test_cli.py, the server in tests/test_serve.py, tests/test_prefix_reuse.py).

`sps` needs a draft LM of SmolLM2's tokenizer and none is registered, so the module writes one:
SmolLM2 with 8 of its 30 layers (the first and the last four), a GGUF file that ``draft_model=PATH``
loads like any other. It is a weak drafter (most drafts are rejected, some accepted), which is what
exactness needs exercised, and compiles in a fraction of the full model's time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from hsdjax.core.methods import REGISTRY, TREE_SIZES
from hsdjax.frontends.api import Generator
from tests.conftest import record_path

MODEL = "smollm2-135m"
PROMPTS = [
    "Count from 1 to 30, separated by commas.",  # a list even the small sps draft gets partly right
    "Write a Python function that returns the sum of a list of numbers.",
    "Repeat the word 'banana' ten times, separated by commas.",  # prompt lookup's matches
]
MAX_NEW = 32
DRAFT_LAYERS = (0, 1, 2, 3, 26, 27, 28, 29)
PATHS = {"xla": "smollm_xla", "cpu-kernel": "smollm_kernel"}
MATMUL_SETTING = {"xla": "off", "cpu-kernel": "on"}  # the draft model's path, loaded as the target's
OPTIONS = {"pld": {}, "hsd": {}, "eagle": {},  # their tuned trees (drafters/checkpoints/tuned.json)
           "hsd-default": {k: REGISTRY["hsd"].defaults[k] for k in TREE_SIZES}}
OPTIONS["hsd-shortlist"] = dict(OPTIONS["hsd-default"], shortlist=64)  # the deep tree, nodes scored over a shortlist


def write_draft(src: Path, dst: Path, layers: tuple[int, ...] = DRAFT_LAYERS) -> Path:
    """A copy of the GGUF ``src`` keeping only ``layers`` (renumbered 0, 1, ...): every metadata field
    (tokenizer, chat template) is kept, the block count rewritten, the kept tensors copied as stored."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own counts, and what the writer adds itself
        value = len(layers) if field.name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    renamed = {f"blk.{old}.": f"blk.{new}." for new, old in enumerate(layers)}

    def name(tensor) -> str | None:
        if not tensor.name.startswith("blk."):
            return tensor.name
        block = ".".join(tensor.name.split(".")[:2]) + "."
        return renamed[block] + tensor.name[len(block):] if block in renamed else None

    kept = [(name(t), t) for t in reader.tensors if name(t)]
    for new, t in kept:
        writer.add_tensor_info(new, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    from hsdjax.runtime import registry

    source = Path(registry.resolve(MODEL).path)
    return write_draft(source, tmp_path_factory.mktemp("draft") / "smollm2-8-layers.gguf")


@contextlib.contextmanager
def matmul_setting(value: str):
    """``$HSDJAX_CPU_MATMUL`` for what loads inside (``sps`` loads its draft model with the default)."""
    before = os.environ.get("HSDJAX_CPU_MATMUL")
    os.environ["HSDJAX_CPU_MATMUL"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HSDJAX_CPU_MATMUL")
        else:
            os.environ["HSDJAX_CPU_MATMUL"] = before


def generator(model, path: str, method: str, draft: Path) -> Generator:
    if method == "sps":
        with matmul_setting(MATMUL_SETTING[path]):
            gen = Generator(model, "sps", draft_model=str(draft))
        assert gen.drafter.draft_cfg.num_layers == len(DRAFT_LAYERS)
        assert gen.drafter.draft_cfg.backend == model.cfg.backend  # the draft runs on the target's path
        return gen
    return Generator(model, method.split("-")[0], **OPTIONS[method])


@pytest.fixture(scope="module")
def answers():
    """`ar`'s results per path, computed once."""
    return {}


def ar_answers(request, answers, path: str):
    if path not in answers:
        model = request.getfixturevalue(PATHS[path])
        answers[path] = Generator(model, "ar").generate(PROMPTS, max_new_tokens=MAX_NEW)
        assert [r.new_tokens for r in answers[path]] == [MAX_NEW] * len(PROMPTS)  # no row stopped early
    return answers[path]


def own_accepted(results) -> int:
    """Drafts the method's own drafter had accepted (not counting grafted prompt-lookup drafts)."""
    return sum(r.stats["accepted_drafts"] - r.stats["lookup_drafts"] for r in results)


# the first parametrization varies fastest: every method on XLA's path, then every one on the kernels'
@pytest.mark.parametrize("method", ["ar", "pld", "sps", "hsd", "hsd-default", "hsd-shortlist", "eagle"])
@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_equals_ar_on_the_real_model(request, answers, draft, path, method):
    model = request.getfixturevalue(PATHS[path])
    assert model.backend["path"] == ("cpu-kernel" if path == "cpu-kernel" else "xla"), model.backend
    want = ar_answers(request, answers, path)
    if method == "ar":
        record_path("XLA matmul" if path == "xla" else "CPU kernel", "real model, every method")
        return
    gen = generator(model, path, method, draft)
    got = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [r.tokens for r in got] == [r.tokens for r in want], method
    if method == "pld":
        assert sum(r.stats["accepted_drafts"] for r in got) > 0  # it really speculated
    else:
        assert own_accepted(got) > 0  # the drafter itself proposed accepted tokens
    if method == "hsd-default":
        assert (gen.drafter.depth, gen.drafter.width, gen.drafter.budget) == tuple(OPTIONS[method].values())
        # the draft reuse the method exists for: some accepted drafts came from an earlier round's states
        reused = [r.stats["reused_drafts"] for r in got]
        assert all(0 <= n <= r.stats["accepted_drafts"] - r.stats["lookup_drafts"] for n, r in zip(reused, got))
        if path == "xla":  # (4 of the first prompt's 20 on the EPYC AVX2 machine; none on the others)
            assert sum(reused) > 0, reused


def test_ar_is_the_same_through_xla_and_the_kernels(request, answers):
    """The kernels' model (compressed panels) computes what XLA's does: the same greedy tokens."""
    xla = ar_answers(request, answers, "xla")
    kernel = ar_answers(request, answers, "cpu-kernel")
    assert [r.tokens for r in kernel] == [r.tokens for r in xla]


# ------------------------------------------------------------------------------------------ the server
@pytest.mark.parametrize("method", ["sps", "eagle"])
def test_the_server_answers_with_ar_tokens(request, answers, draft, method):
    """Three chat requests at once (the scheduler's rows: prefill, insert into a running batch of 2,
    a queued third) answer with `ar`'s text. Warm-up and the prefix cache are off: their programs are
    tested with `pld` (tests/test_serve*.py); here each method compiles only what the requests need."""
    openai = pytest.importorskip("openai")
    from hsdjax.frontends import serve
    from hsdjax.frontends.serving.app import create_app
    from hsdjax.frontends.serving.metrics import Metrics
    from hsdjax.frontends.serving.scheduler import Scheduler
    from tests.test_serve_hardening import _free_port

    model = request.getfixturevalue(PATHS["xla"])
    want = ar_answers(request, answers, "xla")
    options = {"draft_model": str(draft)} if method == "sps" else {}
    with matmul_setting(MATMUL_SETTING["xla"]):
        sched = Scheduler(model, method, max_batch=2, max_queue=4, max_context=256, method_options=options,
                          metrics=Metrics(), warmup=False, prefix_cache_mb=0)
    sched.start()
    server = None
    try:
        assert sched.ready.wait(600) and sched.failure is None, sched.failure
        port = _free_port()
        server = serve.make_server(create_app(sched, MODEL), sched, host="127.0.0.1", port=port,
                                   log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60  # a hang guard
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=600)

        def chat(prompt: str):
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=MAX_NEW, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(chat, PROMPTS))
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(60)
        sched.close()
    assert [r.choices[0].message.content for r in got] == [r.text for r in want], method
    assert [r.usage.completion_tokens for r in got] == [MAX_NEW] * len(PROMPTS)
    extra = [r.model_extra["hsdjax"] for r in got]
    assert {e["method"] for e in extra} == {method}
    assert max(e["mean_accepted_length"] for e in extra) > 1.0  # drafts were accepted through the server

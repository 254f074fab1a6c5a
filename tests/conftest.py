"""Shared fixtures: tiny random models for breadth, the real default model for end-to-end checks."""

from __future__ import annotations

import gc
import os
import shutil

import jax
import pytest

from hsdjax.frontends.api import enable_compilation_cache
from hsdjax.runtime.config import ModelConfig
from hsdjax.runtime.model import init_params

jax.config.update("jax_enable_x64", False)
enable_compilation_cache()


def _load_hypothesis_profile() -> None:
    """Hypothesis runs derandomized by default ("ci": the same examples every run, so a failure replays
    exactly); ``HYPOTHESIS_PROFILE=explore`` draws fresh examples from a seed the report header prints
    (``HYPOTHESIS_SEED`` or ``--hypothesis-seed`` replays it). Either prints a failure's reproduction
    blob and has no deadline (a loaded machine must not fail a test by its speed)."""
    import random

    from hypothesis import core, settings

    settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
    settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    if not settings.default.derandomize and core.global_force_seed is None:
        core.global_force_seed = int(os.environ.get("HYPOTHESIS_SEED") or random.SystemRandom().randrange(2**32))


def _hypothesis_header() -> str:
    from hypothesis import core, settings

    name = settings.get_current_profile_name()
    if settings.default.derandomize:
        return f"hypothesis: profile {name!r}, derandomized (HYPOTHESIS_PROFILE=explore draws fresh examples)"
    seed = core.global_force_seed
    return f"hypothesis: profile {name!r}, seed {seed} (replay: HYPOTHESIS_PROFILE={name} HYPOTHESIS_SEED={seed})"


_load_hypothesis_profile()


MAPS_BEFORE_RELEASE = 25_000  # well under Linux's default limit of 65,530 (one test may add ~20,000)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: release after every test
        return MAPS_BEFORE_RELEASE


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop every compiled program once the process holds many memory maps.

    Each program XLA's CPU backend compiles stays mapped into the process (a tiny model's `hsd` decode
    loop: ~1,700 memory maps) and the suite compiles hundreds: about halfway through, the process hit
    Linux's default limit of 65,530 maps (``vm.max_map_count``) and died inside XLA, compiling or
    writing the compilation cache, at whatever test came next (one module with its hypothesis examples
    alone passed 23,000). Releasing after every test cost ~0.5 s of ``gc.collect`` each (~6 minutes
    of the suite) and recompiled what the next test needed, so it happens only past
    ``MAPS_BEFORE_RELEASE``; programs needed again are reloaded from the persistent compilation cache."""
    yield
    if _memory_maps() >= MAPS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()


TINY_LLAMA = ModelConfig(family="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=3,
                         num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_context=512)
TINY_QWEN = ModelConfig(family="qwen2", vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=1e6, max_context=512,
                        tie_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    """(config, params) of a tiny random model of each family."""
    cfg = TINY_LLAMA if request.param == "llama" else TINY_QWEN
    return cfg, init_params(cfg, seed=1)


@pytest.fixture(scope="session")
def smollm():
    """The real default model (installed by `make test`)."""
    from hsdjax.frontends.api import load_model

    model = load_model("smollm2-135m")
    record_path("CPU kernel" if model.backend.get("path") == "cpu-kernel" else "XLA matmul", "real model (auto)")
    return model


# ------------------------------------------------------------------ the paths a run exercised, and the kernels
# One line at the end of the run names them (``pytest_terminal_summary``): what a green run checked depends
# on the machine (compiler, instruction set, emulators), so it says so. Fixtures and tests record a path
# when they run it (``record_path``), or why they could not (``record_missed``); a test marked
# ``@pytest.mark.exercises(path, detail)`` records it when it passes.
PATHS_RUN: dict[str, list[str]] = {}
PATHS_MISSED: dict[str, str] = {}
PASSED_TESTS_EXERCISE = {  # node id prefix -> (path, detail), for files that do not record their own
    "tests/test_tree_attention.py::test_kernel": ("Pallas tree attention", "interpret mode"),
}
REQUIRE_KERNEL_ENV = "HSDJAX_REQUIRE_CPU_KERNEL"  # "1" (set by `make test` where a compiler exists): no skip


def record_path(path: str, detail: str | None = None) -> None:
    details = PATHS_RUN.setdefault(path, [])
    if detail and detail not in details:
        details.append(detail)


def record_missed(path: str, why: str) -> None:
    PATHS_MISSED.setdefault(path, why)


def pytest_configure(config):
    config.addinivalue_line("markers", "exercises(path, detail): the path a test runs, named in the run's summary")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "call" and report.passed:
        for mark in item.iter_markers("exercises"):
            record_path(*mark.args)
        for prefix, (path, detail) in PASSED_TESTS_EXERCISE.items():
            if item.nodeid.startswith(prefix):
                record_path(path, detail)


def pytest_terminal_summary(terminalreporter):
    ran = "; ".join(f"{p} ({', '.join(d)})" if d else p for p, d in PATHS_RUN.items()) or "none recorded"
    missed = "; ".join(f"{p} ({why})" for p, why in PATHS_MISSED.items() if p not in PATHS_RUN)
    terminalreporter.write_line(f"paths exercised: {ran}" + (f" | not exercised: {missed}" if missed else ""))


def cxx_compiler() -> str | None:
    """The C++ compiler the kernels' builds use: ``$CXX``, else g++, else c++ (None: none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def no_compiler(what: str) -> None:
    """Skip (no C++ compiler here), or fail when ``make test`` found one and asked for the kernels."""
    why = f"no C++ compiler (install g++ or set CXX): {what} cannot be built here"
    if os.environ.get(REQUIRE_KERNEL_ENV) == "1":
        pytest.fail(f"{REQUIRE_KERNEL_ENV}=1 (`make test` found a compiler), but {why}", pytrace=False)
    record_missed("CPU kernel", "no C++ compiler")
    pytest.skip(why)


@pytest.fixture(scope="session")
def cpu_kernel() -> str:
    """hsdjax's CPU kernels, built here if they are not yet (with ``$CXX``, as ``hsdjax cpu-matmul build``)
    and loaded: their instruction set. Skips only where no compiler exists (fails with
    ``HSDJAX_REQUIRE_CPU_KERNEL=1``); a failed build or load fails."""
    from hsdjax.kernels import cpu_matmul

    if not cpu_matmul.is_built():
        if not cxx_compiler():
            no_compiler("hsdjax's CPU kernels")
        try:
            cpu_matmul.build()
        except cpu_matmul.CpuMatmulError as exc:
            pytest.fail(f"building hsdjax's CPU kernels with {cxx_compiler()} failed: {exc}", pytrace=False)
    if not cpu_matmul.load():
        pytest.fail(f"hsdjax's CPU kernels were built but {cpu_matmul.library_path()} does not load", pytrace=False)
    isa = cpu_matmul.instruction_set()
    record_path("CPU kernel", isa)
    return isa


@pytest.fixture(scope="session")
def smollm_xla():
    """The real default model through XLA's dot (what GPU / TPU users and CPUs without a compiler get),
    its layers under ``lax.scan`` (the GPU / TPU layer loop; half the unrolled loop's compile time)."""
    from hsdjax.frontends.api import load_model

    return load_model("smollm2-135m", cpu_matmul="off", layer_loop="scan")


@pytest.fixture(scope="session")
def smollm_kernel(cpu_kernel):
    """The real default model through hsdjax's CPU kernels (``cpu_matmul="on"``: whatever ``auto``
    measured), its layers under ``lax.scan`` as on GPU / TPU (half the unrolled loop's compile time;
    the default-load tests run the unrolled loop)."""
    from hsdjax.frontends.api import load_model

    return load_model("smollm2-135m", cpu_matmul="on", layer_loop="scan")


def pytest_report_header(config):
    return [f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} devices); "
            f"HSDJAX_HOME={os.environ.get('HSDJAX_HOME', '~/.cache/hsdjax')}", _hypothesis_header()]


def chi2_pvalue(counts, probs) -> float:
    """Chi-square goodness of fit of observed counts to probabilities (zero-probability cells must be
    empty; they are dropped). Probabilities are renormalised in float64."""
    import numpy as np
    from scipy import stats

    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    assert counts[probs <= 0].sum() == 0, "samples where the target has zero probability"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    return float(stats.chisquare(counts[keep], expected)[1])


def run_engine(cfg, params, prompts, max_new, drafter=None, dparams=(), chunks=None, temperature=0.0, top_k=0,
               top_p=1.0, seed=0, stop=(), return_state=False, top_logprobs=None):
    """Drive the engine directly (prefill -> start -> decode in chunks); the new tokens per row."""
    import jax.numpy as jnp
    import numpy as np

    from hsdjax.core import engine
    from hsdjax.core.drafters import ARDrafter
    from hsdjax.core.sampling import SamplingParams

    drafter = drafter or ARDrafter()
    longest = max(len(p) for p in prompts)
    p_bucket, s_bucket = engine.plan_shapes(cfg, longest, max_new, spare=drafter.spare)
    b = len(prompts)
    arr, lengths, budget = engine.pack_rows(prompts, p_bucket, b, max_new)
    gen, fwd = engine.prefill(params, jnp.array(arr), jnp.array(lengths), jnp.array(budget),
                              SamplingParams.make(b, temperature, top_k, top_p), engine.row_keys(seed, b),
                              engine.stop_array(stop), cfg=cfg, cache_size=s_bucket, spare=drafter.spare,
                              keep_layers=drafter.prompt_layers, top_logprobs=top_logprobs)
    state = engine.start_decoding(dparams, gen, fwd, drafter=drafter)
    for steps in chunks or [max_new]:
        state = engine.decode(params, dparams, state, jnp.int32(steps), cfg=cfg, drafter=drafter)
    seq, start, end = (np.asarray(a) for a in (state.gen.seq, state.gen.prompt_len, state.gen.seq_len))
    rows = [seq[i, start[i]: end[i]].tolist() for i in range(b)]
    return (rows, state) if return_state else rows


def teacher_forced(cfg, params, prompt, tokens, temperature=0.0, top_k=0, top_p=1.0):
    """``sampling.log_probs`` [T, V] at the position of each of ``tokens`` (the distribution it was
    drawn from), from one uncached pass of the model over prompt + tokens."""
    import jax.numpy as jnp
    import numpy as np

    from hsdjax.core.sampling import SamplingParams, log_probs
    from hsdjax.runtime.model import Transformer, causal_mask

    model = Transformer(cfg)
    seq = jnp.asarray(list(prompt) + list(tokens), jnp.int32)[None]
    total = seq.shape[1]
    out = model.apply({"params": params}, seq, jnp.arange(total)[None], causal_mask(jnp.array([total]), total))
    logits = model.apply({"params": params}, out["hidden"][0, len(prompt) - 1: total - 1], method=Transformer.logits)
    return np.asarray(log_probs(logits, SamplingParams.make(len(tokens), temperature, top_k, top_p)))

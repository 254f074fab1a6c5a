"""Self-distillation data at scale: the continuous-batch recorder equals the fixed-batch one, a killed
run resumes without redoing or losing shards, prompt sources mix by weight, multi-turn conversations
become one document."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsdjax.errors import HsdjaxError
from hsdjax.frontends.api import LoadedModel
from hsdjax.runtime.model import init_params
from hsdjax.train import datagen
from hsdjax.train.answers import AnswerStore
from hsdjax.train.datagen import (
    fused_layer_indices,
    generate_data,
    generate_recorded,
    load_shards,
    prompt_stream,
    recording_generator,
)
from tests.conftest import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]

CFG = TINY_LLAMA
STOPS = (3, 41)  # the (sharpened) random model's greedy answers hit these at varied lengths


class StubTokenizer:
    """Token ids written as text ("5 7 9"); a toy chat template: role id, content, end id."""

    stop_ids = STOPS
    ROLE = {"user": 90, "assistant": 91}
    END = 92

    def __init__(self, chat: bool = False):
        self.has_chat_template = chat

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def encode_chat(self, messages, add_generation_prompt=True):
        ids = []
        for m in messages:
            ids += [self.ROLE[m["role"]], *self.encode(m["content"]), self.END]
        return ids + ([self.ROLE["assistant"]] if add_generation_prompt else [])


@pytest.fixture(scope="module")
def params():
    """A tiny random target with weights scaled up: its greedy answers vary instead of repeating a token."""
    return jax.tree_util.tree_map(lambda a: a * 5.0 if a.ndim >= 2 else a, init_params(CFG, seed=1))


def tiny_model(params, chat=False):
    return LoadedModel("tiny", CFG, params, StubTokenizer(chat), None, "tiny-datagen-test", {})


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def random_prompts(n, seed=0, source=None):
    rng = np.random.RandomState(seed)
    rows = []
    for i in range(n):
        ids = rng.randint(20, 80, rng.randint(2, 40))  # lengths span two prompt buckets
        rows.append({"prompt": " ".join(map(str, ids)), **({"source": source} if source else {})})
    return rows


def docs_by_prompt(folder):
    """{prompt index: {key: array}} of a data folder, checking no prompt appears twice."""
    data = load_shards(folder)
    man = data.pop("manifest")
    indices = [i for shard in man["shards"] for i in shard["prompts"]]
    assert len(indices) == len(set(indices)), "a prompt was written twice"
    out = {}
    for d, index in enumerate(indices):
        keep = data["doc"] == d
        out[index] = {k: v[keep] for k, v in data.items() if k != "doc"}
    return out, man


def teacher_forced_check(params, doc):
    """A document's recorded states and top-1 ids equal one forward pass over its tokens."""
    import jax.numpy as jnp

    from hsdjax.runtime.model import Transformer, causal_mask

    toks = doc["tokens"]
    t = len(toks)
    fwd = Transformer(CFG).apply({"params": params}, jnp.asarray(toks)[None], jnp.arange(t)[None],
                                 causal_mask(jnp.array([t]), t))
    want = np.stack([np.asarray(fwd["layers"][i][0]) for i in fused_layer_indices(CFG.num_layers)], axis=1)
    np.testing.assert_allclose(np.asarray(doc["states"], np.float32), want, atol=0.05, rtol=0.02)
    logits = np.asarray(Transformer(CFG).apply({"params": params}, fwd["hidden"], method=Transformer.logits))[0]
    assert np.array_equal(doc["top_ids"][:, 0], logits.argmax(-1))


CFG_DATA = dict(token_budget=10**6, batch=4, refill_every=3, chunk=16, shard_tokens=200, max_prompt_tokens=64,
                max_new_tokens=20, top_k_logits=4)


def test_continuous_batching_equals_the_fixed_batch_recorder(params, tmp_path):
    """Same documents as answering each prompt in one fixed batch; states and logits as recorded there."""
    prompts = random_prompts(22)
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", prompts))
    model = tiny_model(params)
    man = generate_data(model, cfg, tmp_path / "data", progress=False)
    got, _ = docs_by_prompt(tmp_path / "data")
    assert man["complete"] and sorted(got) == list(range(22))
    lengths = {len(v["tokens"]) - len(prompts[i]["prompt"].split()) for i, v in got.items()}
    assert len(lengths) > 3, lengths  # answers end at different rounds: rows really were refilled
    work = man["work"]  # every generated token counted once (the last of each answer has no record)
    assert work["generated"] == man["answer_tokens"] + 22 and 0 < work["occupancy"] <= 1
    assert work["slot_rounds"] >= work["generated"] and work["decode_s"] > 0 and work["prefill_s"] > 0

    teacher_forced_check(params, got[5])
    teacher_forced_check(params, got[17])

    gen = recording_generator(model, 4)
    rows = [[int(t) for t in p["prompt"].split()] for p in prompts]
    want = generate_recorded(gen, rows[:16], 20, 0.0, seed=0)
    want6 = generate_recorded(gen, rows[16:], 20, 0.0, seed=0)
    for i in range(22):
        w, d = (want, i) if i < 16 else (want6, i - 16)
        keep = w["doc"] == d
        g = got[i]
        assert np.array_equal(g["tokens"], w["tokens"][keep]), i
        assert np.array_equal(g["answer"], w["answer"][keep]), i
        assert np.array_equal(g["top_ids"][:, 0], w["top_ids"][keep][:, 0]), i
        np.testing.assert_allclose(np.asarray(g["states"], np.float32),
                                   w["states"][keep].view(g["states"].dtype).astype(np.float32), atol=0.05, rtol=0.02)


def test_a_killed_run_resumes_without_redoing_or_losing_shards(params, tmp_path, monkeypatch):
    prompts = random_prompts(30, seed=3)
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", prompts))
    model = tiny_model(params)
    generate_data(model, cfg, tmp_path / "whole", progress=False)
    whole, whole_man = docs_by_prompt(tmp_path / "whole")

    real_add, calls = datagen.DataWriter.add, []

    def add_then_die(self, *args, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real_add(self, *args, **kw)

    monkeypatch.setattr(datagen.DataWriter, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        generate_data(model, cfg, tmp_path / "cut", progress=False)
    cut_man = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert len(cut_man["shards"]) == 3 and not cut_man["complete"]
    first = {i for s in cut_man["shards"] for i in s["prompts"]}
    monkeypatch.setattr(datagen.DataWriter, "add", real_add)
    man = generate_data(model, cfg, tmp_path / "cut", progress=False)
    resumed, _ = docs_by_prompt(tmp_path / "cut")  # checks no prompt was written twice
    assert man["complete"] and sorted(resumed) == sorted(whole) == list(range(30))
    assert man["shards"][:3] == cut_man["shards"] and first < set(resumed)
    assert man["tokens"] == whole_man["tokens"] == sum(len(v["tokens"]) for v in resumed.values())
    for i in whole:
        assert np.array_equal(resumed[i]["tokens"], whole[i]["tokens"]), i


def test_a_token_budget_stops_and_a_larger_one_continues(params, tmp_path):
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(30, seed=4)), token_budget=400)
    model = tiny_model(params)
    man = generate_data(model, cfg, tmp_path / "d", progress=False)
    assert 400 <= man["tokens"] < 1200 and not man["complete"]
    man = generate_data(model, dict(cfg, token_budget=10**6), tmp_path / "d", progress=False)
    got, _ = docs_by_prompt(tmp_path / "d")
    assert man["complete"] and sorted(got) == list(range(30))


def test_sources_mix_by_weight_and_exclusion(tmp_path):
    a = write_prompts(tmp_path / "a.jsonl", random_prompts(200, 1, "math") + random_prompts(50, 2, "t0:x")
                      + random_prompts(50, 3, "t0:y"))
    b = write_prompts(tmp_path / "b.jsonl", random_prompts(200, 4, "chat") + random_prompts(40, 5, "nc"))
    cfg = {"prompts": [a, b], "source_weights": {"math": 1.0, "chat": 2.0, "t0": 0.5, "nc": 1.0},
           "exclude_sources": ["nc", "t0:y"]}
    stream = prompt_stream(cfg)
    assert [r["index"] for r in stream] == list(range(len(stream)))
    assert len(stream) == 200 + 50 + 200  # nc and t0:y excluded
    head = [r["source"].split(":")[0] for r in stream[:140]]
    assert abs(head.count("chat") - 80) <= 2 and abs(head.count("math") - 40) <= 2 and abs(head.count("t0") - 20) <= 2
    assert {r["source"] for r in stream if r["source"].startswith("t0")} == {"t0:x"}
    assert stream == prompt_stream(cfg)  # deterministic
    assert [r["source"] for r in prompt_stream(dict(cfg, seed=1))] != [r["source"] for r in stream]
    zero = prompt_stream(dict(cfg, source_weights={"math": 0, "chat": 1}))
    assert {r["source"].split(":")[0] for r in zero} == {"chat", "t0"}
    with pytest.raises(HsdjaxError, match="names 'code', which no prompt file has"):
        prompt_stream(dict(cfg, source_weights={"code": 1.0}))
    with pytest.raises(HsdjaxError, match=r"source_weights\['math'\] must be a number >= 0"):
        prompt_stream(dict(cfg, source_weights={"math": -1}))
    with pytest.raises(HsdjaxError, match="data.batch must be a positive integer"):
        datagen.data_settings(dict(cfg, batch=0))


def test_multi_turn_prompts_become_one_document(params, tmp_path):
    """Turn 2 is answered with the target's own turn-1 answer in context; the conversation is one
    document whose answer mask covers both answers; the manifest records the sources used."""
    rng = np.random.RandomState(5)
    rows = []
    for i in range(8):
        turns = [" ".join(map(str, rng.randint(20, 80, rng.randint(2, 9)))) for _ in range(3)]
        rows.append({"prompt": turns[0], "turns": turns, "source": "dialogue"} if i % 2 else
                    {"prompt": turns[0], "source": "single"})
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", rows), max_turns=2)
    model = tiny_model(params, chat=True)
    man = generate_data(model, cfg, tmp_path / "d", progress=False)
    assert man["sources"] == ["dialogue", "single"]
    got, _ = docs_by_prompt(tmp_path / "d")
    assert sorted(got) == list(range(8))
    single_cfg = dict(cfg, prompts=write_prompts(tmp_path / "q.jsonl", [dict(r, turns=[r["prompt"]]) for r in rows]))
    generate_data(model, single_cfg, tmp_path / "t1", progress=False)
    turn1, _ = docs_by_prompt(tmp_path / "t1")
    tok = model.tokenizer
    for i, r in enumerate(prompt_stream(cfg)):
        doc, first = got[i], turn1[i]
        if len(r["turns"]) == 1:
            assert np.array_equal(doc["tokens"], first["tokens"])
            continue
        assert len(r["turns"]) == 2  # max_turns
        p1 = tok.encode_chat([{"role": "user", "content": r["turns"][0]}])
        toks = doc["tokens"].tolist()
        # turn 1's prompt, then its answer (the turn-1 document's answer, up to its stop token)
        a1 = first["tokens"][len(p1):].tolist()
        assert toks[: len(p1) + len(a1)] == p1 + a1
        seq = [tok.END, tok.ROLE["user"], *tok.encode(r["turns"][1]), tok.END, tok.ROLE["assistant"]]
        end1 = len(p1) + len(a1)  # turn 1's answer ends here or one token later (the dropped last token)
        q = next(k for k in (end1 - 1, end1, end1 + 1) if toks[k: k + len(seq)] == seq)  # turn 2 starts
        want = np.zeros(len(toks), bool)
        want[len(p1): q + 1] = True  # answer 1 and the end token the template writes after it
        want[q + len(seq):] = True
        assert np.array_equal(doc["answer"], want), i


def test_load_shards_can_leave_out_the_data_a_warm_start_has_seen(params, tmp_path):
    """``skip_answers``: whole shards holding any of the first N answer tokens are left out; what is kept is
    the same documents, in order, as the tail of the whole folder; past the end is a clear error. And
    ``limit_tokens`` keeps the first whole shards."""
    cfg = dict(CFG_DATA, shard_tokens=60, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(14, seed=3)))
    man = generate_data(tiny_model(params), cfg, tmp_path / "data", progress=False)
    shards = man["shards"]
    assert len(shards) >= 3
    whole = load_shards(tmp_path / "data")
    first = int(shards[0]["answer_tokens"])
    for skip, dropped in ((first, 1), (first + 1, 2)):
        tail = load_shards(tmp_path / "data", skip_answers=skip)
        tokens = sum(int(s["tokens"]) for s in shards[:dropped])
        assert tail["manifest"]["skipped_tokens"] == tokens
        assert tail["manifest"]["skipped_answers"] == sum(int(s["answer_tokens"]) for s in shards[:dropped])
        assert np.array_equal(tail["tokens"], whole["tokens"][tokens:])
        assert np.array_equal(np.asarray(tail["states"], np.float32), np.asarray(whole["states"][tokens:], np.float32))
        assert tail["doc"][0] == 0 and np.array_equal(np.diff(tail["doc"]), np.diff(whole["doc"][tokens:]))
    with pytest.raises(HsdjaxError, match="no shard lies past"):
        load_shards(tmp_path / "data", skip_answers=int(man["answer_tokens"]))
    # ``limit_tokens`` (--data-tokens): the first whole shards only, and the manifest says where they end
    two = sum(int(s["tokens"]) for s in shards[:2])
    for limit in (two, two - 1):
        head = load_shards(tmp_path / "data", limit_tokens=limit)
        assert np.array_equal(head["tokens"], whole["tokens"][:two])
        assert head["manifest"]["tokens"] == two
        assert head["manifest"]["answer_tokens"] == sum(int(s["answer_tokens"]) for s in shards[:2])
    assert whole["manifest"]["tokens"] == man["tokens"]


def test_first_prompt_starts_a_new_slice_of_the_same_stream(params, tmp_path):
    """``first_prompt`` K: the data holds exactly the stream's prompts from K on, each document equal to the
    one a run from the start writes; loading records the prompt span; 0 names the same folder as no
    setting; a start past the stream is a clear error."""
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(12, seed=5)))
    model = tiny_model(params)
    generate_data(model, cfg, tmp_path / "all", progress=False)
    generate_data(model, dict(cfg, first_prompt=7), tmp_path / "tail", progress=False)
    whole, _ = docs_by_prompt(tmp_path / "all")
    tail, _ = docs_by_prompt(tmp_path / "tail")
    assert sorted(tail) == list(range(7, 12))
    for index, doc in tail.items():
        assert np.array_equal(doc["tokens"], whole[index]["tokens"])
    assert load_shards(tmp_path / "tail")["manifest"]["prompt_span"] == [7, 11]
    assert datagen.data_key("fp", dict(cfg, first_prompt=0)) == datagen.data_key("fp", cfg)
    assert datagen.data_key("fp", dict(cfg, first_prompt=7)) != datagen.data_key("fp", cfg)
    with pytest.raises(HsdjaxError, match="past the end of the prompt stream"):
        generate_data(model, dict(cfg, first_prompt=12), tmp_path / "none", progress=False)
    with pytest.raises(HsdjaxError, match="first_prompt must be"):
        generate_data(model, dict(cfg, first_prompt=-1), tmp_path / "bad", progress=False)


# ------------------------------------------------------------------------------------------ recorded answers
def no_generation(monkeypatch):
    """Make any decode call of the recorder an error: what follows must not generate a token."""
    def refuse(*args, **kwargs):
        raise AssertionError("generated tokens")

    monkeypatch.setattr(datagen.ContinuousRecorder, "run", refuse)


def man_key(folder):
    """The data key of a data folder's settings, as its manifest records them."""
    man = json.loads((folder / "manifest.json").read_text())
    return datagen.data_key(man["target_fingerprint"], man["config"])


def test_recorded_answers_rebuild_the_data_without_generating(params, tmp_path, monkeypatch):
    """A data run writes each shard's answers as a compressed piece; a fresh data folder (another
    machine's cache) is rebuilt from the pieces alone by teacher-forced passes: the same documents,
    answer masks and shard boundaries, states and top ids as generation recorded them."""
    prompts = random_prompts(24, seed=7)
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", prompts), answers=str(tmp_path / "answers"),
               rerecord_batch=4)
    model = tiny_model(params, chat=False)
    man = generate_data(model, cfg, tmp_path / "first", progress=False)
    pieces = json.loads((tmp_path / "answers" / "manifest.json").read_text())
    assert len(pieces["pieces"]) == len(man["shards"]) >= 3
    assert [p["prompts"] for p in pieces["pieces"]] == [s["prompts"] for s in man["shards"]]
    assert pieces["tokens"] == man["tokens"] and pieces["answer_tokens"] == man["answer_tokens"]
    assert pieces["target_fingerprint"] == model.fingerprint
    assert pieces["data_key"] == datagen.data_key(model.fingerprint, cfg) == man_key(tmp_path / "first")
    assert datagen.data_key(model.fingerprint, cfg) == datagen.data_key(model.fingerprint, {
        k: v for k, v in cfg.items() if k not in ("answers", "rerecord_batch")})  # where answers live is not data

    no_generation(monkeypatch)
    again = generate_data(model, cfg, tmp_path / "second", progress=False)
    assert again["rerecorded_tokens"] == again["tokens"] == man["tokens"] and again["rerecord_s"] > 0
    assert [s["prompts"] for s in again["shards"]] == [s["prompts"] for s in man["shards"]]
    first, _ = docs_by_prompt(tmp_path / "first")
    second, _ = docs_by_prompt(tmp_path / "second")
    assert sorted(second) == sorted(first) == list(range(24))
    for i in first:
        a, b = first[i], second[i]
        assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["answer"], b["answer"]), i
        assert np.array_equal(a["top_ids"][:, 0], b["top_ids"][:, 0]), i
        np.testing.assert_allclose(np.asarray(b["states"], np.float32), np.asarray(a["states"], np.float32),
                                   atol=0.05, rtol=0.02)
    teacher_forced_check(params, second[3])
    # a rerun finds everything there: nothing re-recorded, nothing written
    assert generate_data(model, cfg, tmp_path / "second", progress=False)["shards"] == again["shards"]


def test_a_run_continues_from_committed_pieces_and_exports_older_data(params, tmp_path):
    """A budget-cut run leaves pieces; another folder with a larger budget re-records them and generates
    only the prompts no piece holds, ending with the same documents as one uninterrupted run. Data made
    before answers were kept become pieces from its shards."""
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(26, seed=8)))
    model = tiny_model(params)
    generate_data(model, cfg, tmp_path / "whole", progress=False)
    whole, _ = docs_by_prompt(tmp_path / "whole")

    kept = dict(cfg, answers=str(tmp_path / "answers"))
    cut = generate_data(model, dict(kept, token_budget=400), tmp_path / "machine1", progress=False)
    held = {i for p in json.loads((tmp_path / "answers" / "manifest.json").read_text())["pieces"] for i in p["prompts"]}
    assert not cut["complete"] and 0 < len(held) < 26
    man = generate_data(model, kept, tmp_path / "machine2", progress=False)
    assert man["complete"] and man["rerecorded_tokens"] == cut["tokens"]
    got, _ = docs_by_prompt(tmp_path / "machine2")
    assert sorted(got) == list(range(26))
    for i in whole:
        assert np.array_equal(got[i]["tokens"], whole[i]["tokens"]), i
    answers = json.loads((tmp_path / "answers" / "manifest.json").read_text())
    assert sorted(i for p in answers["pieces"] for i in p["prompts"]) == list(range(26))
    # the new prompts were generated (and committed) before the held answers were re-recorded, and the
    # stream reads in the pieces' order all the same: as a machine that only re-records reads it
    n_cut = len(cut["shards"])
    assert [s["piece"] for s in man["shards"]] == list(range(n_cut, len(answers["pieces"]))) + list(range(n_cut))
    stream = load_shards(tmp_path / "machine2")
    store = AnswerStore(tmp_path / "answers", {"target_fingerprint": answers["target_fingerprint"],
                                                "tokenizer": answers["tokenizer"], "data_key": answers["data_key"]})
    in_pieces = [d["tokens"] for p in store.pieces for d in store.read(p)]
    assert np.array_equal(stream["tokens"], np.concatenate(in_pieces))
    generate_data(model, kept, tmp_path / "machine3", progress=False)
    again = load_shards(tmp_path / "machine3")
    assert np.array_equal(again["tokens"], stream["tokens"]) and np.array_equal(again["doc"], stream["doc"])

    # the uninterrupted run's folder, kept before answers were: its shards become pieces, nothing generated
    generate_data(model, dict(cfg, answers=str(tmp_path / "exported")), tmp_path / "whole", progress=False)
    exported = json.loads((tmp_path / "exported" / "manifest.json").read_text())
    assert exported["tokens"] == sum(len(v["tokens"]) for v in whole.values())


def test_a_budget_takes_the_pieces_that_start_before_it():
    pieces = [{"tokens": 100}, {"tokens": 100}, {"tokens": 100}]
    assert [i for i, _ in datagen.in_budget(pieces, 150)] == [0, 1]
    assert [i for i, _ in datagen.in_budget(pieces, 200)] == [0, 1]
    assert [i for i, _ in datagen.in_budget(pieces, 201)] == [0, 1, 2]
    assert datagen.in_budget(pieces, 10**6) == list(enumerate(pieces))


def test_answers_of_another_target_or_a_damaged_piece_are_refused(params, tmp_path):
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(8, seed=9)),
               answers=str(tmp_path / "answers"))
    model = tiny_model(params)
    generate_data(model, cfg, tmp_path / "d", progress=False)
    other = LoadedModel("tiny", CFG, params, StubTokenizer(), None, "another-weights", {})
    with pytest.raises(HsdjaxError, match="holds the answers of target 'tiny' .*not of this run's"):
        generate_data(other, cfg, tmp_path / "o", progress=False)
    with pytest.raises(HsdjaxError, match="holds the answers of data settings"):
        generate_data(model, dict(cfg, max_new_tokens=19), tmp_path / "s", progress=False)
    piece = tmp_path / "answers" / "piece_00000.npz"
    data = piece.read_bytes()
    piece.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(HsdjaxError, match="sha256 differs"):
        generate_data(model, cfg, tmp_path / "fresh", progress=False)
    with pytest.raises(HsdjaxError, match="data.answers must be a folder path"):
        datagen.data_settings(dict(cfg, answers=3))


def test_answer_pieces_are_compact(tmp_path):
    """Token ids as 16 bits where the vocabulary fits, the mask as bits, compressed: about 2 bytes a token
    before compression; ids past 65535 keep 32 bits; reading returns exactly what was written."""
    rng = np.random.RandomState(0)
    docs = [{"tokens": rng.randint(0, 49152, n).astype(np.int32), "answer": rng.rand(n) < 0.7} for n in (300, 5, 700)]
    store = AnswerStore(tmp_path / "a", {"target_fingerprint": "x", "tokenizer": None, "data_key": "k"})
    entry = store.add(docs, [4, 9, 2])
    assert (tmp_path / "a" / entry["file"]).stat().st_size < 2.3 * 1005 + 1500
    back = AnswerStore(tmp_path / "a", {"target_fingerprint": "x", "tokenizer": None, "data_key": "k"})
    got = back.read(back.pieces[0])
    assert [d["prompt"] for d in got] == [4, 9, 2]
    for d, w in zip(got, docs):
        assert np.array_equal(d["tokens"], w["tokens"]) and np.array_equal(d["answer"], w["answer"])
    wide = [{"tokens": np.array([70000, 3], np.int32), "answer": np.array([False, True])}]
    back.add(wide, [11])
    assert np.array_equal(back.read(back.pieces[1])[0]["tokens"], [70000, 3])


def git_repo(tmp_path):
    """An empty git work tree with an identity, and a function running git in it (its stdout)."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    return repo, git


def test_answers_are_committed_as_the_run_goes(params, tmp_path):
    """``commit_every_s``: the answers folder is committed to the git work tree holding it (that folder
    only: another staged file stays staged), each piece in a commit when the interval is 0; a folder
    outside a work tree, or committing without a folder, is refused before any work."""
    repo, git = git_repo(tmp_path)
    (repo / "other.txt").write_text("staged, not ours to commit\n")
    git("add", "other.txt")
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(12, seed=10)),
               answers=str(repo / "data" / "answers"))
    model = tiny_model(params)
    man = generate_data(model, cfg, tmp_path / "d", progress=False, commit_every_s=0.0, log=print)
    pieces = json.loads((repo / "data" / "answers" / "manifest.json").read_text())["pieces"]
    assert len(pieces) == len(man["shards"]) >= 2
    log = git("log", "--format=%s").splitlines()
    assert len(log) == len(pieces) and log[0].startswith(f"Drafter data: tiny answers, {len(pieces)} pieces")
    assert sorted(git("ls-files", "data/answers").split()) == sorted(
        ["data/answers/manifest.json"] + [f"data/answers/{p['file']}" for p in pieces])
    assert git("status", "--porcelain").splitlines() == ["A  other.txt"]
    with pytest.raises(HsdjaxError, match="not inside a git work tree"):
        generate_data(model, dict(cfg, answers=str(tmp_path / "loose")), tmp_path / "e", progress=False,
                      commit_every_s=60.0)
    with pytest.raises(HsdjaxError, match="set data.answers"):
        generate_data(model, {k: v for k, v in cfg.items() if k != "answers"}, tmp_path / "f", progress=False,
                      commit_every_s=60.0)


def test_a_killed_run_commits_the_answers_it_wrote(params, tmp_path, monkeypatch):
    """A SIGTERM (``kill``, a session ending; a job started with ``&`` ignores Ctrl-C) stops a run that
    commits its answers like Ctrl-C: the pieces written so far are committed although the commit
    interval has not passed, and the previous SIGTERM handler is back."""
    import os
    import signal

    repo, git = git_repo(tmp_path)
    cfg = dict(CFG_DATA, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(12, seed=11)),
               answers=str(repo / "answers"))
    real_add = AnswerStore.add

    def add_then_kill(self, *args, **kwargs):
        entry = real_add(self, *args, **kwargs)
        if len(self.pieces) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return entry

    monkeypatch.setattr(AnswerStore, "add", add_then_kill)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        generate_data(tiny_model(params), cfg, tmp_path / "d", progress=False, commit_every_s=3600.0)
    assert signal.getsignal(signal.SIGTERM) == before
    assert sorted(git("ls-files", "answers").split()) == ["answers/manifest.json", "answers/piece_00000.npz",
                                                          "answers/piece_00001.npz"]


def test_loaded_states_are_one_memory_mapped_file_made_once(params, tmp_path):
    """``load_shards``' states (most of the data) are a read-only memory map of one file made from the
    shards on the first load and reused by the next (the other method's training): the same values as
    the shards hold, in order; loading other shards replaces the file."""
    cfg = dict(CFG_DATA, shard_tokens=60, prompts=write_prompts(tmp_path / "p.jsonl", random_prompts(8, seed=5)))
    man = generate_data(tiny_model(params), cfg, tmp_path / "data", progress=False)
    first = load_shards(tmp_path / "data")
    files = list((tmp_path / "data").glob("states-*.npy"))
    assert len(files) == 1 and isinstance(first["states"], np.memmap)
    assert not first["states"].flags.writeable
    stamp = files[0].stat().st_mtime_ns
    parts = []
    for shard in man["shards"]:
        with np.load(tmp_path / "data" / shard["file"]) as z:
            parts.append(z["states"])
    assert np.array_equal(first["states"].view(np.uint16), np.concatenate(parts))
    again = load_shards(tmp_path / "data")
    assert files[0].stat().st_mtime_ns == stamp  # reused, not written again
    assert np.array_equal(np.asarray(again["states"], np.float32), np.asarray(first["states"], np.float32))
    load_shards(tmp_path / "data", limit_tokens=int(man["shards"][0]["tokens"]))
    assert [f.name for f in (tmp_path / "data").glob("states-*.npy")] != [files[0].name]


def test_bfloat16_rerecording_is_close_to_float32_and_not_part_of_the_data(smollm_kernel):
    """``data.rerecord_dtype="bfloat16"``: the teacher-forced passes multiply the decoded projections in
    bfloat16 (float32 sums), recording states close to the float32 pass's and the same top ids nearly
    everywhere; where the answers live and how they are re-recorded is not part of the data's key."""
    import ml_dtypes

    from hsdjax.kernels import cpu_matmul

    model = smollm_kernel
    rng = np.random.RandomState(3)
    store = AnswerStore(ROOT / "data/answers/smollm2-135m",
                        json.loads((ROOT / "data/answers/smollm2-135m/manifest.json").read_text()))
    docs = [d["tokens"][:200] for d in store.read(store.pieces[0])[:4]] + [rng.randint(0, 49152, 70).astype(np.int32)]
    drafter, dparams = datagen.recording_drafter(model, 8)
    assert datagen.rerecording_target(model, "float32") is model
    fast = datagen.rerecording_target(model, "bfloat16")
    assert fast.cfg.prefill_dot_dtype == "bfloat16" and fast.cfg.cpu_matmul_prefill_xla
    layers = fast.params["layers"]
    assert all(w.dtype in (jnp.bfloat16, jnp.float32) for w in jax.tree_util.tree_leaves(layers))
    assert any(w.dtype == jnp.bfloat16 for w in jax.tree_util.tree_leaves(layers))
    exact, _ = datagen.teacher_forced(model, drafter, dparams, docs, 4)
    rounded, _ = datagen.teacher_forced(fast, drafter, dparams, docs, 4)
    a = np.concatenate([r["states"] for r in exact]).view(ml_dtypes.bfloat16).astype(np.float32)
    b = np.concatenate([r["states"] for r in rounded]).view(ml_dtypes.bfloat16).astype(np.float32)
    rel = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-6)
    assert 0 < np.median(rel) < 0.02 and np.percentile(rel, 99) < 0.1, (np.median(rel), np.percentile(rel, 99))
    ids_a = np.concatenate([r["top_ids"][:, 0] for r in exact])
    ids_b = np.concatenate([r["top_ids"][:, 0] for r in rounded])
    assert np.mean(ids_a == ids_b) > 0.97
    cfg = dict(CFG_DATA, prompts="p.jsonl")
    assert datagen.data_key("x", cfg) == datagen.data_key("x", dict(cfg, rerecord_dtype="bfloat16"))
    assert datagen.data_settings(dict(cfg, rerecord_dtype="bfloat16"))["rerecord_dtype"] == "bfloat16"
    assert (datagen.rerecording_target(model, "auto") is model) != cpu_matmul.has_bf16_units()
    with pytest.raises(HsdjaxError, match="data.rerecord_dtype must be float32, bfloat16 or auto"):
        datagen.data_settings(dict(cfg, rerecord_dtype="float16"))

"""Recorded answers: the token ids of a target's own answers to the training prompts, kept as versioned
data in the repository so that a drafter's data can be rebuilt on any machine without generating a token.

Generating the answers is the expensive part of a drafter's data (hours on a small CPU); the hidden
states and logits a drafter trains on are then one teacher-forced pass over each document away
(``datagen.rerecord_pieces``). A folder of answers holds ``manifest.json`` and one compressed piece per
data shard (``piece_00000.npz``), each with, per document of the shard:

- ``tokens``: the document's token ids, concatenated (uint16 where the vocabulary fits, else uint32);
- ``lengths``: each document's number of tokens; ``prompts``: the stream index of its prompt;
- ``answer``: which tokens the target generated (bit-packed, ``np.packbits``).

The manifest names the target (name and fingerprint, the sha256 of its weights), the tokenizer's hash,
the data settings and their key (``datagen.data_key``), and per piece its file, tokens, answer tokens,
prompts and sha256. Opening a folder checks the target, the tokenizer and the settings, and refuses
answers of another target, tokenizer or prompt recipe with an error that says which.

Pieces are written as the data run goes (each a few hundred kB for 16k tokens), so a long run whose
pieces are committed can be continued on another machine: the pieces re-record there, and generation
goes on from the prompts no piece holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from hsdjax.errors import HsdjaxError

FORMAT = 1
CHECKED = ("target_fingerprint", "tokenizer", "data_key")  # what must match for the answers to be this data's


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class AnswerStore:
    """A folder of recorded answers (see the module docstring). ``meta``: this run's ``target``,
    ``target_fingerprint``, ``tokenizer``, ``data_key``, ``settings``; a folder written for other values
    of the ``CHECKED`` keys is refused."""

    def __init__(self, folder: str | Path, meta: dict[str, Any]):
        self.folder = Path(folder)
        self.manifest_path = self.folder / "manifest.json"
        if self.manifest_path.exists():
            try:
                self.manifest = json.loads(self.manifest_path.read_text())
            except json.JSONDecodeError as e:
                raise HsdjaxError(f"{self.manifest_path}: not JSON ({e.msg} at line {e.lineno})") from None
            if self.manifest.get("format") != FORMAT:
                raise HsdjaxError(f"{self.manifest_path}: answers format {self.manifest.get('format')!r}, "
                                  f"this hsdjax reads format {FORMAT}")
            for key in CHECKED:
                have, want = self.manifest.get(key), meta.get(key)
                if have != want:
                    what = {"target_fingerprint": f"target {self.manifest.get('target')!r} (weights {have})",
                            "tokenizer": f"tokenizer {have}", "data_key": f"data settings {have}"}[key]
                    raise HsdjaxError(f"{self.folder} holds the answers of {what}, not of this run's "
                                      f"({want}); point data.answers at another folder")
        else:
            self.manifest = {"format": FORMAT, **meta, "pieces": [], "tokens": 0, "answer_tokens": 0}

    @property
    def pieces(self) -> list[dict[str, Any]]:
        return self.manifest["pieces"]

    def held_prompts(self) -> set[int]:
        """Stream indices of every prompt some piece answers."""
        return {i for piece in self.pieces for i in piece["prompts"]}

    def add(self, docs: list[dict[str, np.ndarray]], prompts: list[int]) -> dict[str, Any]:
        """Write one piece: ``docs`` (each with ``tokens`` and ``answer``), ``prompts`` their stream indices."""
        if len(docs) != len(prompts) or not docs:
            raise ValueError("one prompt index per document, and at least one document")
        self.folder.mkdir(parents=True, exist_ok=True)
        tokens = np.concatenate([d["tokens"] for d in docs]).astype(np.int64)
        if tokens.min() < 0:
            raise ValueError("negative token id")
        dtype = np.uint16 if tokens.max() < 2**16 else np.uint32
        answer = np.concatenate([np.asarray(d["answer"], bool) for d in docs])
        name = f"piece_{len(self.pieces):05d}.npz"
        tmp = self.folder / f"{name}.{os.getpid()}.tmp.npz"
        np.savez_compressed(tmp, tokens=tokens.astype(dtype), answer=np.packbits(answer),
                            lengths=np.array([len(d["tokens"]) for d in docs], np.int32),
                            prompts=np.array(prompts, np.int64))
        os.replace(tmp, self.folder / name)
        entry = {"file": name, "tokens": int(tokens.size), "answer_tokens": int(answer.sum()),
                 "prompts": [int(p) for p in prompts], "sha256": _sha256(self.folder / name)}
        self.pieces.append(entry)
        self.manifest["tokens"] += entry["tokens"]
        self.manifest["answer_tokens"] += entry["answer_tokens"]
        self._save()
        return entry

    def read(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """A piece's documents: ``{"prompt": stream index, "tokens": int32 ids, "answer": bool mask}``,
        after checking the file against the manifest (a damaged or edited piece is an error)."""
        path = self.folder / piece["file"]
        if not path.is_file():
            raise HsdjaxError(f"{path}: missing (the manifest lists it)")
        if _sha256(path) != piece["sha256"]:
            raise HsdjaxError(f"{path}: its sha256 differs from the manifest's (damaged or replaced)")
        with np.load(path) as z:
            tokens, lengths, prompts = z["tokens"].astype(np.int32), z["lengths"], z["prompts"]
            answer = np.unpackbits(z["answer"], count=tokens.size).astype(bool)
        if int(lengths.sum()) != tokens.size or tokens.size != piece["tokens"]:
            raise HsdjaxError(f"{path}: {tokens.size} tokens, its documents {int(lengths.sum())}, "
                              f"the manifest {piece['tokens']}")
        ends = np.cumsum(lengths)
        return [{"prompt": int(p), "tokens": tokens[e - n: e], "answer": answer[e - n: e]}
                for p, n, e in zip(prompts.tolist(), lengths.tolist(), ends.tolist())]

    def _save(self) -> None:
        tmp = self.manifest_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.manifest_path)


def shard_documents(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A data shard's documents (``tokens``, ``answer``) in order, split by its ``doc`` numbers."""
    doc = arrays["doc"]
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    ends = np.r_[starts[1:], doc.size]
    return [{"tokens": arrays["tokens"][a:b], "answer": arrays["answer"][a:b]} for a, b in zip(starts, ends)]


class GitCommits:
    """Commits a folder of answers to the git work tree that holds it while a data run goes: after a piece
    is written, when ``every_s`` seconds have passed since the last commit (0: after every piece), and at
    the end. Only that folder is committed (other staged or changed files are left alone); a commit that
    fails (no identity, a lock) is reported through ``log`` and the run goes on."""

    def __init__(self, folder: str | Path, every_s: float, log: Any = print):
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every_s, self.log = every_s, log
        found = self._git("rev-parse", "--show-toplevel", check=False)
        if found.returncode != 0:
            raise HsdjaxError(f"{self.folder} is not inside a git work tree, so its answers cannot be committed "
                              "(leave out --commit-answers, or point data.answers into a repository)")
        self.last = time.monotonic()

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(self.folder), *args], capture_output=True, text=True, check=check)

    def maybe(self, store: AnswerStore, *, force: bool = False) -> bool:
        """Commit now if it is time (or ``force``); True when a commit was made."""
        if not force and time.monotonic() - self.last < self.every_s:
            return False
        self.last = time.monotonic()
        msg = (f"Drafter data: {store.manifest.get('target')} answers, {len(store.pieces)} pieces "
               f"({store.manifest['tokens']} tokens, {store.manifest['answer_tokens']} generated)")
        try:
            self._git("add", "--", ".")
            if self._git("diff", "--cached", "--quiet", "--", ".", check=False).returncode == 0:
                return False  # nothing new
            self._git("commit", "-q", "-m", msg, "--", ".")
        except subprocess.CalledProcessError as e:
            self.log(f"warning: could not commit {self.folder}: {(e.stderr or e.stdout or '').strip()[:300]}")
            return False
        return True

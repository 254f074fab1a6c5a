"""Offline model registry: models.json, resolve, verification cache, and chunk assembly (no downloads)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hsdjax.errors import HsdjaxError, ModelNotInstalled
from hsdjax.runtime import registry

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "models.json"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("HSDJAX_HOME", str(tmp_path / "home"))


def _parts(tmp_path: Path, sizes=(1000, 2500, 7)) -> tuple[list[Path], bytes]:
    data = bytes((i * 7 + 3) % 251 for i in range(sum(sizes)))
    parts, pos = [], 0
    for i, n in enumerate(sizes):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data[pos : pos + n])
        parts.append(p)
        pos += n
    return parts, data


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.suffix == ".gguf")


# ----------------------------------------------------------------------------------- models.json


def test_json_entries_complete():
    data = json.loads(CONFIG.read_text())
    assert data["default"] in data["models"]
    for name, e in data["models"].items():
        assert set(e) == {"description", "family", "packages", "files", "size", "sha256", "draft_model", "license"}
        assert e["family"] in ("llama", "qwen2", "gemma3")
        assert e["description"] and e["license"]
        assert e["packages"] and all("==" in p for p in e["packages"])
        dists = {p.split("==")[0] for p in e["packages"]}
        assert e["files"] and all(len(f) == 2 and f[0] in dists for f in e["files"])
        assert isinstance(e["size"], int) and e["size"] > 0
        assert len(e["sha256"]) == 64 and int(e["sha256"], 16) >= 0
        assert e["draft_model"] is None or e["draft_model"] in data["models"]


def test_registry_api_matches_json():
    data = json.loads(CONFIG.read_text())
    assert registry.default_model() == data["default"] == "smollm2-135m"
    assert [s.name for s in registry.list_models()] == list(data["models"])
    spec = registry.get_spec("qwen2.5-coder-1.5b")
    assert spec.chunked and spec.family == "qwen2" and spec.draft_model == "qwen2.5-coder-0.5b"
    assert spec.size == 1117320768 and len(spec.files) == 22
    assert not registry.get_spec("smollm2-135m").chunked


def test_chunked_model_path_is_in_cache(tmp_path):
    assert registry.gguf_path("qwen2.5-coder-0.5b") == tmp_path / "home" / "models" / "qwen2.5-coder-0.5b.gguf"


# ------------------------------------------------------------------------------------------ resolve


def test_smollm2_resolves_and_verifies(tmp_path):
    assert registry.is_installed("smollm2-135m")
    assert registry.install_state("smollm2-135m") == "installed"
    src = registry.resolve("smollm2-135m")
    assert src.kind == "gguf" and src.spec is not None and src.spec.name == "smollm2-135m"
    assert src.path.is_file() and "site-packages" in str(src.path)
    db = tmp_path / "home" / "models" / "verified.json"
    entry = json.loads(db.read_text())[str(src.path.resolve())]
    assert entry["size"] == src.spec.size and entry["sha256"] == src.spec.sha256
    registry.verify("smollm2-135m")  # cached: no rehash needed, still passes
    assert registry.pull("smollm2-135m", progress=False, install=False) == src.path


def test_verification_cache_skips_rehash(monkeypatch):
    registry.verify("smollm2-135m")
    monkeypatch.setattr(registry, "file_sha256", lambda *a, **k: pytest.fail("rehashed a verified file"))
    registry.verify("smollm2-135m")


def test_unknown_name_error():
    with pytest.raises(HsdjaxError) as e:
        registry.get_spec("no-such-model")
    msg = str(e.value)
    assert "no-such-model" in msg and "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg
    assert ".gguf" in msg and "safetensors" in msg
    with pytest.raises(HsdjaxError) as e:
        registry.resolve("no-such-model")
    assert "smollm2-135m" in str(e.value) and ".gguf" in str(e.value)


def test_not_installed_message_is_one_line(monkeypatch):
    monkeypatch.setattr(registry, "_missing_packages", lambda spec: list(spec.packages))
    name = "qwen2.5-coder-0.5b"
    assert not registry.is_installed(name)
    assert registry.install_state(name) == "not installed"
    with pytest.raises(ModelNotInstalled) as e:
        registry.resolve(name)
    msg = str(e.value)
    assert "\n" not in msg and f"hsdjax models pull {name}" in msg
    with pytest.raises(ModelNotInstalled) as e:
        registry.pull(name, progress=False, install=False)
    assert "\n" not in str(e.value) and f"hsdjax models pull {name}" in str(e.value)


def test_install_state_packages_not_assembled(monkeypatch):
    monkeypatch.setattr(registry, "_missing_packages", lambda spec: [])
    assert registry.install_state("qwen2.5-coder-0.5b") == "packages installed, not assembled"
    monkeypatch.setattr(registry, "_missing_packages", lambda spec: list(spec.packages[1:]))
    assert registry.install_state("qwen2.5-coder-0.5b").startswith("partially installed (1 of 6")


def test_truncated_assembled_file_is_named(monkeypatch):
    path = registry.gguf_path("qwen2.5-coder-0.5b")
    path.write_bytes(b"GGUF" + bytes(100))
    assert registry.install_state("qwen2.5-coder-0.5b").startswith("corrupt")
    with pytest.raises(HsdjaxError) as e:
        registry.verify("qwen2.5-coder-0.5b")
    assert str(path) in str(e.value) and "expected 491400064" in str(e.value)


def test_resolve_local_gguf(tmp_path):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + bytes(16))
    src = registry.resolve(str(f))
    assert (src.kind, src.name, src.path, src.spec) == ("gguf", "tiny", f.resolve(), None)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(HsdjaxError, match="not a GGUF"):
        registry.resolve(str(bad))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"GGUF")
    with pytest.raises(HsdjaxError, match="not a .gguf"):
        registry.resolve(str(txt))


def test_resolve_registered_file_by_path():
    path = registry.gguf_path("smollm2-135m")
    src = registry.resolve(str(path))
    assert src.spec is not None and src.name == "smollm2-135m"


def test_resolve_hf_folder(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(HsdjaxError, match="safetensors"):
        registry.resolve(str(d))
    (d / "model.safetensors").write_bytes(b"")
    src = registry.resolve(str(d))
    assert (src.kind, src.name, src.path, src.spec) == ("hf", "my-model", d.resolve(), None)


def test_resolve_missing_path(tmp_path):
    with pytest.raises(HsdjaxError, match="no such file"):
        registry.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(HsdjaxError):
        registry.resolve(str(tmp_path / "missing-folder"))


# ----------------------------------------------------------------------------------------- assembly


def test_file_sha256(tmp_path):
    parts, data = _parts(tmp_path)
    assert registry.file_sha256(parts[1]) == hashlib.sha256(parts[1].read_bytes()).hexdigest()


def test_assemble_ok(tmp_path):
    parts, data = _parts(tmp_path)
    out = tmp_path / "out" / "m.gguf"
    got = registry.assemble_parts(parts, out, len(data), hashlib.sha256(data).hexdigest())
    assert got == out and out.read_bytes() == data
    assert _leftovers(out.parent) == ["m.gguf"]


def test_assemble_wrong_size(tmp_path):
    parts, data = _parts(tmp_path)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(HsdjaxError, match=f"{len(data)} bytes, expected {len(data) + 1}"):
        registry.assemble_parts(parts, out, len(data) + 1, hashlib.sha256(data).hexdigest())
    assert not out.exists() and (not out.parent.exists() or _leftovers(out.parent) == [])


def test_assemble_wrong_sha_leaves_nothing(tmp_path):
    parts, data = _parts(tmp_path)
    out = tmp_path / "m.gguf"
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(HsdjaxError) as e:
        registry.assemble_parts(parts, out, len(data), wrong)
    assert wrong in str(e.value) and hashlib.sha256(data).hexdigest() in str(e.value)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_assemble_names_bad_part(tmp_path):
    parts, data = _parts(tmp_path)
    good = [(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in parts]
    raw = bytearray(parts[1].read_bytes())
    raw[10] ^= 0xFF
    parts[1].write_bytes(bytes(raw))
    out = tmp_path / "m.gguf"
    with pytest.raises(HsdjaxError, match="bad part.*part01.bin"):
        registry.assemble_parts(parts, out, len(data), hashlib.sha256(data).hexdigest(), part_checks=good)
    parts[2].write_bytes(b"x")
    with pytest.raises(HsdjaxError, match="truncated part.*part02.bin"):
        registry.assemble_parts(parts, out, len(data), hashlib.sha256(data).hexdigest(), part_checks=good)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_assemble_missing_part(tmp_path):
    parts, data = _parts(tmp_path)
    parts[0].unlink()
    with pytest.raises(HsdjaxError, match="missing part.*part00.bin"):
        registry.assemble_parts(parts, tmp_path / "m.gguf", len(data), hashlib.sha256(data).hexdigest())


def test_assemble_replaces_existing_atomically(tmp_path):
    parts, data = _parts(tmp_path)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    with pytest.raises(HsdjaxError):
        registry.assemble_parts(parts, out, len(data), "0" * 64)
    assert out.read_bytes() == b"old"  # a failed assembly never touches the existing file
    registry.assemble_parts(parts, out, len(data), hashlib.sha256(data).hexdigest())
    assert out.read_bytes() == data


def test_pull_chunked_from_installed_parts(tmp_path, monkeypatch):
    """pull(install=False) assembles a chunked model from its parts, records it, and is idempotent."""
    parts, data = _parts(tmp_path)
    spec = registry.ModelSpec(
        name="toy", description="toy", family="llama", packages=("toy-a==1", "toy-b==1", "toy-c==1"),
        files=(("toy-a", "a.bin"), ("toy-b", "b.bin"), ("toy-c", "c.bin")), size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), draft_model=None, license="MIT")
    where = dict(zip([f[1] for f in spec.files], parts))
    monkeypatch.setattr(registry, "get_spec", lambda name: spec)
    monkeypatch.setattr(registry, "_missing_packages", lambda s: [])
    monkeypatch.setattr(registry, "_installed_file", lambda d, rel: where[rel])
    monkeypatch.setattr(registry, "_record_entry", lambda d, rel: (None, None))
    monkeypatch.setattr(registry, "_pip_install", lambda *a, **k: pytest.fail("pip must not run"))
    out = registry.pull("toy", progress=False, install=False)
    assert out == tmp_path / "home" / "models" / "toy.gguf" and out.read_bytes() == data
    assert registry.install_state("toy") == "installed"
    monkeypatch.setattr(registry, "assemble_parts", lambda *a, **k: pytest.fail("re-assembled"))
    monkeypatch.setattr(registry, "file_sha256", lambda *a, **k: pytest.fail("rehashed"))
    assert registry.pull("toy", progress=False, install=False) == out
    registry.verify("toy")

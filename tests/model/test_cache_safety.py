"""The converted model's cache under faults (issue 31): a full disk, damaged weights, two processes converting.

A full disk is made real with a small tmpfs mounted in a mount namespace of the test's own
(``unshare``), so the kernel answers the converter's writes with ENOSPC.  Damage is random bytes written over the weights.  Two processes
are two interpreters started at once on one empty cache.  Each converter here is fast (a tiny model,
or plain files); ``tests/http/test_faults.py`` runs the real 20-second conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tiny_models import save_tiny, tiny_config

import mechserve.model.checkpoint as models
from mechserve.api.errors import ModelLoadError
from mechserve.model.checkpoint import resolve_model

ROOT = Path(__file__).resolve().parents[2]


def _fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MECHSERVE_CACHE", str(cache))
    monkeypatch.setattr(models, "embedded_gguf", lambda: tmp_path / "fake.gguf")
    return cache


def _tiny_converter(gguf: Path, dest: Path) -> None:
    """A converter that saves a tiny model as the real one does (transformers' ``save_pretrained``, safetensors)."""
    save_tiny(dest, tiny_config())
    (dest / "tokenizer.json").write_text("{}")


def small_filesystem(directory: Path, size: str) -> list[str]:
    """An argv prefix that runs a command with a ``size`` tmpfs mounted on ``directory``, in a mount namespace of
    its own (``unshare``: as root, or as a user with user namespaces), so that writes past ``size`` fail with a
    real ENOSPC from the kernel.  (safetensors writes a temporary file and renames it, so ``/dev/full`` behind
    a link cannot stand in.)"""
    directory.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "--map-root-user", "--mount", "sh", "-c", script, "sh", size, str(directory)]


FULL_DISK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import mechserve.model.checkpoint as models
    from tiny_models import save_tiny, tiny_config

    def convert(gguf, dest):
        save_tiny(dest, tiny_config())  # 364 KB of weights into a 128 KB file system
        (dest / "tokenizer.json").write_text("{}")

    models.embedded_gguf = lambda: Path("fake.gguf")
    models._convert_gguf = convert
    from mechserve.cli.main import main
    status = main(["generate", "hello"])
    print(sorted(p.name for p in Path(sys.argv[1]).iterdir()))
    sys.exit(status)
    """
)


def test_a_full_disk_on_first_run_is_the_caches_message(tmp_path: Path) -> None:
    """It was ``internal error: SafetensorError ... No space left on device``: a one-line cache message now,
    exit status 2, nothing half-written left behind."""
    cache = tmp_path / "cache"
    env = {**os.environ, "MECHSERVE_CACHE": str(cache), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    argv = [*small_filesystem(cache, "128k"), sys.executable, "-c", FULL_DISK, str(cache)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"mechserve: error: cannot use the model cache {cache} (MECHSERVE_CACHE={cache}): No space left on device; "
        "set MECHSERVE_CACHE to a writable directory"
    )
    assert "Traceback" not in done.stderr and "Safetensor" not in done.stderr
    assert done.stdout.strip() == str([f".{models._CONVERTED_NAME}.lock"])


def test_damaged_weights_are_found_at_load_and_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Random bytes over the cached weights generated token 0 silently; now the load says what to do."""
    cache = _fake_gguf(monkeypatch, tmp_path)
    monkeypatch.setattr(models, "_convert_gguf", _tiny_converter)
    path = resolve_model("smollm2")
    weights = path / "model.safetensors"
    os.utime(weights)  # touched, same bytes: still good (the digest is checked, and agrees)
    assert resolve_model("smollm2") == path
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as info:
        resolve_model("smollm2")
    assert str(info.value) == (
        f"the converted model in {path} is damaged (model.safetensors: its content changed since it was written "
        "(SHA-256)); delete that directory and mechserve converts the embedded model again on its next run "
        "(MECHSERVE_CACHE sets where the cache is)"
    )
    weights.write_bytes(bytes(data[:100]))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: 100 bytes, \d+ when it was written"):
        resolve_model("smollm2")
    (path / "config.json").unlink()  # incomplete: converted again, which mends it
    assert resolve_model("smollm2") == path and (cache / models._CONVERTED_NAME / "config.json").is_file()


def test_a_cache_converted_before_digests_gets_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_gguf(monkeypatch, tmp_path)
    monkeypatch.setattr(models, "_convert_gguf", _tiny_converter)
    path = resolve_model("smollm2")
    (path / models.DIGEST_FILE).unlink()
    assert resolve_model("smollm2") == path and (path / models.DIGEST_FILE).is_file()


CONVERT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import mechserve.model.checkpoint as models

    def convert(gguf, dest):
        with open(sys.argv[2], "a") as log:
            log.write("converted\\n")
        go = Path(sys.argv[3])
        for _ in range(1200):  # until the test has seen the other process wait for this one
            if go.exists():
                break
            time.sleep(0.05)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (dest / name).write_text(name)

    models.embedded_gguf = lambda: Path(sys.argv[1])
    models._convert_gguf = convert
    path = models.resolve_model("smollm2")
    print(path, sorted(p.name for p in path.iterdir()))
    """
)


def test_two_processes_converting_at_once_convert_once(tmp_path: Path) -> None:
    """The second waits for the first's lock and uses what it renamed into place: it never converts again nor
    removes that directory (reading the code, a process finishing its own conversion could ``rmtree`` it)."""
    log, go = tmp_path / "conversions", tmp_path / "go"
    env = {**os.environ, "MECHSERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", CONVERT, str(tmp_path / "fake.gguf"), str(log), str(go)]
    errs = [tmp_path / "first.err", tmp_path / "second.err"]

    def start(err: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err.open("w"), text=True)

    first = start(errs[0])
    while not log.exists():  # the first holds the lock and converts
        assert first.poll() is None, errs[0].read_text()
        time.sleep(0.05)
    second = start(errs[1])
    while "another process is converting" not in errs[1].read_text():
        assert second.poll() is None, errs[1].read_text()
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], [e.read_text() for e in errs]
    assert outs[0] == outs[1] and "model.safetensors" in outs[0]
    assert log.read_text() == "converted\n"

"""A real ``mechserve serve`` process for the tests that must drive (or kill) the server itself.

``ServerProcess(model, *flags)`` starts ``python -m mechserve serve MODEL --port P FLAGS`` in a session of
its own, its stderr in a file, and waits until ``/health`` answers; ``stop(signal)`` ends it and
returns its exit status; ``log()`` is what it printed; ``rss()`` its resident memory in bytes (the
driver alone); ``metric(name)`` one value of ``/metrics``.  Also: the tiny models these servers run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>")


def save_chatml_byte_model(path: Path, max_position_embeddings: int = 4096) -> Path:
    """A tiny byte-level model (``tiny_models.save_byte_tokenizer``: any text is a token string, so grammars
    compile) whose tokenizer has ChatML's two special tokens and a ChatML chat template."""
    from tiny_models import BYTE_VOCAB, save_byte_tokenizer, save_tiny, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(
        vocab_size=BYTE_VOCAB, eos_token_id=0, bos_token_id=0, max_position_embeddings=max_position_embeddings
    )
    save_tiny(path, config, seed=3)
    fast = save_byte_tokenizer(path)
    fast.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    from mechserve.http import bind_socket

    sock = bind_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    return port


class ServerProcess:
    """``mechserve serve`` in a child process (see the module docstring)."""

    def __init__(
        self, model: Path | str, *flags: str, log: Path, env: dict[str, str] | None = None, name: str = "tiny"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        argv = [sys.executable, "-m", "mechserve", "serve", str(model), "--served-model-name", name]
        argv += ["--port", str(self.port), *flags]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = log.open("w")
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=environment, stdout=self._log, stderr=self._log, start_new_session=True
        )

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server never answered: {self.log()}"
            time.sleep(0.1)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        """The server process's resident memory in bytes (``VmRSS``)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str) -> float:
        """The first sample of ``name`` in ``/metrics`` (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        return 0.0

    def post(self, path: str, body: Any, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``signum`` to the server's process group (as Ctrl-C in a terminal does) and wait for its exit."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signum)
        try:
            return self.process.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's process group if it still runs (its ranks and sandbox included)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # anything it left behind
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.kill()

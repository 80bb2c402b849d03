"""Chat templates sent with a request, rendered in a child process with a time, memory and output bound.

A Jinja template is a program: ``{% for i in range(100000) %}{% for j in range(100000) %}`` runs
for hours and ``{{ 'ab ' * 3000000 }}`` builds megabytes, and jinja2's sandbox bounds neither.  A
server that renders templates from its requests (``--trust-request-chat-template``) therefore does
so in a ``TemplateSandbox``: one child process (``sandbox_child.py``, run with ``python -I``, never
importing mechserve) with

* a time bound: ``timeout_s`` per render; a timer in the child interrupts the template, and the
  parent kills the child once the bound has passed by a second (a new child starts on the next render);
* a memory bound: the child's address space is capped at its size after start plus ``memory_bytes``;
* an output bound: a text over ``max_chars`` characters is refused;
* isolation: the server's threads never run the template, so the engine and the event loop keep
  their pace, and a render in progress never holds up a shutdown (``close`` kills the child).

Each failure is a ``ParamError("chat_template", ...)`` that says which bound it met.  Renders are
serialised (one child); each waits at most ``timeout_s`` for the one before.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_RENDER_CHARS, RENDER_MEMORY_BYTES, RENDER_TIMEOUT_S

START_TIMEOUT_S = 60.0  # the child's start (it imports transformers' renderer)
CHILD = Path(__file__).with_name("sandbox_child.py")


class TemplateSandbox:
    """Renders request-supplied chat templates in a child process (see the module docstring).

    ``timeout_s``: seconds per render; ``memory_bytes``: what a render may allocate; ``max_chars``: the
    longest text.  Thread-safe; ``close`` ends the child (a render in progress then fails at once).
    """

    def __init__(
        self,
        timeout_s: float = RENDER_TIMEOUT_S,
        memory_bytes: int = RENDER_MEMORY_BYTES,
        max_chars: int = MAX_RENDER_CHARS,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_chars = max_chars
        self.renders = 0
        self.restarts = 0  # children killed past their time bound
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._closed = False

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        template: str,
        variables: Mapping[str, Any],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        """``template`` rendered over ``conversation`` (as ``apply_chat_template`` renders it: ``variables`` are
        the special tokens' strings and ``chat_template_kwargs``).  Raises ``ParamError("chat_template")``
        when the render fails or meets a bound, ``ValueError`` when the data is not JSON."""
        try:
            line = json.dumps(
                {
                    "messages": list(conversation),
                    "template": template,
                    "variables": dict(variables),
                    "tools": None if tools is None else list(tools),
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                }
            ).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the conversation cannot be sent to the template sandbox: {exc}") from None
        with self._lock:
            process = self._child()
            reply = self._exchange(process, line + b"\n")
            self.renders += 1
        if "text" in reply:
            return str(reply["text"])
        raise ParamError("chat_template", f"chat_template was refused: {reply.get('error', 'the render failed')}")

    def close(self) -> None:
        """End the child (a render waiting on it fails); later renders are refused."""
        self._closed = True
        process = self._process
        if process is not None:
            _kill(process)

    # -------------------------------------------------------------------------------------------------------------

    def _child(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise ParamError("chat_template", "chat_template: the server is shutting down")
        if self._process is not None and self._process.poll() is None:
            return self._process
        argv = [sys.executable, "-I", str(CHILD), str(self.memory_bytes), str(self.max_chars), str(self.timeout_s)]
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._process = process
        if self._read_line(process, time.monotonic() + START_TIMEOUT_S) != b"ready":
            _kill(process)
            raise ParamError("chat_template", "chat_template: the template sandbox could not start")
        return process

    def _exchange(self, process: subprocess.Popen[bytes], line: bytes) -> dict[str, Any]:
        assert process.stdin is not None
        try:
            process.stdin.write(line)
            process.stdin.flush()
        except (BrokenPipeError, OSError):
            _kill(process)
            raise ParamError("chat_template", "chat_template: the template sandbox stopped") from None
        answer = self._read_line(process, time.monotonic() + self.timeout_s + 1.0)
        if answer is None:
            _kill(process)
            self.restarts += 1
            if self._closed:
                raise ParamError("chat_template", "chat_template: the server is shutting down")
            raise ParamError(
                "chat_template", f"chat_template was refused: it took more than {self.timeout_s:g} s to render"
            )
        try:
            reply: dict[str, Any] = json.loads(answer)
        except ValueError:
            _kill(process)
            raise ParamError("chat_template", "chat_template: the template sandbox answered nonsense") from None
        return reply

    def _read_line(self, process: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        """One line from the child, without its newline; None past ``deadline`` or when the child ended."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        chunks: list[bytes] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.25))
            if not ready:
                if self._closed or process.poll() is not None:
                    return None
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)[:-1]


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


__all__ = ["MAX_RENDER_CHARS", "RENDER_MEMORY_BYTES", "RENDER_TIMEOUT_S", "TemplateSandbox"]

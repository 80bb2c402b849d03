"""The child process of ``mechserve.entrypoints.sandbox.TemplateSandbox``: renders chat templates, nothing else.

Run by path with ``python -I`` (it never imports mechserve): it imports transformers' template
renderer (jinja2's sandboxed environment, as ``apply_chat_template`` uses it), then caps its own
address space at what it uses plus ``argv[1]`` bytes, and answers one JSON line per JSON line read
from stdin::

    {"messages", "template", "variables", "tools", "add_generation_prompt", "continue_final_message"}
    -> {"text": ...} or {"error": ...}

Each render has ``argv[3]`` seconds (a timer interrupts the template's Python loops; the parent kills
the process past that), and a text over ``argv[2]`` characters is refused.  The process dies with its
parent (``PR_SET_PDEATHSIG``) and ignores Ctrl-C (the parent ends it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import resource
import signal
import sys
from typing import Any

READY = "ready"


class RenderTimeout(Exception):
    pass


def _address_space() -> int:
    """This process's virtual memory size in bytes (``VmSize``), 0 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _on_alarm(signum: int, frame: Any) -> None:
    raise RenderTimeout


def _render(request: dict[str, Any], max_chars: int) -> dict[str, str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered: Any = render_jinja_template(
        conversations=[request["messages"]],
        tools=request.get("tools"),
        chat_template=request["template"],
        add_generation_prompt=bool(request.get("add_generation_prompt")),
        continue_final_message=bool(request.get("continue_final_message")),
        **request.get("variables", {}),
    )
    text = str(rendered[0][0])  # (the rendered conversations, their generation indices)
    if len(text) > max_chars:
        return {"error": f"it renders to more than {max_chars} characters", "kind": "size"}
    return {"text": text}


def main() -> None:
    memory, max_chars, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    import transformers.utils.chat_template_utils  # noqa: F401  (before the cap: the import is the baseline)

    base = _address_space()
    if base:
        resource.setrlimit(resource.RLIMIT_AS, (base + memory, base + memory))
    signal.signal(signal.SIGALRM, _on_alarm)
    out = sys.stdout
    out.write(READY + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                reply = _render(request, max_chars)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except RenderTimeout:
            reply = {"error": f"it took more than {seconds:g} s to render", "kind": "time"}
        except MemoryError:
            reply = {"error": f"it needs more than {memory >> 20} MiB of memory to render", "kind": "memory"}
        except RecursionError:
            reply = {"error": "it recurses too deeply", "kind": "render"}
        except Exception as exc:  # the template's own raise_exception, a Jinja error, the sandbox's refusal
            detail = " ".join(str(exc).split())[:300] or type(exc).__name__
            reply = {"error": f"it cannot render these messages: {detail}", "kind": "render"}
        try:
            out.write(json.dumps(reply) + "\n")
            out.flush()
        except MemoryError:
            out.write('{"error": "its text does not fit in memory", "kind": "memory"}\n')
            out.flush()


if __name__ == "__main__":
    main()

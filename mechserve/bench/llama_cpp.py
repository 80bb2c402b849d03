"""llama.cpp as a benchmark peer: finding or building ``llama-server``, its GGUFs, its requests and replies.

* **Finding** (``find_tool``): ``$LLAMA_SERVER`` (its siblings for the other tools), else ``llama-server``
  on ``PATH``, else the build in ``$MECHSERVE_CACHE/llama.cpp/<version>/bin``.
* **Building** (``python -m mechserve.bench.llama_cpp build``, what ``make llama-cpp`` runs): the
  llama.cpp sources vendored in the PyPI source distribution of ``llama-cpp-python`` ``SDIST_VERSION``
  (fetched with pip, checked against ``SDIST_SHA256``), configured with CMake for the CPU only and built
  with the system compiler: ``llama-server``, ``llama-quantize``, ``llama-perplexity``, ``llama-bench``.
  On a CPU with AMX, ggml's AMX path crashed on the Q4_1 file, so there the build adds
  ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16``.  Nothing is downloaded at run time.
* **GGUFs** (``ensure_gguf``): the embedded model's own Q4_1 file as shipped, and F32, BF16, Q8_0,
  Q4_K_M, Q5_K_M and Q6_K files made from it once with ``llama-quantize --allow-requantize`` (the F32
  one holds exactly the float32 weights mechserve's exact mode runs; the K-quant ones are what
  llama.cpp users download, which mechserve runs with ``--model FILE.gguf``).  SmolLM2's rows of 576
  are not whole 256-weight blocks, so llama-quantize stores those matrices in its fallbacks (Q5_0 for
  Q4_K_M, Q5_1 for Q5_K_M, Q8_0 for Q6_K) and only ffn_down (rows of 1536) in K-quants.
  ``python -m mechserve.bench.llama_cpp gguf KIND`` prints a file's path (making it first).
* **Requests** (``completion_body``): token-id prompts to ``/completion`` with ``n_predict``,
  ``ignore_eos``, ``temperature 0`` (greedy), ``cache_prompt false``, streamed; each event carries the
  ids it adds (``parse_event``).  ``ignore_eos`` makes the server ban the model's end-of-generation ids
  (logit bias -inf on 0, 2, 4 for SmolLM2), so greedy output equals an engine that only does not stop
  at EOS until the argmax would be one of them.
* **Running** (``LlamaServer``: the one way the benchmarks start and stop ``llama-server``, used by
  ``LlamaCppRunner`` and ``bench spec-decode --llama-cpp``): one ``llama-server`` per mode (``gguf_for``:
  ``MODE_GGUF``'s file, or a GGUF model itself) with ``SLOTS`` parallel slots (or as many as a caller
  asks for); the same seeded workloads as the other engines, timed per token at the client.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechserve.api.env import cache_dir

SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity", "llama-bench", "llama-tokenize")
SERVER_ENV = "LLAMA_SERVER"
# Parallel sequences the server decodes together, as the measurement ran it.
SLOTS = 32
# mechserve's mode -> the GGUF llama.cpp runs for it.
MODE_GGUF = {"exact": "f32", "fast": "bf16", "q4_1": "q4_1", "q8_0": "q8_0"}
# The embedded model's GGUFs ensure_gguf makes (llama-quantize's type names, lower-cased), the shipped q4_1 aside.
GGUF_KINDS = ("f32", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # the web UI would be fetched from a model hub while building; the API does not need it
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)


def home() -> Path:
    """Where this module builds llama.cpp and keeps its GGUFs: ``$MECHSERVE_CACHE/llama.cpp``."""
    return cache_dir() / "llama.cpp"


def build_bin() -> Path:
    return home() / f"llama-cpp-python-{SDIST_VERSION}" / "bin"


def find_tool(name: str = "llama-server") -> Path | None:
    """The executable ``name`` (one of ``TOOLS``): beside ``$LLAMA_SERVER``, on ``PATH``, or in ``build_bin()``."""
    given = os.environ.get(SERVER_ENV, "").strip()
    if given:
        server = Path(given).expanduser()
        candidate = server if name == "llama-server" else server.with_name(name)
        return candidate if _executable(candidate) else None
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    built = build_bin() / name
    return built if _executable(built) else None


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def missing_message() -> str | None:
    """None when ``llama-server`` is found, else the one line saying why the engine is skipped and how to get it.

    Raises ``OSError`` when ``$LLAMA_SERVER`` is set but names no executable file: a binary asked for
    explicitly is an error, not a reason to skip the engine (and exit 0 with nothing run).
    """
    given = os.environ.get(SERVER_ENV, "").strip()
    if given and find_tool() is None:
        raise OSError(f"{SERVER_ENV}={given} is not an executable file (unset it to skip llama-cpp)")
    if find_tool() is None:
        return (
            f"llama-cpp skipped: llama-server not found (set {SERVER_ENV}, put it on PATH, or build it with "
            f"`make llama-cpp` into {build_bin()})"
        )
    return None


# Building ---------------------------------------------------------------------------------------------------------


def amx_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The flags that keep ggml off AMX on a CPU whose ``/proc/cpuinfo`` lists AMX, else none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    return AMX_FLAGS if " amx_" in cpuinfo or "\tamx_" in cpuinfo else ()


def cmake_arguments(source: Path, build: Path, extra_flags: Sequence[str] = ()) -> list[str]:
    """The CMake configure command line for a CPU-only build of ``source`` into ``build``."""
    flags = " ".join(extra_flags)
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        *CMAKE_OPTIONS,
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
    ]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(into: Path) -> Path:
    """The ``llama-cpp-python`` source distribution in ``into`` (fetched with pip when absent), hash-checked.

    Raises ``OSError`` when pip fails or the file's sha256 is not ``SDIST_SHA256``.
    """
    into.mkdir(parents=True, exist_ok=True)
    sdist = into / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.is_file() or _sha256(sdist) != SDIST_SHA256:
        sdist.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        cmd += ["--disable-pip-version-check", "-d", str(into), f"llama-cpp-python=={SDIST_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode or not sdist.is_file():
            raise OSError(
                f"pip could not fetch llama-cpp-python {SDIST_VERSION}: {(done.stderr or done.stdout)[-500:]}"
            )
    if _sha256(sdist) != SDIST_SHA256:
        raise OSError(f"{sdist} does not have the expected sha256 {SDIST_SHA256}")
    return sdist


def build(jobs: int = 2, log: Any = sys.stderr) -> Path:
    """Build ``TOOLS`` into ``build_bin()`` unless they are all there; return the ``llama-server`` path.

    About 10 minutes on two cores.  Raises ``OSError`` naming what failed (pip, CMake, the compiler).
    """
    out = build_bin()
    if all(_executable(out / t) for t in TOOLS):
        return out / "llama-server"
    for program in ("cmake", "c++"):
        if shutil.which(program) is None and not (program == "c++" and shutil.which("g++")):
            raise OSError(f"building llama.cpp needs {program} (apt-get install cmake g++)")
    root = out.parent
    sdist = fetch_sdist(root)
    source = root / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    build_dir = root / "build"
    extra = amx_flags()
    print(f"llama.cpp: configuring {source} (extra flags: {' '.join(extra) or 'none'})", file=log, flush=True)
    for cmd in (
        cmake_arguments(source, build_dir, extra),
        ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise OSError(f"{' '.join(cmd[:3])} failed: {(done.stderr or done.stdout)[-1500:]}")
    out.mkdir(parents=True, exist_ok=True)
    for t in TOOLS:
        shutil.copy2(build_dir / "bin" / t, out / t)
    print(f"llama.cpp: built {', '.join(TOOLS)} into {out}", file=log, flush=True)
    return out / "llama-server"


# GGUFs ------------------------------------------------------------------------------------------------------------


def ensure_gguf(kind: str) -> Path:
    """The embedded model as a GGUF of ``kind`` (``"q4_1"``: the shipped file; one of ``GGUF_KINDS``:
    made from it once with ``llama-quantize --allow-requantize`` into ``home()/models``).

    Raises ``OSError`` when ``llama-quantize`` is missing or fails, ``ValueError`` for another kind.
    """
    from mechserve.model.checkpoint import embedded_gguf

    shipped = embedded_gguf()
    if kind == "q4_1":
        return shipped
    if kind not in GGUF_KINDS:
        raise ValueError(f"no GGUF kind {kind!r}; choose from q4_1, {', '.join(GGUF_KINDS)}")
    target = home() / "models" / f"smollm2-135m-instruct-{kind}.gguf"
    if target.is_file() and target.stat().st_size > 0:
        return target
    quantize = find_tool("llama-quantize")
    if quantize is None:
        raise OSError(f"llama-quantize not found beside llama-server (needed to make the {kind.upper()} GGUF)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        cmd = [str(quantize), "--allow-requantize", str(shipped), tmp, kind.upper(), "2"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise OSError(f"llama-quantize to {kind} failed: {(done.stderr or done.stdout)[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def unsupported_model(model: str) -> str | None:
    """Why llama.cpp cannot run the bench's ``model`` here (a Hugging Face directory other than the embedded
    model: there is no GGUF of it), or None for ``smollm2`` and a GGUF file."""
    from mechserve.model.gguf_file import is_gguf  # imports torch: only when a benchmark asks

    if model == "smollm2" or is_gguf(model):
        return None
    return f"llama.cpp runs the embedded model's GGUFs (--model smollm2) or a GGUF file, not {model}"


def gguf_for(model: str, mode: str) -> Path:
    """The GGUF llama.cpp runs for the bench's ``model`` in the bench's ``mode`` (``MODE_GGUF``): the embedded
    model's file of that kind (``ensure_gguf``), or a GGUF ``model`` itself in every mode (mechserve's mode
    chooses only its own activations).

    Raises ``OSError`` when the file cannot be made and ``ValueError`` for a model llama.cpp cannot run here
    (``unsupported_model``).
    """
    refusal = unsupported_model(model)
    if refusal is not None:
        raise ValueError(refusal)
    return ensure_gguf(MODE_GGUF[mode]) if model == "smollm2" else Path(model)


# Requests and replies ---------------------------------------------------------------------------------------------


def completion_body(
    prompt_ids: Sequence[int], max_tokens: int, *, stream: bool = True, cache_prompt: bool = False
) -> dict[str, Any]:
    """The ``/completion`` request for one benchmark request: exactly ``max_tokens`` greedy ids after the
    token-id prompt, prompt caching off (every prompt is computed, as in the other engines) unless
    ``cache_prompt`` (the server's default: a slot reuses the KV of the longest prefix it holds, as the
    spec-decode bench's multi-turn sessions do on our side with the prefix cache)."""
    return {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": cache_prompt,
        "stream": stream,
        "return_tokens": True,
    }


def parse_event(line: str | bytes) -> dict[str, Any] | None:
    """One line of the server's event stream as its JSON object; None for blank lines and ``:`` pings.

    Raises ``ValueError`` for a data line that is not JSON, or any other line.
    """
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    if not text or text.startswith(":"):
        return None
    if not text.startswith("data:"):
        raise ValueError(f"unexpected line in llama-server's event stream: {text[:80]!r}")
    body = text[len("data:") :].strip()
    parsed: dict[str, Any] = json.loads(body)
    return parsed


@dataclass(slots=True)
class Completion:
    """One streamed completion: ``token_times[i]`` (perf_counter seconds) is when id ``tokens[i]`` arrived;
    ``timings`` is the server's own (``prompt_ms``, ``predicted_ms``, ...) from the last event."""

    tokens: list[int]
    token_times: list[float]
    timings: dict[str, Any]


def read_completion(lines: Iterable[bytes | str], clock: Any = time.perf_counter) -> Completion:
    """Collect a streamed ``/completion`` reply.  Raises ``ValueError`` for an error event or a stream
    that ends without its ``stop`` event."""
    tokens: list[int] = []
    times: list[float] = []
    for line in lines:
        event = parse_event(line)
        if event is None:
            continue
        if "error" in event:
            raise ValueError(f"llama-server error: {event['error']}")
        ids = [int(t) for t in event.get("tokens") or ()]
        now = clock()
        tokens += ids
        times += [now] * len(ids)
        if event.get("stop"):
            return Completion(tokens, times, dict(event.get("timings") or {}))
    raise ValueError("llama-server's event stream ended before its stop event")


# The server -------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process on a local port: ``slots`` parallel sequences of ``context`` positions each,
    started, healthy and warmed up (one two-token request) when the constructor returns; ``close`` stops it.

    Raises ``OSError`` when it exits, does not become healthy within ``timeout`` seconds or fails its warm-up
    request (the process is stopped first).
    """

    def __init__(self, gguf: Path, *, threads: int, slots: int = SLOTS, context: int = 1024, timeout: float = 300):
        server = find_tool()
        if server is None:
            raise OSError(missing_message() or "llama-server not found")
        self.gguf, self.slots, self.context, self.threads = gguf, slots, context, threads
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(server), "-m", str(gguf), "-np", str(slots), "-c", str(slots * context)]
        self.command += ["-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server; closed by close()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait(timeout)
            self.complete([1, 2, 3, 4], 2)  # warm-up: first-request allocations are not any run's
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise OSError(f"llama-server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.25)
        raise OSError(f"llama-server did not become healthy within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def version(self) -> str:
        done = subprocess.run([self.command[0], "--version"], capture_output=True, text=True, check=False)
        return " ".join((done.stdout + done.stderr).split())[:200]

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, *, cache_prompt: bool = False) -> Completion:
        """One streamed completion (``completion_body``)."""
        body = json.dumps(completion_body(prompt_ids, max_tokens, cache_prompt=cache_prompt)).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as reply:
            return read_completion(_lines(reply))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _lines(reply: Any) -> Iterator[bytes]:
    while True:
        line = reply.readline()
        if not line:
            return
        yield line


def proc_peak_rss(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``) of process ``pid`` in bytes; None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_proc_peak_rss(pid: int) -> None:
    """Reset process ``pid``'s peak RSS (Linux ``clear_refs`` 5) where allowed."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def run_requests(
    server: LlamaServer, requests: Sequence[tuple[Sequence[int], int]], *, sequential: bool, cache_prompt: bool = False
) -> tuple[list[float], list[Completion], float]:
    """Send every request (all at once, one thread each, or one after another); the arrival time of each,
    its completion, and the wall time from the first arrival to the last token.  ``cache_prompt``: see
    ``completion_body``."""
    arrivals = [0.0] * len(requests)
    results: list[Completion | BaseException | None] = [None] * len(requests)

    def one(i: int) -> None:
        arrivals[i] = time.perf_counter()
        try:
            results[i] = server.complete(*requests[i], cache_prompt=cache_prompt)
        except BaseException as exc:  # reported below, on the caller's thread
            results[i] = exc

    start = time.perf_counter()
    if sequential:
        for i in range(len(requests)):
            one(i)
    else:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    done: list[Completion] = []
    for r in results:
        if not isinstance(r, Completion):
            raise OSError(f"a llama-server request failed: {r}")
        done.append(r)
    end = max((c.token_times[-1] for c in done if c.token_times), default=time.perf_counter())
    return arrivals, done, end - start


def machine_summary() -> str:
    return f"{platform.machine()} {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    """``python -m mechserve.bench.llama_cpp build [--jobs N]`` (``make llama-cpp``), or ``where``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mechserve.bench.llama_cpp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help=f"build {', '.join(TOOLS)} from llama-cpp-python {SDIST_VERSION} into the cache")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--ggufs", action="store_true", help=f"also make the {', '.join(GGUF_KINDS)} GGUFs")
    sub.add_parser("where", help="print the llama-server that would be used, or why there is none")
    g = sub.add_parser("gguf", help="print the path of one of the embedded model's GGUFs, making it first")
    g.add_argument("kind", choices=("q4_1", *GGUF_KINDS))
    args = parser.parse_args(argv)
    try:
        if args.command == "gguf":
            print(ensure_gguf(args.kind))
            return 0
        if args.command == "where":
            found = find_tool()
            try:
                print(found if found else missing_message())
            except OSError as exc:
                print(exc)
            return 0 if found else 1
        print(build(args.jobs))
        if args.ggufs:
            for kind in GGUF_KINDS:
                print(ensure_gguf(kind))
    except OSError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

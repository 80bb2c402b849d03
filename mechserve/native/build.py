"""Building and loading mechserve's C++ kernels: compiled once per machine into the cache, opened with ctypes.

A ``Kernel`` names one source file (``kv/csrc/paged_attention.cpp``, ``model/csrc/linear.cpp``), the
function that returns its ABI version and the C++ standard it is written in; the headers it includes
are the ``*.h`` files under its folder.  ``Kernel.build()``
compiles it with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) into
``$MECHSERVE_CACHE/kernels`` (see ``mechserve.api.env``), named by a hash of the source and its headers,
the compiler, the flags and the CPU, so a build happens once per machine and a changed source or
another CPU gets its own file; concurrent builders each write a temporary file and rename it into
place.  ``Kernel.load()`` opens it (rebuilding a truncated or foreign file once) and checks the ABI.
The kernels run on the OpenMP runtime torch already loaded (``libgomp.so.1`` is resolved by
soname), so they share no threads with a second runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mechserve.api.env import cache_dir
from mechserve.api.errors import NativeKernelError

FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")


def compiler() -> list[str]:
    """``$CXX`` split like a shell word list (e.g. ``ccache g++``), else the first of c++/g++/clang++ found.

    Raises ``NativeKernelError`` when there is none or ``$CXX`` names no program.
    """
    given = os.environ.get("CXX", "").strip()
    if given:
        try:
            words = shlex.split(given)
        except ValueError as exc:
            raise NativeKernelError(f"CXX={given!r} is not a command line: {exc}") from None
        if not words or not shutil.which(words[0]):
            raise NativeKernelError(f"CXX={given!r} does not name an executable on PATH")
        return words
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    raise NativeKernelError("no C++ compiler found (set CXX, or install g++)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@dataclass(frozen=True)
class Kernel:
    """One C++ source built into a shared library: ``abi_function`` returns ``abi`` (an int); ``std`` is
    its C++ standard and ``extra`` its own compiler flags beside ``FLAGS``.

    ``arch`` is the ``-march`` the code is compiled for: ``native`` (the default) takes the instruction
    sets of the CPU that builds it (AVX-512, its BF16 and VNNI extensions, AVX2 + FMA ...), which the
    sources test with ``__AVX512F__``-style macros to pick their paths at build time; a baseline such
    as ``x86-64`` or ``x86-64-v3`` builds their portable or AVX2 paths (what tests compare on one machine).
    """

    source: Path
    abi_function: str
    abi: int
    std: str = "c++17"
    extra: tuple[str, ...] = ()
    arch: str = "native"
    _loaded: dict[str, ctypes.CDLL] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def flags(self) -> tuple[str, ...]:
        return (*FLAGS, f"-march={self.arch}", f"-std={self.std}", *self.extra)

    def headers(self) -> list[Path]:
        """The headers the source may include: every ``*.h`` under its folder, in a fixed order."""
        return sorted(self.source.parent.rglob("*.h"))

    def library_path(self, cxx: list[str]) -> Path:
        """Where this machine's build of the current source lives (a hash of everything that shapes it)."""
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=False).stdout
        key = hashlib.sha256(
            "\0".join(
                [
                    self.source.read_text(),
                    *(f"{h.relative_to(self.source.parent)}\n{h.read_text()}" for h in self.headers()),
                    " ".join(cxx),
                    version,
                    " ".join(self.flags),
                    _cpu_flags(),
                    platform.machine(),
                ]
            ).encode()
        ).hexdigest()[:16]
        return cache_dir() / "kernels" / f"{self.source.stem}-{key}.so"

    def build(self) -> Path:
        """Compile the source if this machine has no build of it; return the library's path.

        Raises ``NativeKernelError`` with the compiler's message if it cannot be built.
        """
        cxx = compiler()
        target = self.library_path(cxx)
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [*cxx, *self.flags, str(self.source), "-o", tmp],
                capture_output=True,
                text=True,
                check=False,
                timeout=300,
            )
            if done.returncode != 0:
                said = (done.stderr or done.stdout).strip()[-2000:] or "no message"
                raise NativeKernelError(
                    f"{' '.join(cxx)} failed to build {self.source.name} (exit {done.returncode}): {said}"
                )
            os.chmod(tmp, 0o755)  # mkstemp makes it private; a shared cache must be loadable by others
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def _open(self, path: Path) -> ctypes.CDLL | None:
        """The library at ``path`` if it loads and has this ABI, else None."""
        try:
            lib = ctypes.CDLL(str(path))
            if getattr(lib, self.abi_function)() == self.abi:
                return lib
        except (OSError, AttributeError):
            pass
        return None

    def load(self) -> ctypes.CDLL:
        """The built library, opened once per process (built first if needed).

        A truncated or foreign file under its name (an interrupted copy, a stale cache) is rebuilt
        once; raises ``NativeKernelError`` if it still does not load or cannot be built.
        """
        if "lib" in self._loaded:
            return self._loaded["lib"]
        path = self.build()
        lib = self._open(path)
        if lib is None:
            path.unlink(missing_ok=True)
            path = self.build()
            lib = self._open(path)
        if lib is None:
            raise NativeKernelError(f"{path} does not load as {self.source.name} even after a rebuild")
        self._loaded["lib"] = lib
        return lib

    def forget(self) -> None:
        """Drop the opened library, so the next ``load`` builds and opens it again (tests, a new cache)."""
        self._loaded.clear()


__all__ = ["FLAGS", "Kernel", "NativeKernelError", "compiler"]


def usable(
    mode: str, load: Callable[[], object], what: str, fallback: str = "torch's path", variable: str = ""
) -> bool:
    """Whether a kernel is used under its mode setting (``variable``: ``MECHSERVE_ATTENTION``,
    ``MECHSERVE_LINEAR``, ``MECHSERVE_SUFFIX_TREE``): ``torch`` (or ``python``) never; ``native`` always,
    raising ``NativeKernelError`` naming ``what`` and the setting if ``load()`` cannot build or open it;
    ``auto`` when it loads, else the ``fallback`` path with one line on stderr naming ``what`` and saying why."""
    if mode in ("torch", "python"):
        return False
    try:
        load()
    except (NativeKernelError, OSError, subprocess.SubprocessError) as exc:
        if mode == "native":
            setting = f" ({variable}=native)" if variable else ""
            raise NativeKernelError(f"{what} unavailable{setting}: {exc}") from exc
        print(f"mechserve: {what} unavailable, using {fallback}: {exc}", file=sys.stderr)
        return False
    return True

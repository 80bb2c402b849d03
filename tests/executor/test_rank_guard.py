"""``LLM(world_size=2)`` in a script without a main guard (issue 31): one clear error, not three interleaved
spawn tracebacks ending in a ``RankError`` about a rank that exited."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tiny_models import save_tiny, save_word_tokenizer, tiny_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
from mechserve import LLM, SamplingParams

llm = LLM({model!r}, world_size=2, num_pages=16, page_size=4)
print(llm.generate(["w1 w2"], SamplingParams(max_tokens=1))[0].outputs[0].text)
"""


def test_a_script_without_a_main_guard_gets_one_error_saying_to_add_it(tmp_path: Path) -> None:
    save_tiny(tmp_path / "model", tiny_config())
    save_word_tokenizer(tmp_path / "model")
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT.format(model=str(tmp_path / "model")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1, done.stderr  # the script's own uncaught error, nothing from the ranks
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mechserve.api.errors.RankError: the rank processes could not start")
    assert 'has no `if __name__ == "__main__":` guard' in last and "docs/parallelism.md" in last
    guarded = tmp_path / "guarded.py"
    body = SCRIPT.format(model=str(tmp_path / "model")).strip().splitlines()
    guarded.write_text(
        body[0] + "\n\nif __name__ == '__main__':\n" + "\n".join("    " + line for line in body[1:] if line)
    )
    done = subprocess.run([sys.executable, str(guarded)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr

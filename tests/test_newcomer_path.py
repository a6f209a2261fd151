"""The README's "Check your engine in three steps" works as written: its code blocks, run in an empty folder
with a tiny model saved as model.gguf, write a dump, diff it and run the pytest plugin, each to a PASS."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from llorch_ref.testing.tiny import write_tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Check your engine in three steps"
BLOCK = re.compile(r"^```(?P<lang>[a-z]+)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def section(text: str) -> str:
    """The README's three-step section: from its heading to the next second-level heading."""
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a text, in order: (language, body)."""
    return [(m["lang"], m["body"]) for m in BLOCK.finditer(text)]


def run_steps(folder: Path, steps: list[tuple[str, str]]) -> list[subprocess.CompletedProcess]:
    """Each python block is written to the file its first line names (`# my_engine.py`); each bash block runs
    in the folder, with this interpreter's scripts first on PATH (python, llorch-ref)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    done = []
    for lang, body in steps:
        if lang == "python":
            name = body.splitlines()[0].removeprefix("#").strip()
            (folder / name).write_text(body)
        elif lang == "bash":
            done.append(subprocess.run(["bash", "-e", "-c", body], cwd=folder, env=env, capture_output=True,
                                       text=True, timeout=300))
    return done


def test_the_three_steps_pass_as_written(tmp_path):
    steps = blocks(section(README.read_text()))
    assert [lang for lang, _ in steps] == ["python", "bash", "bash", "bash"]
    write_tiny_model(tmp_path / "model.gguf")
    write, diff, ci = run_steps(tmp_path, steps)
    for p in (write, diff, ci):
        assert p.returncode == 0, f"{p.args[-1]}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert (tmp_path / "dump.safetensors").is_file()
    assert "verdict: PASS" in diff.stdout + diff.stderr
    assert "verdict: PASS" in ci.stdout and (tmp_path / "llorch.xml").is_file()


def test_the_readme_keeps_its_first_two_commands():
    first = blocks(README.read_text())[0][1]
    assert "pip install --find-links ../shared/wheels -e '.[test,hf]' && llorch-ref prove" in first
    assert ". .venv/bin/activate && python -m pytest -q" in first

"""Every test file runs: the README's test command (``make test``) collects each ``tests/**/test_*.py``.

pytest leaves out folders it does not recurse into (``build``, ``dist``, dot-folders, ``venv``: its default
``norecursedirs``) and files that do not match ``python_files``, silently; a test folder named so never runs.
"""

import re
from pathlib import Path

import pytest

from collected_files import COLLECTED

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _make_test_commands() -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "the Makefile has no test target"
    return [line.strip() for line in recipe.group(1).splitlines() if "pytest" in line]


def test_the_readme_s_test_command_runs_pytest_over_every_test_folder():
    assert "make test" in (ROOT / "README.md").read_text()
    commands = _make_test_commands()
    # The parallel run takes tests/ whole (its marker only defers the serial tests), the serial run their folder.
    assert any(command.split()[-1] == "tests" and '-m "not serial"' in command for command in commands), commands
    assert any(command.split()[-1] == "tests/integration" and "-m serial" in command for command in commands), commands


def test_every_test_file_is_collected(request):
    if [Path(a).resolve() for a in request.config.args] != [TESTS]:
        pytest.skip("run over tests/ whole (make test) to check what it collects")
    collected = request.config.stash[COLLECTED]
    missing = sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py") if p.resolve() not in collected)
    assert missing == []
    assert TESTS / "unit" / "assembly" / "test_compile_queue.py" in collected
    assert TESTS / "unit" / "assembly" / "test_staged_build.py" in collected

"""The README's example quick starts build from what their Makefile targets install, and nothing more.

`make llm-example` installs the project with its ``examples`` extra and `make embed-example` the
project alone, then run the example's script. The test venv holds far more (every test
extra), so a dependency the example's extra lacks would pass unnoticed here and fail on a
fresh machine ("accelerate is required when loading a GGUF file"). Each case therefore
makes a venv whose site-packages hold only the distributions that target's install would
bring: the requirement closure of ``neuron-serve[extras]`` as pyproject.toml declares it
(markers evaluated), plus what ``python -m venv`` puts in every venv, each linked file by
file from this venv's install. The example's script then runs in it as the Makefile runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
# What `python -m venv` installs in every venv (the Makefile's venvs are made so).
VENV_OWN = ("pip", "setuptools")


def project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """neuron-serve's requirements with ``extras``, as pyproject.toml declares them now."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


def closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution ``requirements`` bring, recursively, as this venv has them installed (markers evaluated for
    this interpreter and each requested extra)."""
    found: set[str] = set()
    pending = [(r, ()) for r in requirements]
    while pending:
        requirement, _ = pending.pop()
        name = canonicalize_name(requirement.name)
        if name == "neuron-serve":  # the project's own extras: already expanded from pyproject.toml
            pending += [(r, ()) for r in project_requirements(tuple(requirement.extras))]
            continue
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{requirement} is required but not installed in this venv; install the test extra")
        found.add(name)
        for text in dist.requires or []:
            nested = Requirement(text)
            wanted = requirement.extras or {""}
            if nested.marker is None or any(nested.marker.evaluate({**default_environment(), "extra": e})
                                            for e in wanted):
                pending.append((nested, ()))
    return found


def link_venv(where: Path, distributions: set[str]) -> Path:
    """A venv at ``where`` whose site-packages hold ``distributions`` (linked from this venv) and the checkout."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in sorted(distributions):
        dist = metadata.distribution(name)
        for file in dist.files or []:
            source = Path(dist.locate_file(file)).resolve() if not Path(file).is_absolute() else Path(file)
            try:
                relative = Path(dist.locate_file(file)).relative_to(ours)
            except ValueError:
                continue  # a script in bin/, a header: not importable
            if relative.parts[0].startswith("__editable__") or relative.parts[0] == "..":
                continue
            target = site / relative
            if target.exists() or not source.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)
    (site / "neuron_serve_checkout.pth").write_text(f"{ROOT}\n")  # the editable install's own mechanism
    return python


def installed_extras(stamp: str) -> tuple[str, ...]:
    """The extras the Makefile's rule for ``stamp`` (``$(EXAMPLES_STAMP)``) installs: ``pip install -e '.[a,b]'``;
    none for ``-e .``."""
    rule = re.search(rf"^{re.escape(stamp)}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert rule, f"no rule for {stamp} in the Makefile"
    installs = re.findall(r"pip install -e '?\.(?:\[([\w,-]+)\])?'?", rule.group(1))
    assert installs, f"{stamp}'s rule installs no project: {rule.group(1)}"
    return tuple(e for group in installs for e in group.split(",") if e)


# (the example's model file, the stamp its rule orders on, the script's command)
EXAMPLES = {
    "llm": ("deployments/llm/config.json", ["deployments/example_models/make_llm.py", "{out}/llm"]),
    "embedder": ("deployments/embedder/modules.json", ["deployments/example_models/make_embedders.py", "{out}"]),
}


def stamp_of(model_file: str) -> str:
    """The install stamp the Makefile's rule for ``model_file`` waits for (``| $(EXAMPLES_STAMP)``)."""
    rule = re.search(rf"^{re.escape(model_file)}:.*\|\s*(\$\(\w+\))", MAKEFILE, re.M)
    assert rule, f"the Makefile's rule for {model_file} names no install stamp"
    return rule.group(1)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_builds_from_what_its_make_target_installs(example, tmp_path):
    model_file, command = EXAMPLES[example]
    extras = installed_extras(stamp_of(model_file))
    distributions = closure(project_requirements(extras)) | {canonicalize_name(n) for n in VENV_OWN}
    assert "torch" in distributions and "pytest" not in distributions  # the closure is the example's, not the tests'
    python = link_venv(tmp_path / "venv", distributions)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run([str(python), *[c.format(out=out) for c in command]], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, (f"make {example}-example's script fails with only neuron-serve"
                                 f"{'[' + ','.join(extras) + ']' if extras else ''} installed:\n{run.stderr[-3000:]}")
    assert (out / Path(model_file).relative_to("deployments")).exists()


def test_a_missing_dependency_is_caught(tmp_path):
    """The check can fail: with the examples extra less accelerate, the LLM example's script fails as a fresh
    machine's did."""
    model_file, command = EXAMPLES["llm"]
    distributions = closure(project_requirements(installed_extras(stamp_of(model_file)))) - {"accelerate"}
    python = link_venv(tmp_path / "venv", distributions | {canonicalize_name(n) for n in VENV_OWN})
    run = subprocess.run([str(python), *[c.format(out=tmp_path) for c in command]], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode != 0
    assert "accelerate is required when loading a GGUF file" in run.stderr

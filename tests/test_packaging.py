"""The library as a user installs it: wheels built from this checkout, the library's installed (not editable) into a
fresh virtual environment, then imported and run there.

Editable installs cannot show a package that the wheel leaves out, nor data that it wrongly carries, so this test
builds the wheels from a copy of the checkout's files (a stale `build/` folder cannot leak into them) and looks at
what users would get. The fresh environment borrows the already installed dependencies (torch, transformers, ...)
through a path entry instead of downloading them again; that entry does not run the `.pth` hooks of this
environment's editable installs, so `adaflash_hf` and `adaflash_demo` are importable there only from the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml
from synthetic import prompts

REPO = Path(__file__).resolve().parents[1]
# What a data set or weights file looks like; none of them belongs in the library wheel.
DATA_SUFFIXES = (".safetensors", ".bin", ".pt", ".jsonl", ".parquet", ".arrow", ".png")


def _checkout_copy(destination: Path) -> Path:
    """The files git tracks or would track (not ignored), as a fresh clone with the working tree's edits has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _build_wheel(source: Path, out: Path) -> Path:
    # --no-build-isolation: setuptools and wheel come from this environment (the dev extra), no download
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    checkout = _checkout_copy(tmp_path_factory.mktemp("checkout"))
    library = _build_wheel(checkout, tmp_path_factory.mktemp("dist"))
    demo = _build_wheel(checkout / "demo", tmp_path_factory.mktemp("dist-demo"))
    return library, demo


def _fresh_env(root: Path, *wheels: Path) -> Path:
    """A new virtual environment with ``wheels`` installed (not editable) and the dependencies borrowed."""
    venv.create(root, with_pip=False)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "borrowed_dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", *map(str, wheels)],
        check=True,
    )
    return root


@pytest.fixture(scope="module")
def fresh_env(wheels, tmp_path_factory):
    """The library wheel alone."""
    return _fresh_env(tmp_path_factory.mktemp("venv"), wheels[0])


@pytest.fixture(scope="module")
def demo_env(wheels, tmp_path_factory):
    """The library wheel and the demo wheel."""
    return _fresh_env(tmp_path_factory.mktemp("venv-demo"), *wheels)


def _run(env_root: Path, *command: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": ""}
    environment["PATH"] = f"{env_root / 'bin'}{os.pathsep}{environment['PATH']}"
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def _source_packages(root: Path, name: str) -> set[str]:
    return {".".join(path.parent.relative_to(root).parts) for path in (root / name).rglob("__init__.py")}


def test_library_wheel_holds_every_subpackage_and_no_data(wheels):
    names = zipfile.ZipFile(wheels[0]).namelist()
    packages = {".".join(Path(n).parent.parts) for n in names if n.endswith("/__init__.py")}
    assert packages == _source_packages(REPO, "adaflash_hf")  # found automatically, none left out
    assert {"adaflash_hf/templates/drafter.md", "adaflash_hf/templates/length_head.md"} <= set(names)
    assert not [n for n in names if n.endswith(DATA_SUFFIXES) or "/data/" in n]
    assert not [n for n in names if n.startswith(("adaflash_demo", "tests", "trainers", "bench", "examples"))]


def test_demo_wheel_carries_the_demo_artifacts_and_no_results(wheels):
    names = set(zipfile.ZipFile(wheels[1]).namelist())
    packages = {".".join(Path(n).parent.parts) for n in names if n.endswith("/__init__.py")}
    assert packages == _source_packages(REPO / "demo", "adaflash_demo")
    from adaflash_demo.demo import SHIPPED_DRAFTERS

    for drafter in SHIPPED_DRAFTERS:
        shipped = REPO / "demo" / "adaflash_demo" / "data" / drafter
        expected = {path.relative_to(REPO / "demo").as_posix() for path in shipped.rglob("*") if path.is_file()}
        assert expected and expected <= names, drafter
    # the benchmark's run scripts and recorded results live beside its harness in the repository, not in the wheel
    assert not [n for n in names if "/results/" in n or n.endswith(".sh")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "adaflash-demo = adaflash_demo.cli:main" in zipfile.ZipFile(wheels[1]).read(entry_points).decode()


def test_installed_library_imports_and_runs_its_commands(fresh_env, tmp_path, target, tokenizer):
    python = str(fresh_env / "bin" / "python")
    check = (
        "import importlib, importlib.util, pkgutil, sys, adaflash_hf\n"
        "assert 'trl' not in sys.modules, 'inference should not import TRL'\n"
        "modules = [m.name for m in pkgutil.walk_packages(adaflash_hf.__path__, 'adaflash_hf.')]\n"
        "for name in modules: importlib.import_module(name)\n"
        "from adaflash_hf import AdaFlashDrafter, OPDConfig, OPDTrainer, OnlineGenerator\n"
        "print(adaflash_hf.__file__)\n"
        "print(importlib.util.find_spec('adaflash_demo'))\n"
    )
    location, demo = _run(fresh_env, python, "-c", check, cwd=tmp_path).stdout.split()
    assert location.startswith(str(fresh_env)) and demo == "None"  # the wheel's copy, and no demo beside it

    assert "{train,online}" in _run(fresh_env, "adaflash", "--help", cwd=tmp_path).stdout
    assert "--teacher_model_name_or_path" in _run(fresh_env, "adaflash", "train", "--help", cwd=tmp_path).stdout
    assert "--swap-dir" in _run(fresh_env, "adaflash", "online", "--help", cwd=tmp_path).stdout
    demo = _run(fresh_env, "adaflash", "demo", cwd=tmp_path, check=False)  # the demo's verbs are the demo's
    assert demo.returncode == 2 and "invalid choice: 'demo'" in demo.stderr

    # a short verb end to end: one training step of a fresh drafter on the synthetic target
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(4)))
    recipe = {
        "teacher_model_name_or_path": str(tmp_path / "target"),
        "new_drafter": {"num_hidden_layers": 1, "block_size": 4, "mask_token_id": tokenizer.mask_token_id},
        "datasets": [{"path": "json", "data_files": str(tmp_path / "prompts.jsonl")}],
        "use_cpu": True,
        "report_to": [],
        "max_completion_length": 8,
        "num_anchors": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "save_strategy": "no",
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    _run(fresh_env, "adaflash", "train", "--config", "recipe.yaml", "max_steps=1", f"output_dir={run}", cwd=tmp_path)
    assert (run / "model.safetensors").exists() and (run / "README.md").exists()


def test_installed_demo_runs_its_own_command(demo_env, tmp_path, synthetic_checkpoints):
    """`adaflash-demo`, the demo wheel's console script, beside the library wheel: its verbs, and `demo` end to end
    on a user's prompt file (every prompt of it) and --target/--drafter."""
    help_text = _run(demo_env, "adaflash-demo", "--help", cwd=tmp_path).stdout
    assert "{demo,bench,recipe,online}" in help_text
    assert "--work_dir" in _run(demo_env, "adaflash-demo", "recipe", "--help", cwd=tmp_path).stdout
    target, drafter = synthetic_checkpoints
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(5)))
    args = ["demo", "--target", target, "--drafter", drafter, "--prompts", "prompts.jsonl", "--max-new-tokens", "8"]
    result = _run(demo_env, "adaflash-demo", *args, cwd=tmp_path)
    assert "prompts: 5 from prompts.jsonl (custom 5)" in result.stderr
    assert "outputs identical to plain generate(): 5/5" in result.stdout
    location = _run(
        demo_env,
        str(demo_env / "bin" / "python"),
        "-c",
        "import adaflash_demo; print(adaflash_demo.__file__)",
        cwd=tmp_path,
    )
    assert location.stdout.startswith(str(demo_env))

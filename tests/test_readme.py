"""The README and every page of docs/ hold to the code: their Python blocks run and print what their comments
say, their YAML parses, the configs and scripts their commands name exist, fresh fits never share a run
folder, and their links resolve (parsing: tests/docs_blocks.py)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re

import pytest
import torch
import yaml

from tests.docs_blocks import (
    PAGES,
    REPO,
    all_blocks,
    anchors,
    blocks,
    commands,
    fit_commands,
    links,
    make_targets,
    module_commands,
    shell,
)

PYTHON = all_blocks("python")
YAML = all_blocks("yaml")
BASH = all_blocks("bash")
TEXT = "\n".join(page.read_text() for page in PAGES)
SHELL = "\n".join(shell(page) for page in PAGES)  # every command a page shows, in blocks or inline
#: pages not (yet) held to "first lines say what the page covers and link back to the README", with why
def test_the_docs_have_snippets_and_every_skipped_one_says_why():
    assert len(PYTHON) >= 8 and len(YAML) >= 3 and len(BASH) >= 8
    skipped = [b for b in PYTHON if b.no_test is not None]
    assert all(b.no_test for b in skipped), [b.name for b in skipped if not b.no_test]
    assert len(skipped) <= len(PYTHON) // 4, f"{len(skipped)} of {len(PYTHON)} Python blocks are not run"


def expected_outputs(code: str) -> dict[int, str]:
    """Line -> comment of each top-level ``print(...)  # output`` line: the output must start the comment."""
    return {
        node.lineno: code.split("\n")[node.lineno - 1].split("  # ", 1)[1].strip()
        for node in ast.parse(code).body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "print" and "  # " in code.split("\n")[node.lineno - 1]
    }  # fmt: skip


def numeric_comments(code: str) -> dict[str, list[str]]:
    """Expression -> numbers of each top-level ``expression  # 1.5 2.25`` line whose comment is only numbers."""
    out = {}
    for node in ast.parse(code).body:
        line = code.split("\n")[node.lineno - 1]
        comment = line.split("  # ", 1)[1].strip() if "  # " in line else ""
        if isinstance(node, ast.Expr) and re.fullmatch(r"-?\d+(\.\d+)?( +-?\d+(\.\d+)?)*", comment):
            out[ast.get_source_segment(code, node)] = comment.split()
    return out


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs_and_prints_what_it_says(block, monkeypatch):
    if block.no_test is not None:
        pytest.skip(f"marked no-test: {block.no_test}")
    monkeypatch.chdir(REPO)
    printed: dict[int, str] = {}

    def record(*args, **kwargs):  # the block's print: what each line printed
        import sys

        printed[sys._getframe(1).f_lineno] = " ".join(str(a) for a in args)

    namespace: dict = {"print": record}
    exec(compile(block.code, block.name, "exec"), namespace)
    for line, comment in expected_outputs(block.code).items():
        assert line in printed and comment.startswith(printed[line]), (block.name, line, printed.get(line), comment)
    for expression, want in numeric_comments(block.code).items():  # the digits the comment shows, rounded
        got = torch.as_tensor(eval(expression, namespace), dtype=torch.float64).flatten().tolist()
        assert len(got) == len(want), (expression, got, want)
        for value, text in zip(got, want):
            decimals = len(text.split(".")[1]) if "." in text else 0
            assert abs(value - float(text)) <= 0.5 * 10**-decimals + 1e-12, (expression, value, text)
    if "HalfRLOO" in namespace:  # "exact c_G(p) = 4.0, for free"
        assert namespace["HalfRLOO"]().population_weight(0.3, group_size=8).item() == pytest.approx(4.0)


def test_the_output_checks_can_fail():
    code = 'print("a")  # a: why\nprint(1)\nx = 2\nx  # 2.0 3\n'
    assert expected_outputs(code) == {1: "a: why"} and numeric_comments(code) == {"x": ["2.0", "3"]}


@pytest.mark.parametrize("block", YAML, ids=[b.name for b in YAML])
def test_yaml_block_parses(block):
    assert isinstance(yaml.safe_load(block.code), dict), f"{block.name}: not a mapping"


def test_commands_name_configs_and_scripts_that_exist():
    text = commands(TEXT)
    configs = set(re.findall(r"--config[= ](configs/\S+?\.yaml)\b", text))
    scripts = set(re.findall(r"(?:python3?|bash) (benchmarks/[\w/]+\.(?:py|sh))\b", text))
    assert len(configs) >= 5 and len(scripts) >= 10
    assert not [c for c in configs if not (REPO / c).is_file()], "configs the docs name that do not exist"
    assert not [s for s in scripts if not (REPO / s).is_file()], "scripts the docs name that do not exist"


def test_bash_blocks_run_python_from_the_venv():
    """On a fresh clone only the venv has the dependencies: no command of a bash block starts a bare python."""
    bare = [(b.name, line) for b in BASH for line in commands(b.code).split("\n")
            if re.search(r"(?:^|[\s;&|(])python3? ", line.split("#", 1)[0])]  # fmt: skip
    assert not bare, bare


def test_fit_commands_never_share_a_run_folder():
    """Each fresh run the docs show trains into a folder of its own (a resume reuses its run's folder)."""
    folders = {}
    for command in fit_commands(TEXT):
        if "--ckpt_path" in command or "--print_config" in command:
            continue
        root = re.search(r"--trainer\.default_root_dir[= ](\S+)", command)
        configs = [yaml.safe_load((REPO / path).read_text()) for path in re.findall(r"--config (\S+)", command)]
        named = [c["trainer"]["default_root_dir"] for c in configs if "default_root_dir" in c.get("trainer", {})]
        folders[command] = root.group(1) if root else named[-1]  # the last config that names one wins

    assert len(folders) >= 8 and len(set(folders.values())) == len(folders), folders


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


def test_the_readme_maps_every_page_and_every_page_links_back():
    readme = PAGES[0]
    mapped = {target.partition("#")[0] for target in links(readme)}
    assert not [p.name for p in PAGES[1:] if f"docs/{p.name}" not in mapped], "pages the README does not link"
    for page in PAGES[1:]:
        opening = page.read_text().split("\n\n")[1]  # the paragraph under the title
        assert "](../README.md)" in opening, f"{page.name} does not say what it covers and link back first"


def test_block_parsing():
    from tests.docs_blocks import Block

    page = REPO / "docs" / "estimators.md"
    found = blocks(page)
    assert all(isinstance(b, Block) and b.page == page for b in found)
    assert [b.lang for b in found] == ["python", "bash", "python"] and "class HalfRLOO" in found[2].code
    assert "estimators" in anchors(page) and "add-an-estimator" in anchors(page)


#: the argparse entry points the docs run: ``main(argv)`` parses its flags first
ARGPARSE_MAINS = ("sgrpo.export", "sgrpo.warmstart", "sgrpo.prepare_data", "benchmarks.figures")


class Parsed(Exception):
    """Raised once a command's flags parsed: nothing of the command runs."""


#: top-level packages of optional extras: their modules are checked where they are installed
OPTIONAL = ("vllm",)


@pytest.mark.slow  # about 10 s: 40 commands parsed
def test_every_python_m_command_names_a_module_whose_flags_parse(monkeypatch, capsys):
    """Issue 38: every command of the README and the docs runs as written on a fresh clone. Each ``python -m``
    command names a module that exists, and its flags parse, with nothing run: ``sgrpo.fit``'s (its mode, configs
    and every ``--key=value``: keys, types, class paths) by the CLI's own parser, and those of the argparse entry
    points (``sgrpo.export``, ``sgrpo.warmstart``, ``sgrpo.prepare_data``, ``benchmarks.figures``) by theirs. (A bare
    ``python -m sgrpo.fit`` in prose names the entry point: its module is checked.) The long jobs themselves are not
    run; the docs' Python blocks are (test_python_block_runs_and_prints_what_it_says)."""
    import sgrpo.fit

    monkeypatch.chdir(REPO)  # configs/... are relative to the repository, as on a fresh clone
    found = list(dict.fromkeys((module, tuple(args)) for module, args in module_commands(SHELL)))
    modules = {module for module, _ in found}
    assert {"sgrpo.fit", "sgrpo.export", "sgrpo.warmstart", "sgrpo.prepare_data", "benchmarks.figures"} <= modules
    # an optional extra's modules (vLLM's server: docs/servers.md) exist where that extra is installed (make test-vllm)
    checked = [m for m in modules if m.split(".")[0] not in OPTIONAL or importlib.util.find_spec(m.split(".")[0])]
    assert not [m for m in checked if importlib.util.find_spec(m) is None], "modules the docs run that do not exist"

    def parsed(parser, args=None, namespace=None):
        raise Parsed(parse_args(parser, args, namespace))

    parse_args = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    parsers = {}

    def fit_parser(mode: str):  # sgrpo.fit's parser as its CLI builds it, captured before it parses anything
        def capture(self, parser, args):
            raise Parsed(parser)

        with monkeypatch.context() as patched:
            patched.setattr(sgrpo.fit.SgrpoCLI, "parse_arguments", capture)
            with pytest.raises(Parsed) as captured:
                sgrpo.fit.parse([], mode)
        return captured.value.args[0]

    refused, checked = [], 0
    for module, args in found:
        try:
            if module == "sgrpo.fit" and "--config" in args:  # a command to run (not the entry point named in prose)
                mode = args[0] if args[:1] and args[0] in sgrpo.fit.MODES else "fit"
                if mode not in parsers:
                    parsers[mode] = fit_parser(mode)
                parsers[mode].parse_args(list(args[1:] if args[:1] == (mode,) else args))  # jsonargparse's own
            elif module in ARGPARSE_MAINS:
                with pytest.raises(Parsed):
                    importlib.import_module(module).main(list(args))
            else:
                continue
        except SystemExit as exit:
            if exit.code == 0:  # --print_config printed the parsed config
                capsys.readouterr()
                checked += 1
                continue
            refused.append(f"python -m {module} {' '.join(args)}: {capsys.readouterr().err.strip()[-300:]}")
        checked += 1
    assert checked >= 20 and not refused, refused


def test_every_make_command_names_a_target_of_the_makefile():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    named = make_targets(SHELL)
    assert {"quickstart", "test", "test-slow", "test-bench", "test-vllm"} <= set(named)
    assert not sorted(set(named) - targets), "make targets the docs name that the Makefile lacks"


def test_the_command_checks_can_fail():
    text = "```bash\nsrun .venv/bin/python -m sgrpo.export CKPT OUT [--merged]  # one\nmake TORCH_SPEC=x install\n```"
    assert module_commands(text) == [("sgrpo.export", ["CKPT", "OUT", "--merged"])]
    assert make_targets(text) == ["install"]

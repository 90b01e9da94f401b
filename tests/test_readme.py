"""The README's API tour runs as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_tour_runs(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    # The stand-in model predicts last token + 1: each sequence's tokens continue its prompt.
    assert "chat-1 FINISHED [40, 41, 42, 43]" in out and "chat-2 FINISHED [10, 11, 12, 13]" in out
    assert "SchedulerMetrics(" in out


def test_readme_starts_with_the_run_and_test_commands():
    text = README.read_text()
    first = re.findall(r"```bash\n(.*?)\n```", text, re.S)[:2]
    assert first == ["pip install . && skippy-scheduler lab", "pip install '.[test]' && pytest"]


def test_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    first_screen = "\n".join(lines[:25])
    for needed in ("pip install . && skippy-scheduler lab", "pip install '.[test]' && pytest",
                   "(docs/architecture.md)"):
        assert needed in first_screen, needed
    # Installs are from a checkout: the package is not on a package index.
    assert not re.search(r"pip install '?skippy-scheduler", text)


def test_readme_commands_use_flags_the_commands_take():
    import shlex

    from skippy_scheduler.cli import build_parser

    commands = build_parser().commands
    checked = 0
    for block in re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].replace("&", " ")
            words = shlex.split(line)
            if words[:1] != ["skippy-scheduler"]:
                continue
            name = words[1]
            assert name in commands, line
            for word in words[2:]:
                if word.startswith("-"):
                    assert word.split("=", 1)[0] in commands[name]._option_string_actions, \
                        (line, word)
            checked += 1
    assert checked >= 6

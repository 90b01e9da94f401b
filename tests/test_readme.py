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

"""`dynamo-worker --served-model-name` takes one name: Dynamo 1.6's backend registers a model
under one name and takes no aliases, so a second name is refused rather than dropped. The
check comes before anything else (no model, no Dynamo needed)."""
from __future__ import annotations

from skippy_scheduler.cli import main


def test_a_second_served_model_name_is_refused(capsys):
    assert main(["dynamo-worker", "--served-model-name", "m, alias"]) == 2
    err = capsys.readouterr().err
    assert "registers one name" in err and "got 2: m, alias" in err

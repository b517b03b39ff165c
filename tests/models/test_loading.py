"""A policy path that is not a local folder: a misspelt one fails at once with what to do, whether the hub is off,
unreachable or does not know the id; an id the hub cache holds or the hub knows goes on. The hub is never asked
for real: its one call is replaced."""

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import pytest
from huggingface_hub import HfApi

from gpo.models.loading import TOKENIZER_FILES, check_pretrained_folder, pretrained_path
from tests.ports import free_port

MISSPELT = ["Qwen/Qwen2.5-0.5B-Instruc", "mdoel"]  # both look like hub ids


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty hub cache, the hub on, and its one call answered by ``hub.answer`` (an exception to raise, or None
    for "it exists"); ``hub.asked`` lists the ids asked about."""

    hub = SimpleNamespace(answer=None, asked=[])

    def model_info(repo_id, *, timeout=None):
        hub.asked.append(repo_id)
        assert timeout is not None and timeout <= 10  # one bounded request, no retries
        if hub.answer is not None:
            raise hub.answer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    return hub


@contextlib.contextmanager
def stand_in_hub(status: int = 404, error_code: str = "RepoNotFound") -> Iterator[tuple[list[str], str]]:
    """A local stand-in for the hub's API answering every request 404 ``RepoNotFound``, as the hub does for an
    unknown id (or ``status`` with ``error_code``); yields the paths asked for and its address. The hub library's own
    client talks to it."""
    asked = []

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(status)
            self.send_header("X-Error-Code", error_code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield asked, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def refused_at_once(path: str, field: str = "model.policy", kind: str = "model") -> str:
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError) as raised:
        check_pretrained_folder(path, field, kind)
    assert time.perf_counter() - started < 2.0
    message = str(raised.value)
    assert f"{field}={path!r} is not a local folder (looked for {Path.cwd() / path})" in message, message
    assert "save_pretrained" in message, message
    return message


@pytest.mark.parametrize("path", MISSPELT)
def test_offline_a_misspelt_path_fails_at_once_without_asking_the_hub(hub, monkeypatch, path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    assert "the hub is off (HF_HUB_OFFLINE is set)" in refused_at_once(path)
    assert hub.asked == []


@pytest.mark.parametrize("path", MISSPELT)
def test_an_id_the_hub_does_not_know_fails_at_once(hub, monkeypatch, path):
    with stand_in_hub() as (asked, url):
        monkeypatch.setattr(huggingface_hub, "model_info", HfApi(endpoint=url).model_info)
        assert "no model on the hub has that id" in refused_at_once(path, "data.tokenizer", "tokenizer")
    assert [request.split("?")[0] for request in asked] == [f"/api/models/{path}"]


def test_an_unreachable_hub_fails_at_once_instead_of_retrying(hub, monkeypatch):
    """The hub library's own client, asking a port nobody listens on: its connection error (httpx2's since
    huggingface_hub 2, which gpo does not import) is caught like any other."""
    monkeypatch.setattr(huggingface_hub, "model_info", HfApi(endpoint=f"http://127.0.0.1:{free_port()}").model_info)
    assert "the hub could not be reached to look it up (ConnectError: " in refused_at_once(MISSPELT[0])


def test_a_path_that_is_no_hub_id_is_refused_without_asking(hub):
    message = refused_at_once("a..b")  # hub ids may not hold ".."
    assert "is not a valid hub id either" in message and hub.asked == []
    with pytest.raises(FileNotFoundError, match=r"model.policy='./mdoel': no such folder"):
        check_pretrained_folder("./mdoel", "model.policy", "model")
    assert hub.asked == []


def test_a_misspelt_model_folder_gets_the_closest_folder_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny" / "model").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as refused:
        check_pretrained_folder("runs/tiny/modle", "model.policy", "model")
    assert "no such folder (looked for " in str(refused.value)
    assert "/runs/tiny/modle); did you mean runs/tiny/model? Otherwise point model.policy at a folder" in str(
        refused.value
    )
    with pytest.raises(FileNotFoundError, match=r"/runs/tiny/zzz\)\. Point model.policy at a folder"):
        check_pretrained_folder("runs/tiny/zzz", "model.policy", "model")  # nothing close


@pytest.mark.parametrize(
    ("status", "error_code"),
    [(403, "GatedRepo"), (503, "")],  # it exists (the download says what access it needs); the download retries it
)
def test_an_id_the_hub_answers_for_with_another_error_than_not_found_goes_on(hub, monkeypatch, status, error_code):
    with stand_in_hub(status, error_code) as (asked, url):
        monkeypatch.setattr(huggingface_hub, "model_info", HfApi(endpoint=url).model_info)
        check_pretrained_folder("org/gated", "model.policy", "model")
    assert [request.split("?")[0] for request in asked] == ["/api/models/org/gated"]


def test_a_hub_lookup_that_fails_in_the_network_is_refused_with_its_error(hub):
    hub.answer = TimeoutError("timed out")  # an OSError: what a socket raises
    assert "the hub could not be reached to look it up (TimeoutError: timed out)" in refused_at_once("org/name")


@pytest.mark.parametrize("path", ["runs/tiny/model", "my model", "org/.name"])
def test_a_missing_path_that_is_no_hub_id_is_refused_as_a_missing_folder_without_asking(
    hub, monkeypatch, tmp_path, path
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as raised:
        check_pretrained_folder(path, "model.policy", "model")
    assert f"model.policy={path!r}: no such folder (looked for {tmp_path.resolve() / path})" in str(raised.value)
    assert hub.asked == []


def test_a_folder_under_home_is_found_and_a_file_is_refused_as_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    check_pretrained_folder("~/model", "model.policy", "model")
    with pytest.raises(FileNotFoundError, match=r"model.policy='~/model/config.json' is a file, not a .gguf model"):
        check_pretrained_folder("~/model/config.json", "model.policy", "model")


@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_a_tokenizer_folder_needs_one_of_the_tokenizer_files_only(tmp_path, name):
    (tmp_path / name).write_text("{}")
    check_pretrained_folder(str(tmp_path), "model.tokenizer", "tokenizer")


def test_a_local_folder_is_loaded_by_its_absolute_path_and_a_hub_id_as_given(monkeypatch, tmp_path):
    """The model remembers the path as its name_or_path, which an exported adapter records for its base model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "model").mkdir(parents=True)
    assert pretrained_path("runs/model", "model.policy") == str(tmp_path.resolve() / "runs" / "model")
    assert pretrained_path("org/name", "model.policy") == "org/name"


def test_an_id_the_hub_knows_or_the_cache_holds_goes_on(hub, monkeypatch, tmp_path):
    check_pretrained_folder("Qwen/Qwen2.5-0.5B-Instruct", "model.policy", "model")  # the hub answers: it exists
    assert hub.asked == ["Qwen/Qwen2.5-0.5B-Instruct"]
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    no_exist = snapshot.parents[1] / ".no_exist" / ("0" * 40)  # the hub cache's record of a file the repo lacks
    no_exist.mkdir(parents=True)
    (no_exist / "tokenizer.json").write_text("")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    check_pretrained_folder("org/cached", "model.policy", "model")  # offline, from the cache
    with pytest.raises(FileNotFoundError, match="is not in the hub cache"):
        check_pretrained_folder("org/cached", "model.tokenizer", "tokenizer")  # the cache holds no tokenizer
    assert hub.asked == ["Qwen/Qwen2.5-0.5B-Instruct"]


def test_the_policy_loads_in_the_dtype_and_mode_asked_for_and_a_mode_it_lacks_is_refused(tmp_path):
    import torch

    from gpo.models.loading import LoraSettings, load_policy
    from gpo.testing import save_tiny_model

    folder = str(save_tiny_model(tmp_path / "model"))
    full = load_policy(folder, dtype="bfloat16", mode="full", lora=None)
    assert {p.dtype for p in full.parameters()} == {torch.bfloat16}
    adapted = load_policy(folder, dtype="float32", mode="lora", lora=LoraSettings(r=2))
    trained = {name for name, p in adapted.named_parameters() if p.requires_grad}
    # every linear layer but the output layer gets an adapter ("all-linear"), the MLP's included
    assert any("mlp.up_proj.lora_A" in name for name in trained) and any("q_proj.lora_A" in name for name in trained)
    assert not any("lm_head" in name for name in trained) and all("lora_" in name for name in trained)
    with pytest.raises(ValueError, match=r"model\.trainer_mode='dora' is not valid; choose 'full', 'lora' or 'qlora'"):
        load_policy(folder, dtype="float32", mode="dora", lora=None)


def test_a_target_module_matches_a_whole_name_or_its_last_parts_not_a_suffix_of_a_name():
    from gpo.models.loading import check_target_modules
    from gpo.testing import tiny_model

    model = tiny_model()
    check_target_modules(model, ["q_proj", "mlp.up_proj", "model.layers.0.self_attn.v_proj"])
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['proj'\] names no module of the model"):
        check_target_modules(model, ["proj"])  # peft would match nothing: a name's last part is q_proj, not proj


@pytest.mark.parametrize("start", [True, False])
def test_training_mode_switches_for_the_block_and_puts_the_mode_back(start):
    from gpo.models.loading import training_mode
    from gpo.testing import tiny_model

    model = tiny_model().train(start)
    with training_mode(model, not start):
        assert model.training is (not start) and all(m.training is (not start) for m in model.modules())
    assert model.training is start and all(m.training is start for m in model.modules())

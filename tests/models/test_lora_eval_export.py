"""LoRA training, the reference as the adapter switched off, held-out evaluation and the exported folder."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpo.algo import KLPenalty
from gpo.callbacks import ExportPolicy
from gpo.models.loading import LoraSettings, check_trainer_mode
from gpo.models.scorer import score_tokens
from gpo.rewards import positional_match
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.evaluation import Evaluation
from gpo.train.optimization import Optimization
from tests.tiny import tiny_module


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_model(root / "model", "llama", seed=0)
    data = write_jsonl(make_task("sort_digits", 500, seed=0), root / "train.jsonl")
    return root, str(model), str(data)


def fit(module, workspace, steps, tag, export="merged", **trainer_kwargs):
    root, model, data = workspace
    trainer = L.Trainer(
        max_steps=steps,
        default_root_dir=root / tag,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExportPolicy(mode=export)],
        **trainer_kwargs,
    )
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=4, val_size=8))
    return trainer


def sample_logp(model, ids):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return score_tokens(model, ids, mask, 3).logp


def test_lora_trains_only_the_adapter_and_uses_it_as_reference_switch(workspace):
    _, model, _ = workspace
    lora = LoraSettings(r=4, alpha=8, dropout=0.0)
    module = tiny_module(model, optim=Optimization(lr=1e-2), trainer_mode="lora", lora=lora, kl=KLPenalty(beta=0.05))
    assert module.scorer.reference is None  # no second copy: the reference is the adapter switched off
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = fit(module, workspace, 10, "lora", export="adapter", limit_val_batches=0)
    changed = {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert "kl/mean" in trainer.callback_metrics
    # the adapter export loads on top of the base model and reproduces the trained policy
    from peft import PeftModel

    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), trainer.log_dir + "/export")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(sample_logp(exported.get_base_model(), ids), sample_logp(module.model, ids))


def test_full_run_exports_a_folder_transformers_loads_and_evaluates(workspace):
    _, model, _ = workspace

    def half(prompts, completions, **_):
        return [0.5] * len(completions)

    module = tiny_module(model, [positional_match, half], evaluation=Evaluation(samples=2, pass_threshold=0.5))
    trainer = fit(module, workspace, 4, "full", val_check_interval=2)
    logged = trainer.callback_metrics
    for key in ("val/reward_greedy", "val/pass@1_greedy", "val/reward_sampled", "val/pass@1_sampled"):
        assert key in logged and 0 <= float(logged[key]) <= 1.5
    for kind in ("greedy", "sampled"):  # each reward function's mean; the mixed reward is their sum
        assert float(logged[f"val/reward_{kind}/half"]) == 0.5
        parts = float(logged[f"val/reward_{kind}/positional_match"]) + 0.5
        assert float(logged[f"val/reward_{kind}"]) == pytest.approx(parts, abs=1e-6)
    folder = trainer.log_dir + "/export"
    exported, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("12 3").input_ids) == "12 3"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(sample_logp(exported, ids), sample_logp(module.model, ids))


def test_merged_lora_export_is_a_plain_model_folder(workspace, tmp_path):
    from gpo.models.export import export_policy
    from gpo.models.loading import load_policy

    _, model, _ = workspace
    policy = load_policy(model, dtype="float32", mode="lora", lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a non-zero adapter, so merging matters
    folder = export_policy(policy, AutoTokenizer.from_pretrained(model), tmp_path / "merged", merge=True)
    assert not (folder / "adapter_config.json").exists()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    merged = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(
        sample_logp(merged, ids), sample_logp(policy.get_base_model(), ids), atol=1e-5, rtol=1e-5
    )
    assert any("lora_" in n for n, _ in policy.named_parameters())  # the training model was left as it was


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_qlora_is_refused_on_cpu_with_the_alternative():
    with pytest.raises(ValueError, match=r"trainer_mode='qlora' needs a CUDA GPU.*trainer_mode='lora'"):
        check_trainer_mode("qlora")
    with pytest.raises(ValueError, match="'full', 'lora' or 'qlora'"):
        check_trainer_mode("adapter")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_export_command_turns_a_checkpoint_into_a_transformers_folder(tmp_path, mode, capsys):
    from gpo.cli import main

    model = save_tiny_model(tmp_path / "model", "llama")
    data = write_jsonl(make_task("sort_digits", 64), tmp_path / "train.jsonl")
    lora = ["--model.trainer_mode=lora", "--model.lora.r=2", "--model.lora.dropout=0.0"] if mode == "lora" else []
    run = ["--model.group_size=2", "--model.optim.lr=0.01", "--trainer.max_steps=3", f"--data.path={data}"]
    where = [f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.enable_progress_bar=false"]
    reward = '--model.rewards=[{"class_path": "gpo.rewards.LengthPenalty", "init_args": {"max_tokens": 2}}]'
    main(["fit", f"--model.policy={model}", reward, *run, *where, *lora])  # lengths differ from step 1: it trains
    version = tmp_path / "run" / "lightning_logs" / "version_0"
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("*.ckpt")  # last.ckpt: the weights after the last step
    main(["export", str(version / "config.yaml"), str(checkpoint), str(tmp_path / "exported")])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    at_end = AutoModelForCausalLM.from_pretrained(version / "export")  # written by the run itself
    torch.testing.assert_close(sample_logp(exported, ids), sample_logp(at_end, ids))
    trained = not torch.allclose(
        sample_logp(exported, ids), sample_logp(AutoModelForCausalLM.from_pretrained(model), ids)
    )
    assert trained
    # the config of another run: a LoRA rank of 4 (a LoRA checkpoint of rank 2), or LoRA (a full checkpoint)
    settings = yaml.safe_load((version / "config.yaml").read_text())
    settings["model"] |= {"trainer_mode": "lora", "lora": {**(settings["model"].get("lora") or {}), "r": 4}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(settings))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "other.yaml"), str(checkpoint), str(tmp_path / "wrong")])
    [err] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpo export: error: ")]
    says = "weights differ in shape" if mode == "lora" else "weights missing"
    assert f"does not match the model {tmp_path / 'other.yaml'} describes: " in err and says in err, err
    assert err.endswith(
        "give the config.yaml of the run that wrote the checkpoint (its lightning_logs/version_N/config.yaml)."
    )


class RunsCode:
    """Unpickling it would write a file: what a malicious checkpoint does with a shell command instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_export_refuses_a_checkpoint_that_carries_code(tmp_path, capsys):
    from gpo.cli import main

    model = save_tiny_model(tmp_path / "model", "llama")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {model}\n")
    marker = tmp_path / "code_ran"
    torch.save({"state_dict": {}, "payload": RunsCode(marker)}, tmp_path / "shared.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(config), str(tmp_path / "shared.ckpt"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not marker.exists()  # nothing from the file ran
    assert "holds pickled objects other than tensors" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_swapped_arguments_a_missing_checkpoint_and_an_adapter_of_a_full_run(tmp_path, capsys):
    """Each refused before the model loads, in one line that says what to give."""
    from gpo.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {tmp_path / 'no_model_needed'}\n  trainer_mode: full\n")
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, checkpoint)
    cases = {
        (str(checkpoint), str(config)): f"{checkpoint} is a checkpoint, not a config: gpo export takes the run's "
        "config.yaml, then a .ckpt file, then the folder to write",
        (str(config), str(tmp_path / "nope.ckpt")): f"checkpoint {tmp_path / 'nope.ckpt'} does not exist",
        (str(config), str(checkpoint), "--adapter"): "trains the full model (trainer_mode: full), which has no "
        "adapter; leave out --adapter.",
    }
    (tmp_path / "weights.bin").write_bytes(b"\x80\x02binary")
    cases[(str(tmp_path / "weights.bin"), str(checkpoint))] = "weights.bin is not a YAML config (UnicodeDecodeError)"
    cases[(str(config), str(tmp_path))] = f"{tmp_path} is a folder; give a .ckpt file"
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "__0_0.distcp").write_bytes(b"")
    cases[(str(config), str(tmp_path / "shards"))] = "is a folder of per-process shards (FSDP); gpo export reads a"
    cases[("quickstrat", str(checkpoint))] = (
        "CONFIG quickstrat: no such file here, and gpo ships no config of that name"
    )
    for args, says in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["export", args[0], args[1], str(tmp_path / "out"), *args[2:]])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("gpo export: error: ") and says in err, (args, err)
        assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_folder_that_holds_anything_but_an_earlier_export(tmp_path, capsys, monkeypatch):
    """An export replaces its folder whole: given a run's folder, or ``.``, it deleted every file there and said
    ``wrote`` (seen before 2026-11-28). Refused before the model loads, with nothing touched; an empty folder and an
    earlier export (its mark) are written."""
    from gpo.cli import main
    from gpo.models.export import EXPORT_MARK, export_policy
    from gpo.testing import char_tokenizer, tiny_model

    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {tmp_path / 'no_model_needed'}\n")
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, checkpoint)
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "sub" / "data.txt").write_text("kept")
    monkeypatch.chdir(run)
    for out, says in [(str(run), f"OUT: {run} holds files that no gpo export wrote"), (".", f"OUT: {run} holds"),
                      ("sub/data.txt", f"OUT: {run / 'sub' / 'data.txt'} is a file; give a folder")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(config), str(checkpoint), out])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(f"gpo export: error: {says}"), err
    assert [path.name for path in run.rglob("*")] == ["sub", "data.txt"]
    with pytest.raises(FileExistsError, match=r"export folder: .* choose a new or empty folder"):
        export_policy(tiny_model(seed=0), char_tokenizer(), run)
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # into an empty folder, then over that export
        export_policy(tiny_model(seed=0), char_tokenizer(), tmp_path / "empty")
        assert (tmp_path / "empty" / EXPORT_MARK).is_file() and (tmp_path / "empty" / "config.json").is_file()


def test_export_policy_refuses_a_folder_holding_other_files_before_training(workspace, tmp_path):
    _, model, data = workspace
    (tmp_path / "notes.txt").write_text("kept")
    module = tiny_module(model)
    trainer = L.Trainer(max_steps=2, callbacks=[ExportPolicy(folder=str(tmp_path))], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(FileExistsError, match=rf"ExportPolicy folder: {tmp_path} holds files that no gpo export"):
        trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=4))
    assert trainer.global_step == 0 and [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_a_run_killed_during_its_export_exports_when_resumed(workspace, tmp_path):
    """The checkpoint of the last step is written before the export: a run killed while exporting resumes with
    nothing to train, which Lightning ends without on_train_end. The export is written then."""
    from gpo.callbacks import ResumeCheckpoint
    from gpo.models.export import EXPORT_MARK

    _, model, data = workspace

    def trainer():
        return L.Trainer(max_steps=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                         callbacks=[ResumeCheckpoint(), ExportPolicy(folder=str(tmp_path / "export"))])  # fmt: skip

    trainer().fit(tiny_module(model), PromptDataModule(data, tokenizer=model, prompts_per_step=4))
    shutil.rmtree(tmp_path / "export")  # as a kill during the export leaves it: absent
    resumed = trainer()
    resumed.fit(tiny_module(model), PromptDataModule(data, tokenizer=model, prompts_per_step=4), ckpt_path="last")
    assert resumed.global_step == 2 and (tmp_path / "export" / EXPORT_MARK).is_file()


def test_an_adapter_records_its_base_model_as_an_absolute_folder(workspace, monkeypatch):
    """``model.policy: model`` given relative to the run's working directory: the exported adapter must still find
    its base model from anywhere."""
    from gpo.models.loading import load_policy

    root, model, _ = workspace
    monkeypatch.chdir(root)
    policy = load_policy("model", dtype="float32", mode="lora", lora=LoraSettings(r=4, alpha=8))
    assert policy.peft_config["default"].base_model_name_or_path == str(Path(model).resolve())


def test_a_loaded_policy_gets_the_adapter_trainer_mode_asks_for(caplog):
    """It trained the whole model, silently, whatever trainer_mode said."""
    from gpo.models.loading import add_lora, is_peft
    from gpo.rollout import HFEngine
    from gpo.testing import char_tokenizer, tiny_model
    from gpo.train.module import GPOModule

    def policy(loaded=None, **kwargs):
        return GPOModule(loaded or tiny_model("llama"), [positional_match], engine=HFEngine(),
                         tokenizer=char_tokenizer(), **kwargs).policy  # fmt: skip

    lora = policy(trainer_mode="lora", lora=LoraSettings(r=4, alpha=8))
    assert is_peft(lora) and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    wrapped = add_lora(tiny_model("llama"), LoraSettings(r=2, alpha=4))
    with caplog.at_level("WARNING", logger="gpo.train.preflight"):
        assert policy(wrapped, trainer_mode="lora", lora=LoraSettings(r=8)) is wrapped  # it keeps its own adapter
    assert "model.lora is set but model.policy is a peft model: its own adapter trains" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpo.train.preflight"):
        full = policy(trainer_mode="full", lora=LoraSettings(r=4, alpha=8))
    assert not is_peft(full) and "model.lora is set but model.trainer_mode is 'full'" in caplog.text
    with pytest.raises(ValueError, match=r"give model\.policy as a folder, not a loaded model"):
        policy(trainer_mode="qlora")


def test_a_misspelt_target_module_of_a_gpt2_model_lists_its_conv1d_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpo.models.loading import check_target_modules

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match=r"did you mean c_attn\? Its linear layers are named \['c_attn', 'c_fc'"):
        check_target_modules(gpt2, ["c_atn"])
    check_target_modules(gpt2, ["c_attn"])  # peft adapts Conv1D: accepted


def untied_tiny_model(path):
    """The tiny llama with an output layer of its own (``tie_word_embeddings`` false), as a transformers folder."""
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(path, "llama"))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("left_out", "tied", "refused"),
    [("model.norm.weight", True, True), ("lm_head.weight", False, True), ("lm_head.weight", True, False)],
)
def test_export_refuses_a_checkpoint_missing_a_weight_of_the_model(tmp_path, capsys, left_out, tied, refused):
    """The base model's weight would stand in for the trained one, unseen. The output layer may be left out only
    where it is the input embedding (tie_word_embeddings)."""
    from gpo.cli import main

    model = save_tiny_model(tmp_path / "model", "llama") if tied else untied_tiny_model(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(model)
    assert loaded.config.tie_word_embeddings is tied
    state = {f"policy.{key}": value for key, value in loaded.state_dict().items() if key != left_out}
    torch.save({"state_dict": state}, tmp_path / "last.ckpt")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {model}\n")
    if not refused:
        main(["export", str(config), str(tmp_path / "last.ckpt"), str(tmp_path / "out")])
        assert (tmp_path / "out" / "config.json").is_file()
        return
    with pytest.raises(SystemExit):
        main(["export", str(config), str(tmp_path / "last.ckpt"), str(tmp_path / "out")])
    assert f"1 weights missing (e.g. ['{left_out}']), 0 unexpected" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_export_replaces_a_folder_whole_and_leaves_no_partial_or_previous_folder_behind(tmp_path):
    """A stale partial folder of a killed export is cleared first (its files would land in the export), and the
    replaced export is removed once the new one is in place."""
    from gpo.models.export import export_policy
    from gpo.testing import char_tokenizer, tiny_model

    stale = tmp_path / ".exported.partial"
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"from a killed export")
    export_policy(tiny_model(seed=0), char_tokenizer(), tmp_path / "exported")
    assert not (tmp_path / "exported" / "junk.bin").exists()
    export_policy(tiny_model(seed=1), char_tokenizer(), tmp_path / "exported")  # over the first one
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exported"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    torch.testing.assert_close(reloaded.lm_head.weight, tiny_model(seed=1).lm_head.weight)


def test_export_policy_exports_once_per_fit_whether_or_not_training_ended(tmp_path, monkeypatch):
    """on_fit_end exports only a fit that got no on_train_end (nothing left to train); each fit of the same callback
    exports again."""
    from gpo.models import export

    folders = []
    monkeypatch.setattr(export, "export_policy", lambda policy, tokenizer, folder, merge: folders.append(folder))
    callback = ExportPolicy(folder=str(tmp_path / "export"))
    trainer, module = SimpleNamespace(is_global_zero=True), SimpleNamespace(policy=None, tokenizer=None)
    callback.on_fit_start(trainer, module)
    callback.on_train_end(trainer, module)
    callback.on_fit_end(trainer, module)
    assert folders == [tmp_path / "export"]
    callback.on_fit_start(trainer, module)  # a later fit with nothing to train
    callback.on_fit_end(trainer, module)
    assert folders == [tmp_path / "export"] * 2

"""``gpo fit`` logs to CSV and TensorBoard by default, and ``gpo plot`` draws the run it wrote."""

import errno
import os
import sys
from pathlib import Path

# Imported while the tests are collected, as other test modules import it: Lightning's log handler keeps the sys.stderr
# of its import, which must not be a test's capsys stream (closed when that test ends).
import lightning.pytorch  # noqa: F401
import pytest

from gpo.cli import main, run
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model

QUICKSTART = Path(__file__).resolve().parents[1] / "configs/quickstart.yaml"


def fit(root: Path, out: str, *extra: str) -> Path:
    args = ["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", f"--data.path={root / 'train.jsonl'}"]
    args += ["--trainer.max_steps=2", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"]
    args += ["--data.val_path=null", "--trainer.val_check_interval=1.0", "--trainer.check_val_every_n_epoch=1"]
    main([*args, f"--trainer.default_root_dir={root / out}", *extra])
    return root / out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_model(root / "model", "llama")
    write_jsonl(make_task("sort_digits", 32), root / "train.jsonl")
    return root


@pytest.fixture(scope="module")
def run_dir(root):
    return fit(root, "run")


def test_a_run_refused_at_set_up_leaves_no_version_folder_and_a_resumed_one_keeps_its_own(root):
    """The next run takes version_0, as the docs' paths say; a refused resume keeps the folder it resumes."""
    with pytest.raises(ValueError, match="number_of_minibatches=3 does not divide"):
        fit(root, "refused", "--model.optim.number_of_minibatches=3")
    assert list((root / "refused/lightning_logs").iterdir()) == []
    fit(root, "refused")
    with pytest.raises(ValueError, match="number_of_minibatches=3 does not divide"):
        fit(root, "refused", "--model.optim.number_of_minibatches=3", "--ckpt_path=last", "--trainer.max_steps=4")
    version = root / "refused/lightning_logs/version_0"
    assert [p.name for p in (root / "refused/lightning_logs").iterdir()] == ["version_0"]
    assert (version / "metrics.csv").is_file() and (version / "config.yaml").is_file()


def test_fit_logs_csv_and_tensorboard_by_default(run_dir):
    version = run_dir / "lightning_logs/version_0"
    assert "reward/mean" in (version / "metrics.csv").read_text()
    assert list((version / "tb").glob("events.out.tfevents.*"))
    assert (version / "config.yaml").is_file()


def test_plot_draws_the_run(run_dir, capsys):
    main(["plot", str(run_dir)])
    assert (run_dir / "curves.png").stat().st_size > 0
    assert "lightning_logs/version_0/metrics.csv" in capsys.readouterr().out


def test_plot_error_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path)])
    assert exit_.value.code == 2 and "gpo plot: error: no metrics.csv found" in capsys.readouterr().err


def test_plot_takes_the_csv_itself_and_names_the_runs_of_a_folder_of_runs(run_dir, tmp_path, capsys):
    version = tmp_path / "runs/first/lightning_logs/version_0"
    version.mkdir(parents=True)
    (version / "metrics.csv").write_text((run_dir / "lightning_logs/version_0/metrics.csv").read_text())
    main(["plot", str(version / "metrics.csv")])
    assert (version / "curves.png").stat().st_size > 0  # next to the CSV
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "runs")])  # three folders up: one default_root_dir per run
    assert f"it holds the runs {tmp_path / 'runs/first'}: give one of them" in capsys.readouterr().err


def test_a_logger_the_user_sets_replaces_the_defaults(root):
    logger = ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={root / 'own'}"]
    own = fit(root, "own", *logger)
    assert (own / "lightning_logs/version_0/metrics.csv").is_file()
    assert not list(own.rglob("events.out.tfevents.*"))
    assert not list(fit(root, "none", "--trainer.logger=false").rglob("metrics.csv"))


def test_a_reward_in_the_working_directory_is_found_by_its_module_name(root, tmp_path, monkeypatch):
    from gpo.cli import run

    (tmp_path / "rewards_here.py").write_text("def starts_with_digit(prompts, completions, **_):\n"
                                              "    return [float(c[:1].isdigit()) for c in completions]\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    args = ["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", f"--data.path={root / 'train.jsonl'}"]
    run([*args, "--model.rewards=[rewards_here.starts_with_digit]", "--trainer.max_steps=1", "--data.val_path=null",
         "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'run'}"])  # fmt: skip
    assert "reward/starts_with_digit" in (tmp_path / "run/lightning_logs/version_0/metrics.csv").read_text()


def test_a_slip_in_a_part_of_ones_own_names_where_it_was_raised(root, tmp_path, monkeypatch, capsys):
    from gpo.cli import run

    (tmp_path / "buggy_parts.py").write_text(
        "from gpo.algo import AdvantageEstimator\n\n\n"
        "class Buggy(AdvantageEstimator):\n"
        "    def __call__(self, reward, group, mask):\n"
        "        return (reward - float(reward))[:, None] * mask  # float() of many values\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    args = ["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", f"--data.path={root / 'train.jsonl'}"]
    args += ["--model.algorithm=Custom", "--model.algorithm.advantage=buggy_parts.Buggy", "--data.val_path=null"]
    args += ["--trainer.max_steps=1", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit):
        run(args)
    err = capsys.readouterr().err
    assert "(raised at buggy_parts.py:6 in Buggy.__call__)" in err and "Traceback" not in err, err


def test_an_error_of_gpos_own_callbacks_is_not_placed_in_the_users_code(monkeypatch):
    """From a checkout (an editable install), gpo.callbacks' files lie under the working directory, outside gpo/."""
    from gpo.callbacks import DynamicSampling
    from gpo.cli.blame import raised_in_user_code

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(ValueError) as refused:
        DynamicSampling(max_rounds=-1)
    where = raised_in_user_code(refused.value)  # the user's call (here this test's), not the callback's own check
    assert where.startswith("tests/test_cli.py:") and "dynamic_sampling.py" not in where, where


def test_model_tokenizer_also_tokenises_the_prompts(root, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    tokenizer.save_pretrained(tmp_path / "tok")
    (root / "model" / "tokenizer.json").rename(tmp_path / "moved.json")  # the policy folder alone would now fail
    try:
        fit(root, "own_tokenizer", f"--model.tokenizer={tmp_path / 'tok'}")
    finally:
        (tmp_path / "moved.json").rename(root / "model" / "tokenizer.json")
    assert (root / "own_tokenizer/lightning_logs/version_0/metrics.csv").is_file()


OLD_CONFIG = """
model:
  knobs: {use_ppo_clip: true}
"""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(("--model.knobs.clip_low=0.3",), "model.knobs moved: a preset takes its own settings", id="knobs"),
        pytest.param(("--model.export=none",), "export is a top-level setting now", id="export"),
        pytest.param(("--model.mask_truncated_completions=true",), "model.token_weights: [gpo.algo.OverlongFilter]",
                     id="mask_truncated_completions"),
        pytest.param(("--model.gate=ClipGate",), "class_path: Custom", id="gate"),
        pytest.param(("--model.engine.init_args.max_new_tokens=8",), "model.engine.init_args.sampling.max_new_tokens",
                     id="max_new_tokens"),
        pytest.param(("--model.rewards=[gpo.envs.env_reward]",), "moved: use gpo.rewards.env_reward", id="env_reward"),
        pytest.param(("--trainer.strategy=gpo.strategies.FullyShardedStrategy",),
                     "use gpo.parallel.fsdp.FullyShardedStrategy", id="fsdp_strategy"),
        pytest.param(("--model.optim.learning_rate=1e-3",), "model.optim takes: lr, weight_decay", id="misspelt_key"),
        pytest.param(("--trainer.gradient_clip_val=0.5",), "set model.optim.max_grad_norm: 0.5",
                     id="gradient_clip_val"),
        pytest.param(("--trainer.accelerator=mps",), "`MPSAccelerator` can not run on your system",
                     id="lightning_refuses"),  # a MisconfigurationException (no Mac here)
        pytest.param(("--seed_everthing=1",), "unknown setting seed_everthing\ndid you mean seed_everything?",
                     id="top_level_key"),
        pytest.param(("--model.rewards+=gpo.rewards.DuplicatePenalty", "--model.rewards.1.init_args.penalty=-0.5"),
                     "unknown setting model.rewards.1.init_args.penalty\nmodel.rewards is a list, whose items the "
                     "command line does not reach by index: --model.rewards+=CLASS --model.rewards.SETTING VALUE",
                     id="list_item_by_index"),
        pytest.param(("--model.rewards+=gpo.rewards.DuplicatePenalty", "--model.rewards.penalti=-0.5"),
                     "model.rewards (DuplicatePenalty) has no setting 'penalti'\ndid you mean model.rewards.penalty?",
                     id="reward_class_setting"),
        pytest.param(("--resume=last",), "the top-level settings are model, data, trainer, seed_everything",
                     id="top_level_far_off"),
        pytest.param(("--trainer.precision=bf17",),
                     "trainer.precision: bf17 is not one of 64, 32, 16, transformer-engine", id="precision_choices"),
        pytest.param(("--trainer.deterministic=maybe",),
                     "trainer.deterministic: maybe is not one of true, false, warn, null", id="union_with_bool"),
        pytest.param(("--model.optim.lr_schedule=cosin",),
                     "model.optim.lr_schedule: cosin is not one of constant, linear, cosine; did you mean cosine?",
                     id="literal_choices"),
        pytest.param(("--model.algorithm=Custom", "--model.algorithm.advantage=gpo.algo.ClipGate"),
                     "ClipGate is a gpo RatioGate, which this setting does not take; did you mean "
                     "model.algorithm.gate?", id="part_of_another_kind"),
        pytest.param(("--model.algorithm=Custom", "--model.algorithm.aggregator=gpo.algo.LossAggregator"),
                     "LossAggregator is abstract: it does not implement normaliser, numerator.", id="abstract_part"),
        pytest.param(("--model.algorithm=Custom", "--model.algorithm.gate=gpo.algo.ClipGte"),
                     "did you mean gpo.algo.ClipGate?", id="misspelt_class"),
        pytest.param(("--model.algorithm=Custom", '--model.algorithm.gate={"class_path": "gpo.algo.ClipGate", '
                      '"init_arg": {"clip_low": 0.1}}'), "a class_path block takes class_path and init_args",
                     id="misspelt_init_args"),
        pytest.param(("--model.algorithm=DAPO", "--model.algorithm.clip_high=-1"),
                     "gpo fit: error: DAPO: clip_low=0.2, clip_high=-1.0 give the interval", id="whose_check_dapo"),
        pytest.param(("--model.algorithm=Custom", "--model.algorithm.gate=ClipGate",
                      "--model.algorithm.gate.dual_clip=0.5"), "gpo fit: error: ClipGate: dual_clip=0.5 must be > 1",
                     id="whose_check_part"),
        pytest.param(("--model.algorithm=RLOO", "--model.algorithm.ppo_clip.dual_clip=0.5"),
                     "gpo fit: error: PPOClip: dual_clip=0.5 must be > 1", id="whose_check_ppo_clip"),
        pytest.param(("--model.optim.lr=-1",), "gpo fit: error: model.optim.lr=-1.0 must be > 0", id="named_by_key"),
        pytest.param(("--model.evaluation.every_n_iters=5",), "model.evaluation.every_n_iters is not a gpo setting; "
                     "evaluations are scheduled by the trainer: trainer.val_check_interval", id="other_trainer_nested"),
        pytest.param(("--model.step_rewards_mode=env_sparse",), "model.step_rewards_mode is not a gpo setting; "
                     "model.step_rewards: {mode: decision_stepwise", id="other_trainer_key"),
    ],
)  # fmt: skip
def test_an_old_or_misspelt_setting_gets_a_short_error_naming_its_new_place(root, capsys, args, says):
    from gpo.cli import run

    with pytest.raises(SystemExit) as exit_info:
        run(["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err, err
    message = err[err.index("gpo fit: error: ") :]  # after any progress bar of the model loading
    assert len(message.splitlines()) <= 5 and "Traceback" not in err, err


def test_the_error_names_the_yaml_file_that_holds_the_setting(root, tmp_path, capsys):
    from gpo.cli import run

    old = tmp_path / "old.yaml"
    old.write_text(OLD_CONFIG)
    with pytest.raises(SystemExit):
        run(["fit", f"--config={QUICKSTART}", f"--config={old}", f"--model.policy={root / 'model'}"])
    err = capsys.readouterr().err
    assert "unknown setting model.knobs.use_ppo_clip" in err and f"(set in {old})" in err, err


def test_an_error_about_a_setting_given_as_a_flag_names_no_config_file(root, tmp_path, capsys):
    # quickstart.yaml sets data.path too: blamed for the flag's file, it sent the user to the wrong place
    from gpo.cli import run

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "12="}\n\xff bad\n')
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"data:\n  path: {bad}\n")
    model = f"--model.policy={root / 'model'}"
    for args, blamed in [((f"--data.path={bad}",), None), ((f"--config={mine}",), mine)]:
        with pytest.raises(SystemExit):
            run(["fit", f"--config={QUICKSTART}", *args, model, "--trainer.max_steps=1"])
        err = capsys.readouterr().err
        assert "line 2 is not UTF-8" in err, err
        assert (f"(set in {blamed})" in err) if blamed else ("(set in" not in err), err


@pytest.mark.parametrize(
    ("key", "flag", "given"),
    [
        ("data.path", "data.path", True),
        ("model.engine.init_args.sampling", "model.engine.sampling.top_p", True),  # a setting under the key
        ("model.engine.sampling.top_p", "model.engine.init_args.sampling", True),  # the flag holds the key
        ("model.engine.init_args.sampling.top_p", "model.engine", True),
        ("data.path", "data.path_suffix", False),  # a longer name is another setting
        ("data.path_suffix", "data.path", False),
        ("data.val_path", "data.path", False),
    ],
)
def test_a_setting_is_given_on_the_command_line_when_a_flag_sets_it_or_a_setting_above_or_below_it(key, flag, given):
    from gpo.cli.shipped import command_line_keys, given_on_command_line

    flags = command_line_keys(["fit", "--config", "quickstart", f"--{flag}=x", "--trainer.max_steps", "1"])
    assert flags == {flag, "trainer.max_steps"}
    assert given_on_command_line(key, flags) is given


def test_a_gpu_asked_for_on_a_machine_without_one_names_the_setting_and_the_fix():
    from gpo.cli.errors import explain

    assert explain("No supported gpu backend found!") == (
        "trainer.accelerator: No supported gpu backend found! torch sees no GPU here: set --trainer.accelerator cpu, "
        "or auto (which takes what the machine has)."
    )


@pytest.mark.parametrize(
    ("yaml_text", "message", "named"),
    [
        ("model:\n  group_size: 1\n", "model.group_size=1: group-relative advantages need at least 2", True),
        ("model:\n  policy: runs/modle\n", "model.policy='runs/modle': no such folder", True),
        ("data:\n  path: trian.jsonl\n", "data.path: data path 'trian.jsonl' does not exist", True),
        ("model:\n  group_size: 16\n", "model.group_size=1: group-relative", False),  # 1 came from a flag
        ("model:\n  group_size: 1\n", "the reward function failed: model.group_size", False),  # not about a setting
    ],
)
def test_gpos_own_refusal_of_a_setting_names_the_yaml_file_that_set_it(tmp_path, yaml_text, message, named):
    """jsonargparse's errors named the file (above); gpo's own checks, run after parsing, did not."""
    from gpo.cli.errors import explain

    config = tmp_path / "mine.yaml"
    config.write_text(yaml_text)
    explained = explain(message, [str(tmp_path / "other.yaml"), str(config)])
    assert explained == (f"{message}\n(set in {config})" if named else message)


def test_gpos_own_warnings_are_printed_as_words_and_other_libraries_as_python_prints_them():
    """A warning of gpo's came with gpo's file, line number and a stray code line (``rank_zero_warn(``)."""
    from pathlib import Path

    import lightning

    import gpo
    from gpo.callbacks import resume_checkpoint
    from gpo.cli import PYTHON_WARNING_FORM, gpo_warnings_in_words

    form = gpo_warnings_in_words("gpo fit", PYTHON_WARNING_FORM)
    for own in (Path(gpo.__file__).parent / "train" / "run_state.py", Path(resume_checkpoint.__file__)):
        assert form("resumed with settings changed", UserWarning, str(own), 199) == (
            "gpo fit: warning: resumed with settings changed\n"
        )
    other = str(Path(lightning.__file__).parent / "trainer" / "trainer.py")
    assert form("a Lightning warning", UserWarning, other, 7, "x = 1") == PYTHON_WARNING_FORM(
        "a Lightning warning", UserWarning, other, 7, "x = 1"
    )


def test_a_run_prints_nothing_a_user_cannot_act_on(root):
    """Lightning's cloud tips, its own pytree deprecation warning, its warnings about the data module's batch transfer
    and about the empty validation loader of a run without held-out prompts are left out of ``gpo fit``'s output (a
    fresh process: Lightning warns once per process)."""
    import subprocess

    args = ["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", f"--data.path={root / 'train.jsonl'}"]
    args += ["--trainer.max_steps=1", "--data.val_path=null", f"--trainer.default_root_dir={root / 'quiet'}"]
    done = subprocess.run([sys.executable, "-m", "gpo.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Sanity Checking" not in output and "max_steps=1" in output  # no held-out prompts to check; it trained
    for noise in ("Tip:", "LeafSpec", "transfer_batch_to_device", "Total length of"):
        assert noise not in output, output


def test_a_missing_model_or_data_file_names_the_configs_set_up_step(root, tmp_path, capsys, monkeypatch):
    """The shipped multi-turn config run before its set-up: the error names the commands its header gives."""
    from gpo.cli import run

    monkeypatch.chdir(tmp_path)  # no runs/ here
    with pytest.raises(SystemExit):
        run(["fit", "--config", "multiturn"])
    err = capsys.readouterr().err
    setup = "gpo tiny runs/tiny && python -m gpo.envs.number_guess_prompts runs/guess"
    assert f"multiturn.yaml needs its set-up step run first: {setup}" in err, err

    with pytest.raises(SystemExit):  # the model there, the data not
        run(["fit", "--config", "multiturn", f"--model.policy={root / 'model'}"])
    err = capsys.readouterr().err
    assert "data.path" in err and setup in err, err


def test_a_mistyped_path_after_the_set_up_gets_the_closest_file_and_no_set_up_hint(root, tmp_path, capsys, monkeypatch):
    from gpo.cli import run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/tiny").mkdir(parents=True)  # what quickstart.yaml's set-up step, gpo tiny runs/tiny, writes
    (tmp_path / "runs/tiny/train.jsonl").write_text((root / "train.jsonl").read_text())
    with pytest.raises(SystemExit):
        run(["fit", "--config", "quickstart", f"--model.policy={root / 'model'}", "--data.path=runs/tiny/trian.jsonl"])
    err = capsys.readouterr().err
    assert "data path 'runs/tiny/trian.jsonl' does not exist; did you mean runs/tiny/train.jsonl?" in err, err
    assert "set-up" not in err, err


def test_a_misspelt_setting_gets_no_set_up_hint(root, capsys):
    from gpo.cli import run

    with pytest.raises(SystemExit):
        run(["fit", f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", "--model.optim.learning_rate=1"])
    assert "set-up" not in capsys.readouterr().err


def test_validate_last_without_a_checkpoint_is_refused_not_run_on_the_untrained_policy(root, tmp_path, capsys):
    from gpo.cli import run

    args = [f"--config={QUICKSTART}", f"--model.policy={root / 'model'}", f"--data.path={root / 'train.jsonl'}"]
    with pytest.raises(SystemExit) as exit_info:
        run(["validate", *args, f"--trainer.default_root_dir={tmp_path / 'run'}", "--ckpt_path=last"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert f"--ckpt_path last: no checkpoint in {tmp_path / 'run' / 'checkpoints'}. Give a .ckpt file" in err, err
    assert not (tmp_path / "run").exists()  # no log folder, no run lock left behind


def test_a_refused_resume_keeps_the_config_that_wrote_the_checkpoint_which_then_resumes(root):
    version = fit(root, "kept") / "lightning_logs/version_0"
    original = (version / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"written by another run \(group_size: 16 in the checkpoint, 4 now\)"):
        fit(root, "kept", "--model.group_size=4", "--ckpt_path=last", "--trainer.max_steps=4")
    assert (version / "config.yaml").read_text() == original  # the message sends the user to it
    assert [p.name for p in version.glob("config*")] == ["config.yaml"]  # the refused attempt left nothing
    main(["fit", f"--config={version / 'config.yaml'}", "--ckpt_path=last", "--trainer.max_steps=4"])
    assert (version / "config.yaml").read_text() == original
    resumed = (version / "config-2.yaml").read_text()
    assert "max_steps: 4" in resumed and "max_steps: 2" in original


@pytest.mark.parametrize("number", [errno.EROFS, errno.ENOSPC])
def test_a_folder_that_cannot_be_written_is_one_line_naming_it(monkeypatch, capsys, number):
    """A read-only mount or a full disk, as the loggers meet it when the run starts (root ignores permissions, so
    the error is raised where the real one would be)."""
    import gpo.cli

    def refuse(args):
        raise OSError(number, os.strerror(number), "/mnt/runs/lightning_logs")

    monkeypatch.setattr(gpo.cli, "main", refuse)
    with pytest.raises(SystemExit) as stopped:
        run(["fit", "--config", "quickstart"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert f"gpo fit: error: [Errno {number}] {os.strerror(number)}: '/mnt/runs/lightning_logs'" in err


def test_a_fresh_run_in_an_earlier_runs_folder_is_refused_before_the_model_loads(root):
    """The refusal came when the fit started, after the model had loaded (a minute for a large one) and its summary
    was printed; with gpo's own checkpoints it comes first: a policy folder that does not exist is not reached."""
    fit(root, "earlier")
    with pytest.raises(FileExistsError, match=r"earlier/checkpoints/last\.ckpt holds an earlier run's checkpoint"):
        fit(root, "earlier", f"--model.policy={root / 'nowhere'}")
    with pytest.raises(FileNotFoundError):  # resumed: the model is loaded, and missing
        fit(root, "earlier", f"--model.policy={root / 'nowhere'}", "--ckpt_path=last")
    assert sorted(p.name for p in (root / "earlier" / "lightning_logs").iterdir()) == ["version_0"]


def test_a_refused_fresh_run_in_a_fixed_log_folder_leaves_the_earlier_runs_config(root):
    """Without the default loggers the log folder is the run folder itself: a second fresh run there is refused (an
    earlier run's checkpoint), and the config.yaml that wrote that checkpoint stays as it was."""
    folder = fit(root, "fixed", "--trainer.logger=false")
    original = (folder / "config.yaml").read_text()
    with pytest.raises(FileExistsError, match=r"holds an earlier run's checkpoint"):
        fit(root, "fixed", "--trainer.logger=false", "--model.optim.lr=0.02")
    assert (folder / "config.yaml").read_text() == original
    assert sorted(p.name for p in folder.glob("config*")) == ["config.yaml"]

"""What the ``gpo`` command shows and finds: the command list, ``gpo fit --help`` focused on gpo's settings with
Lightning's one flag away, shipped configs by name, short errors, and the step-counting progress bar."""

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import TQDMProgressBar

from gpo.algo import presets
from gpo.callbacks import StepProgressBar
from gpo.cli import COMMANDS, SUBCOMMANDS, main, run
from gpo.cli.helptext import ENGINES
from gpo.cli.shipped import shipped_configs, with_shipped_configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL_COMMANDS = [*SUBCOMMANDS, *COMMANDS]


@pytest.fixture(scope="module")
def fit_help() -> str:
    return help_text("fit", "--help")


def help_text(*args: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 0
    return out.getvalue()


# ---- gpo --help ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["-h"], []], ids=["--help", "-h", "nothing"])
def test_gpo_help_lists_every_command_with_one_line(capsys, args):
    main(args)
    lines = capsys.readouterr().out.splitlines()
    for name in ALL_COMMANDS:
        assert sum(line.split()[:1] == [name] for line in lines) == 1, (name, lines)
    assert set(ALL_COMMANDS) == {"fit", "validate", "tiny", "plot", "export"}


@pytest.mark.parametrize("args", [["--help"], ["tiny", "--help"], ["plot", "--help"], ["export", "--help"]])
def test_help_answers_without_importing_lightning_or_torch(args):
    """The first things a user runs must not wait for Lightning's and torch's imports (about 4-6 s)."""
    import subprocess
    import sys

    script = (
        f"import sys\nfrom gpo.cli import run\ntry:\n    run({args!r})\n"
        "finally:\n    print(sorted({'lightning', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and done.stdout.splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("name", ["validate", "tiny", "plot", "export"])
def test_every_listed_command_has_its_own_help(name):
    assert "usage:" in help_text(name, "--help")


def test_an_unknown_command_is_refused_with_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["fitt", "--config", "quickstart"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown command 'fitt'; did you mean fit?" in err, err
    assert err.endswith("did you mean fit?\n(GPO_TRACEBACK=1 shows the traceback; gpo --help lists the commands)\n"), (
        err
    )
    with pytest.raises(SystemExit):
        run(["test"])  # Lightning's test and predict are not offered: GPOModule has no test or predict step
    assert "unknown command 'test'" in capsys.readouterr().err


# ---- gpo fit --help --------------------------------------------------------------------------------------------


def test_fit_help_shows_gpos_settings_before_the_trainers(fit_help):
    for flag in ("--config", "--export", "--model.policy", "--model.algorithm", "--data.path", "--ckpt_path"):
        assert flag in fit_help, flag
    assert fit_help.index("--model.policy") < fit_help.index("--data.path") < fit_help.index("--trainer.max_steps")
    assert fit_help.index("--ckpt_path") < fit_help.index("--trainer.max_steps")
    assert "--trainer.barebones" not in fit_help and "--trainer.sync_batchnorm" not in fit_help
    assert "the name of a config shipped with gpo" in fit_help


def test_ckpt_path_and_export_are_described_as_each_command_uses_them(fit_help):
    def flat(text: str) -> str:
        return " ".join(text.split())

    validate_help = flat(help_text("validate", "--help"))
    assert "--ckpt_path CKPT_PATH continue a run: last (trainer.default_root_dir/checkpoints/last.ckpt; a run" in flat(
        fit_help
    )
    assert "--ckpt_path CKPT_PATH evaluate a checkpoint: last" in validate_help
    assert "hpc" not in flat(fit_help) + validate_help  # Lightning's text, for a checkpoint gpo never writes
    assert "--trainer.precision PRECISION what gpo trains with: 32-true (the default), bf16-mixed" in flat(fit_help)
    assert "gpo fit: save the policy to <log dir>/export when training ends" in validate_help


@pytest.mark.parametrize("name", ["tiny", "plot", "export"])
def test_the_small_commands_help_is_plain_text_with_every_option_described(name):
    text = help_text(name, "--help")
    assert "``" not in text and f"gpo {name} " in text, text
    options = text[text.index("options:") :].splitlines()[2:]  # after -h
    for line, after in zip(options, [*options[1:], ""], strict=True):
        if line.strip().startswith("--") and len(line.split()) <= 2:  # the flag alone: its text on the next line
            assert after.strip() and not after.strip().startswith("--"), (line, text)


def test_gpo_tiny_refuses_no_training_prompts_before_writing_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["tiny", str(tmp_path / "assets"), "--examples", "0"])
    assert refused.value.code == 2 and "--examples 0: write at least 1 training prompt" in capsys.readouterr().err
    assert not (tmp_path / "assets").exists()


def test_gpo_version_and_python_m_gpo(capsys):
    import subprocess
    import sys
    from importlib import metadata

    from gpo.cli import main

    main(["--version"])
    assert capsys.readouterr().out == f"gpo {metadata.version('gpo')}\n"
    done = subprocess.run([sys.executable, "-m", "gpo", "-V"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"gpo {metadata.version('gpo')}\n"), done.stderr


def test_ctrl_c_outside_a_fit_stops_with_one_line_and_130(monkeypatch, capsys):
    """While libraries import or a model loads; it printed a traceback of some 80 lines from the imports."""
    import gpo.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(gpo.cli.COMMANDS, "tiny", (interrupted, "..."))
    with pytest.raises(SystemExit) as stopped:
        gpo.cli.run(["tiny", "out"])
    assert stopped.value.code == 130 and capsys.readouterr().err == "\ngpo tiny: stopped (Ctrl-C)\n"


def test_fit_help_says_how_to_reach_everything_it_does_not_show(fit_help):
    assert "gpo fit --help-all" in fit_help
    for group in ("optim", "evaluation", "lora", "kl", "reward_errors", "engine", "algorithm"):
        assert f"--model.{group}.help" in fit_help, group
    for loaded in ("policy", "tokenizer"):  # jsonargparse's account of a transformers class: nothing one sets
        assert f"--model.{loaded}.help" not in fit_help, loaded
    for name in presets.ALGORITHMS:
        assert name in fit_help, name
    for cls in ("Custom", "GRPO", "DAPO", "CISPO", "GSPO", "RSPO", "DrGRPO", "ReinforcePP", "MaxRL", "DRO"):
        assert f" {cls}," in fit_help or f" {cls}." in fit_help, cls
    for name in shipped_configs():
        assert name in fit_help, name


def test_help_all_is_lightnings_full_help(fit_help):
    full = help_text("fit", "--help-all")
    assert "--trainer.barebones" in full and "--trainer.sync_batchnorm" in full
    assert len(full.splitlines()) > len(fit_help.splitlines())


def test_nested_settings_have_their_own_help():
    assert "--model.optim.lr" in help_text("fit", "--model.optim.help")
    assert "--model.algorithm.clip_high" in help_text("fit", "--model.algorithm.help", "DAPO")


@pytest.mark.parametrize("name", ["DuplicatePenalty", "gpo.rewards.DuplicatePenalty"])
def test_a_reward_class_has_its_settings_help_as_a_part_has(name, fit_help):
    printed = help_text("fit", "--model.rewards.help", name)
    assert "Help for --model.rewards.help=gpo.rewards.shaping.DuplicatePenalty" in printed, printed
    assert "--model.rewards.penalty PENALTY" in printed and "default: -1.0" in printed, printed
    assert "CONFIG" not in printed and "--help" not in printed, printed  # the class's settings alone
    assert "--model.rewards.help" in fit_help[fit_help.index("Nested settings") :]


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("JudgeRewad", "did you mean JudgeReward? gpo.rewards has the classes DuplicatePenalty, JudgeReward,"),
        ("exact_match", "exact_match is a function, which takes no settings"),
        ("nosuchmodule.Bonus", "No module named 'nosuchmodule'; gpo.rewards has the classes"),
    ],
)
def test_reward_help_for_a_name_that_is_no_reward_class_says_which_are(capsys, name, said):
    err = fit_error(capsys, "--model.rewards.help", name)
    assert err.startswith(f"gpo fit: error: --model.rewards.help {name}: ") and said in err, err
    assert "JudgeError" not in err and "ServedReward" not in err, err  # an exception and an abstract base: no rewards


@pytest.mark.parametrize(
    ("part", "example", "listed"),
    [
        ("engine", "--model.engine.help HFEngine", "gpo.rollout.vllm_server.VLLMServerEngine"),
        ("mixer", "--model.mixer.help EnvEventOutcomeBlend", "GroupNormalizedSum, WeightedSum"),
        ("algorithm", "--model.algorithm.help CISPO", "DAPO, DPPO, DRO, GMPO"),
        ("masks", "--model.masks.help HighEntropyMask", "MismatchBandMask, OffPolicySequenceMask"),
        ("token_weights", "--model.token_weights.help OverlongFilter", "OverlongFilter, ReferenceProbWeight"),
        ("teacher", "--model.teacher.help LocalTeacher", "gpo.models.teacher.ServerTeacher"),
        ("path", "--data.path.help Arithmetic", "gpo.tasks.Arithmetic"),
    ],
)
def test_a_part_help_without_a_class_lists_the_classes_instead_of_an_empty_help(capsys, part, example, listed):
    setting = "data.path" if part == "path" else f"model.{part}"

    def listing(*args):
        with pytest.raises(SystemExit) as exit_info:
            run(["fit", "--config", "quickstart", f"--{setting}.help", *args])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0, out  # a help request, not an error
        return out

    out = listing()
    assert out.startswith(f"The {setting} classes gpo ships: ") and listed in out, out
    assert f"--{setting}.help takes one of them, as in gpo fit {example}\n" in out, out
    assert "RewardMixer" not in out and "RolloutEngine" not in out, out  # the abstract bases are not offered
    assert listing("--trainer.max_steps", "3") == out  # an option is no class


def test_the_engines_a_help_request_lists_are_every_engine_gpo_ships():
    import gpo.rollout
    from gpo.rollout.base import RolloutEngine

    internal = {"gpo.rollout.worker.ProcessEngine", "gpo.rollout.pipeline.QueuedEngine"}  # made by gpo, not given
    shipped = set()
    for module_info in pkgutil.iter_modules(gpo.rollout.__path__, "gpo.rollout."):
        module = importlib.import_module(module_info.name)
        for name, member in vars(module).items():
            concrete = inspect.isclass(member) and issubclass(member, RolloutEngine) and not inspect.isabstract(member)
            if concrete and member.__module__ == module.__name__:
                shipped.add(f"{module.__name__}.{name}")
    listed = set()
    for path in ENGINES:
        module, _, name = path.rpartition(".")
        engine = getattr(importlib.import_module(module), name)  # gpo.rollout's own names are imported on first use
        listed.add(f"{engine.__module__}.{engine.__name__}")
    assert listed == shipped - internal, (listed, shipped)


def test_lightnings_optimizer_flags_are_not_offered_and_point_to_model_optim(fit_help, capsys):
    assert "--optimizer" not in fit_help and "--lr_scheduler" not in fit_help
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", "quickstart", "--optimizer", "SGD"])
    err = capsys.readouterr().err
    message = err[err.index("gpo fit: error: ") :]
    assert exit_info.value.code == 2 and "the optimiser is AdamW, set by model.optim (lr" in message, err
    assert len(message.splitlines()) <= 4, err


# ---- shipped configs -------------------------------------------------------------------------------------------


def test_every_yaml_in_configs_is_shipped_with_the_package():
    shipped = shipped_configs()
    assert list(shipped) == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert shipped["quickstart"].read_text() == (CONFIGS / "quickstart.yaml").read_text()


def test_config_finds_a_shipped_config_by_name_unless_a_local_file_has_it(tmp_path):
    shipped = shipped_configs()
    args = ["fit", "--config", "quickstart", "-c", "dapo.yaml", "--config=rloo", "--model.group_size=4"]
    assert with_shipped_configs(args) == [
        "fit", "--config", str(shipped["quickstart"]), "-c", str(shipped["dapo"]), f"--config={shipped['rloo']}",
        "--model.group_size=4",
    ]  # fmt: skip
    (tmp_path / "dapo.yaml").write_text("model: {group_size: 4}\n")  # the working directory (tests/conftest.py)
    assert with_shipped_configs(["--config", "dapo.yaml"]) == ["--config", "dapo.yaml"]
    inline = '{"model": {"group_size": 4}}'
    assert with_shipped_configs(["--config", inline]) == ["--config", inline]
    with pytest.raises(FileNotFoundError, match=r"^--config no_such_folder/quickstart.yaml: no such file"):
        with_shipped_configs(["--config", "no_such_folder/quickstart.yaml"])  # a path is never a shipped name


def test_fit_reads_a_shipped_config_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "quickstart", "--config", "rloo", "--print_config"])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0 and "gpo.rewards.positional_match" in printed and "RLOO" in printed, printed


def test_print_config_keeps_the_trainer_settings_the_focused_help_leaves_out(capsys):
    """The focused help hides most trainer settings; a printed (or saved) config must still hold every one of them,
    or a run made again from it would lose its callbacks and validation schedule."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "quickstart", "--config", "callbacks", "--print_config"])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0, printed
    assert "check_val_every_n_epoch: null" in printed and "gradient_clip_val:" in printed, printed
    assert "class_path: gpo.callbacks.DynamicSampling" in printed, printed


def test_a_config_name_that_is_neither_a_file_nor_shipped_lists_the_shipped_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", "quickstrat"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "--config quickstrat: no such file here, and gpo ships no config of that name" in err, err
    assert "did you mean quickstart?" in err and "adaptive_entropy, callbacks, cispo, dapo" in err, err
    with pytest.raises(SystemExit):
        run(["fit", "--config", "zzz"])
    assert "did you mean" not in capsys.readouterr().err  # no guess when nothing is close


# ---- misspelt keys in a YAML file ------------------------------------------------------------------------------


def test_a_misspelt_nested_key_in_a_yaml_file_is_named_with_its_file_and_the_closest_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  engine:\n    init_args:\n      sampling:\n        max_new_token: 4\n")
    with pytest.raises(SystemExit):
        run(["fit", "--config", "quickstart", "--config", str(bad)])
    err = capsys.readouterr().err
    assert "model.engine.init_args.sampling (Sampling) has no setting 'max_new_token'" in err, err
    assert f"(set in {bad})" in err and "did you mean model.engine.init_args.sampling.max_new_tokens?" in err, err


# ---- wrong values, broken files and missing settings: the key, the file, the fix --------------------------------


def fit_error(capsys, *args: str) -> str:
    """What ``gpo fit --config quickstart ARGS`` prints when it is refused at parsing (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", "quickstart", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err[err.index("gpo fit: error: ") :]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("trainer:\n  max_step: 5\n", "unknown setting trainer.max_step\n(set in {})\ndid you mean trainer.max_steps?"),
        ("seed_everthing: 1\n", "unknown setting seed_everthing\n(set in {})\ndid you mean seed_everything?"),
        # an empty mapping: jsonargparse alone drops the key without a word
        ("trainer:\n  foo: {{}}\n", "unknown setting trainer.foo\n(set in {})\ntrainer takes: accelerator"),
        # a name that begins a setting's (max_step, max_steps) is still not that setting
        ("trainer:\n  max_step: {{}}\n", "unknown setting trainer.max_step\n(set in {})\ndid you mean trainer.max_"),
        ("foo: {{a: {{}}}}\n", "unknown setting foo\n(set in {})\nthe top-level settings are model"),
        ("model:\n  algorithm:\n    class_path: CISPO\n    init_args:\n      ppo_clip: {{}}\n",
         "model.algorithm (CISPO) has no setting 'ppo_clip'\n(set in {})\nmodel.algorithm takes: clip_low"),
        ("model:\n  engine:\n    init_args:\n      sampling: {{top_n: {{}}}}\n",
         "model.engine.init_args.sampling (Sampling) has no setting 'top_n'\n(set in {})"),
    ],
    ids=["misspelt_in_group", "misspelt_top_level", "empty_in_group", "empty_misspelt_in_group", "empty_top_level",
         "empty_preset_setting", "empty_nested_class_setting"],
)  # fmt: skip
@pytest.mark.parametrize("printed", [False, True], ids=["fit", "print_config"])  # jsonargparse words them apart
def test_an_unknown_key_in_a_config_file_is_named_in_full_with_its_file(tmp_path, capsys, content, says, printed):
    config = tmp_path / "mine.yaml"
    config.write_text(content.format())
    err = fit_error(capsys, "--config", str(config), *(["--print_config"] if printed else []))
    assert err.startswith("gpo fit: error: " + says.format(config)), err


def test_an_empty_mapping_in_a_group_given_whole_as_a_flag_is_refused_under_that_group(capsys):
    # jsonargparse reads --data={...} on its own, under the key data: the unknown key is data.trainer, not the
    # top-level group trainer
    err = fit_error(capsys, "--data={trainer: {}}", "--print_config")
    assert err.startswith("gpo fit: error: unknown setting data.trainer\n"), err


def test_a_known_setting_given_as_an_empty_mapping_keeps_its_defaults(capsys):
    # the refusal of an unknown `key: {}` leaves a known one alone: GRPO's PPO clip with its default range
    from gpo.cli.parser import unknown_empty_settings

    cfg = {"ppo_clip": {}, "kl": {"beta": {}}, "foo": {"bar": {}}, "baz": {"qux": 1}, "empty": {}}
    found = unknown_empty_settings(cfg, {"ppo_clip", "kl.beta", "baz.x"}, set())
    assert [name for _, name in found] == ["foo", "empty"]
    assert [name for _, name in unknown_empty_settings({"model": {"x": {}}}, {"model", "model.a"}, {"model"})] == ["x"]
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", "quickstart", "--model.algorithm=GRPO", "--model.algorithm.ppo_clip={}",
             "--print_config"])  # fmt: skip
    printed = yaml.safe_load(capsys.readouterr().out)
    assert exit_info.value.code == 0
    ppo_clip = printed["model"]["algorithm"]["init_args"]["ppo_clip"]
    assert ppo_clip == {"clip_low": 0.4, "clip_high": 0.5, "dual_clip": None}


def test_a_wrong_value_in_a_class_given_inline_is_named_as_in_yaml_not_as_a_missing_file(tmp_path, capsys):
    inline = "{class_path: gpo.callbacks.DifficultyFilter, init_args: {window: 2.5}}"
    err = fit_error(capsys, f"--trainer.callbacks+={inline}")
    assert err.startswith("gpo fit: error: trainer.callbacks.window: Expected a int. Got value: 2.5\n"), err
    config = tmp_path / "callbacks.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: gpo.callbacks.DifficultyFilter\n      init_args: "
                      "{window: 2.5}\n")  # fmt: skip
    assert fit_error(capsys, "--config", str(config)).startswith(err.splitlines()[0]), err


def test_a_wrong_value_names_the_key_the_expected_type_and_its_file(tmp_path, capsys):
    bad = tmp_path / "fast.yaml"
    bad.write_text("model:\n  optim:\n    lr: fast\n")
    err = fit_error(capsys, "--config", str(bad))
    assert err.startswith(f"gpo fit: error: model.optim.lr: Expected a float. Got value: fast\n(set in {bad})\n"), err
    err = fit_error(capsys, "--model.optim.lr", "fast")  # quickstart.yaml sets lr too, but not to this value
    assert err.startswith("gpo fit: error: model.optim.lr: Expected a float. Got value: fast\n(GPO_TRACEBACK"), err
    err = fit_error(capsys, "--model.optim", "fast")  # a union: "Given value"; quickstart.yaml sets another
    assert err.startswith("gpo fit: error: model.optim: ") and "(set in" not in err, err
    err = fit_error(capsys, "--model.engine.sampling.temperature", "hot")
    assert err.startswith("gpo fit: error: model.engine.sampling.temperature: Expected a float. Got value: hot"), err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("model:\n  group_size: [4\n", "is not valid YAML: while parsing a flow sequence at line 2, column 15: "
         "expected ',' or ']', but got '<stream end>' at line 3, column 1."),
        ("model:\n\tgroup_size: 4\n", "is not valid YAML: while scanning for the next token: found character '\\t' "
         "that cannot start any token at line 2, column 1."),
        ("model:\n  group_size: 4\x1b[0m\n", "is not valid YAML: character #x001b at position 23: special "
         "characters are not allowed."),
    ],
    ids=["unclosed", "tab", "control_character"],
)  # fmt: skip
def test_a_config_that_is_not_yaml_is_named_with_the_line(tmp_path, capsys, content, says):
    bad = tmp_path / "broken.yaml"
    bad.write_text(content)
    assert fit_error(capsys, "--config", str(bad)).startswith(f"gpo fit: error: {bad} {says}\n")


def test_a_misspelt_group_a_missing_config_and_an_abbreviated_key_are_refused_with_the_fix(tmp_path, capsys):
    bad = tmp_path / "top.yaml"
    bad.write_text("modle:\n  group_size: 4\n")
    err = fit_error(capsys, "--config", str(bad))
    assert "unknown setting modle.group_size\n" in err and "did you mean model.group_size?" in err, err
    err = fit_error(capsys, "--trainer.max_step", "5")  # argparse would take it for --trainer.max_steps
    assert "unknown setting trainer.max_step\ndid you mean trainer.max_steps?" in err, err
    err = fit_error(capsys, "--config", str(CONFIGS / "quickstrat.yaml"))
    assert f"--config {CONFIGS / 'quickstrat.yaml'}: no such file; did you mean {CONFIGS / 'quickstart.yaml'}?" in err
    err = fit_error(capsys, "--config", str(tmp_path / "nowhere" / "x.yaml"))
    assert f"no such file (no folder {tmp_path / 'nowhere'}); a shipped config can also be given by name" in err, err
    with pytest.raises(SystemExit):
        run(["fit"])
    err = capsys.readouterr().err
    assert "gpo fit: error: model.policy is not set: give a config (--config quickstart, or a YAML file)" in err, err
    null = tmp_path / "null.yaml"
    null.write_text("model:\n  policy: null\n")
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(null)])
    err = capsys.readouterr().err
    assert f"model.policy is null in {null}: give it a value there or with --model.policy VALUE" in err, err


def test_a_config_path_that_exists_in_another_form_is_read(tmp_path, monkeypatch):
    """``~`` left unexpanded by the shell (``--config=~/x.yaml``) and a pipe (``--config <(...)``) are files to
    jsonargparse: gpo passes them on rather than refusing them as missing."""
    import os

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.yaml").write_text("model: {group_size: 4}\n")
    assert with_shipped_configs(["--config=~/mine.yaml"]) == ["--config=~/mine.yaml"]
    read, write = os.pipe()
    try:
        pipe = f"/dev/fd/{read}"
        assert with_shipped_configs(["--config", pipe]) == ["--config", pipe]
    finally:
        os.close(read)
        os.close(write)


def test_a_preset_name_with_settings_or_a_misspelt_preset_class_says_what_to_write(tmp_path, capsys):
    err = fit_error(capsys, "--model.algorithm", "dapo", "--model.algorithm.clip_high=0.3")
    says = "dapo is a preset by name, with its defaults; to change a setting choose its class: --model.algorithm DAPO "
    assert says + "--model.algorithm.clip_high VALUE (or class_path: DAPO in YAML)." in err, err
    bad = tmp_path / "class.yaml"
    bad.write_text("model:\n  algorithm:\n    class_path: DAPOO\n")
    err = fit_error(capsys, "--config", str(bad))
    assert f"Expected a dot import path string: DAPOO\n(set in {bad})\ndid you mean DAPO?" in err, err


def test_a_part_set_on_a_preset_points_to_custom_not_to_the_preset_class(capsys):
    # the preset class has no gate setting either: following "choose its class" would fail a second time
    err = fit_error(capsys, "--model.algorithm.gate=gpo.algo.ClipGate")
    assert "compose the parts: --model.algorithm Custom --model.algorithm.gate VALUE" in err, err
    assert "--model.algorithm GRPO" not in err, err


@pytest.mark.parametrize("key", ["masks", "token_weights"])
def test_one_part_given_to_a_list_setting_says_how_to_give_a_list(capsys, key):
    path = "gpo.algo.HighEntropyMask" if key == "masks" else "gpo.algo.OverlongFilter"
    err = fit_error(capsys, f"--model.{key}={path}")
    assert f"model.{key} takes a list of parts: --model.{key}+={path} (once per part), or [{path}] in YAML." in err
    assert "does not take" not in err, err


def test_an_error_in_an_environments_settings_adds_no_line_about_the_other_union_member(capsys):
    # env takes an Environment or an Episodes: the Episodes branch's refusal of NumberGuess is no news
    err = fit_error(capsys, "--model.engine=gpo.rollout.MultiTurnEngine", "--model.engine.env=gpo.envs.NumberGuess",
                    "--model.engine.env.high=x")  # fmt: skip
    assert "model.engine.env.high: Expected a int. Got value: x" in err and "does not take" not in err, err


@pytest.mark.parametrize(
    "args",
    [
        ("--model.algorithm=Custom", "--model.algorithm.gate=nosuchmodule.Gate"),
        ("--model.rewards+=nosuchmodule.bonus",),
    ],
    ids=["class", "function"],
)
def test_a_module_of_ones_own_not_found_says_where_modules_are_imported_from(capsys, args):
    err = fit_error(capsys, *args)
    assert f"imported from the working directory ({Path.cwd()}) and PYTHONPATH" in err, err
    assert "run from the folder that holds nosuchmodule.py" in err, err


def test_reward_settings_without_their_class_get_no_module_advice(tmp_path, capsys):
    classless = tmp_path / "classless.yaml"
    classless.write_text("model:\n  rewards:\n    - init_args: {penalty: -0.5}\n")
    err = fit_error(capsys, "--config", str(classless))
    assert "Dict must include a class_path" in err and "import path" not in err, err


def test_a_misplaced_part_given_as_flags_gets_the_slot_it_belongs_in(capsys):
    """What gpo.algo.presets.preset advises for the same class given inline (which the parser takes as a name)."""
    err = fit_error(capsys, "--model.algorithm", "Custom", "--model.algorithm.gate", "gpo.algo.GroupNormAdvantage")
    assert "did you mean model.algorithm.advantage?" in err, err


def test_a_preset_class_without_its_required_setting_names_the_flag(capsys):
    for preset, setting in [("DRO", "beta"), ("DPPO", "threshold")]:  # each preset's own config, not every one's
        err = fit_error(capsys, "--model.algorithm", preset)
        assert f"the following arguments are required: {setting}" in err, err
        config = f"--config {preset.lower()}"
        assert f"give --model.algorithm.{setting} VALUE, or start from the preset's shipped config ({config}).\n" in err
    err = fit_error(capsys, "--model.algorithm", "Custom", "--model.algorithm.gate", "DROGate")  # a part's setting
    assert "give --model.algorithm.gate.beta VALUE.\n" in err, err


CUSTOM_PART = """model:
  algorithm:
    class_path: Custom
    init_args:
      {slot}:
        class_path: {path}
"""


@pytest.mark.parametrize(
    ("slot", "path", "instead"),
    [
        ("advantage", "gpo.algo.ClipGate", "ClipGate is a gpo RatioGate, which this setting does not take; did you "
         "mean model.algorithm.gate?"),
        ("aggregator", "gpo.algo.GroupNormAdvantage", "GroupNormAdvantage is a gpo AdvantageEstimator, which this "
         "setting does not take; did you mean model.algorithm.advantage?"),
    ],
    ids=["gate_as_advantage", "advantage_as_aggregator"],
)  # fmt: skip
def test_a_part_in_another_parts_slot_names_the_slot_that_takes_it(tmp_path, capsys, slot, path, instead):
    """As ``Custom(advantage=ClipGate())`` says in Python, whether the part is given in a YAML file or by a flag."""
    bad = tmp_path / "slot.yaml"
    bad.write_text(CUSTOM_PART.format(slot=slot, path=path))
    err = fit_error(capsys, "--config", str(bad))
    assert f"(set in {bad})\n{instead}\n" in err and len(err.splitlines()) <= 4, err
    err = fit_error(capsys, "--model.algorithm", "Custom", f"--model.algorithm.{slot}", path)
    assert f"\n{instead}\n" in err and len(err.splitlines()) <= 4, err


MY_PARTS = """from gpo.algo import AdvantageEstimator


class LOOMedianAdvantage(AdvantageEstimator):
    def __call__(self, reward, group, mask):
        return (reward - reward.median())[:, None] * mask
"""


@pytest.mark.parametrize(
    ("slot", "path", "guess"),
    [
        ("gate", "gpo.algo.ClipGat", "did you mean gpo.algo.ClipGate?"),
        ("advantage", "my_misspelt_parts.LOOMedianAdvantag", "did you mean my_misspelt_parts.LOOMedianAdvantage?"),
    ],
    ids=["gpo", "own_module"],
)
@pytest.mark.parametrize("init_args", ["", "        init_args: {}\n"], ids=["class_path", "with_init_args"])
def test_a_misspelt_class_path_gets_the_closest_class_of_its_module(tmp_path, capsys, monkeypatch, slot, path, guess,
                                                                    init_args):  # fmt: skip
    monkeypatch.setattr("sys.path", list(sys.path))  # gpo.cli.run adds the working directory
    (tmp_path / "my_misspelt_parts.py").write_text(MY_PARTS)
    bad = tmp_path / "misspelt.yaml"
    bad.write_text(CUSTOM_PART.format(slot=slot, path=path) + init_args)
    err = fit_error(capsys, "--config", str(bad))
    assert f"(set in {bad})\n{guess}\n" in err and len(err.splitlines()) <= 4, err
    err = fit_error(capsys, "--model.algorithm", "Custom", f"--model.algorithm.{slot}", path)
    assert f"\n{guess}\n" in err, err


def test_a_misspelt_reward_is_one_line_with_the_closest_function_of_its_module(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.path", list(sys.path))  # gpo.cli.run adds the working directory
    (tmp_path / "my_misspelt_rewards.py").write_text("def sorted_prefix(prompts, completions, **_):\n    return []\n")
    says = (
        "gpo fit: error: model.rewards: my_misspelt_rewards.sorted_prefx: module 'my_misspelt_rewards' has no "
        "attribute 'sorted_prefx'; did you mean my_misspelt_rewards.sorted_prefix?\n"
    )
    err = fit_error(capsys, "--model.rewards", "[my_misspelt_rewards.sorted_prefx]")
    assert err.startswith(says + "(GPO_TRACEBACK"), err
    bad = tmp_path / "rewards.yaml"
    bad.write_text("model:\n  rewards:\n    - my_misspelt_rewards.sorted_prefx\n")
    err = fit_error(capsys, "--config", str(bad))
    assert err.startswith(f"{says}(set in {bad})\n(GPO_TRACEBACK"), err


def test_usage_names_the_gpo_command_however_it_was_started():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gpo.cli", "fit", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: gpo [options] fit "), done.stdout[:300]


# ---- progress bar ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "bar"),
    [
        pytest.param((), StepProgressBar, id="default"),
        pytest.param(("--trainer.callbacks=lightning.pytorch.callbacks.TQDMProgressBar",), TQDMProgressBar, id="own"),
        pytest.param(("--trainer.enable_progress_bar=false",), type(None), id="off"),
    ],
)
def test_fit_counts_optimiser_steps_in_its_progress_bar_unless_told_otherwise(tiny_assets, tmp_path, extra, bar):
    from gpo.cli import GPOCLI
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    model, data = tiny_assets
    args = ["--config", str(CONFIGS / "quickstart.yaml"), f"--model.policy={model}", f"--data.path={data}"]
    args += ["--data.val_path=null", f"--trainer.default_root_dir={tmp_path}", *extra]
    cli = GPOCLI(GPOModule, PromptDataModule, args=args, run=False)
    assert type(cli.trainer.progress_bar_callback) is bar


@pytest.mark.parametrize("given", [None, "true", "7"])
def test_seed_everything_true_draws_a_seed_and_says_which_and_the_default_is_0(tiny_assets, tmp_path, given, capsys):
    """Lightning's help promised a random seed for true, and its seed_everything set 0 (with a warning, also for a
    config without a seed); gpo draws one, prints it and records it in the run's settings."""
    import os
    import warnings

    from gpo.cli import GPOCLI
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    model, data = tiny_assets
    config = tmp_path / "no_seed.yaml"
    config.write_text(f"model:\n  policy: {model}\n  rewards: [gpo.rewards.positional_match]\ndata:\n  path: {data}\n")
    args = ["--config", str(config), "--data.val_path=null", f"--trainer.default_root_dir={tmp_path}"]
    args += [] if given is None else [f"--seed_everything={given}"]
    drawn = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cli = GPOCLI(GPOModule, PromptDataModule, args=args, run=False)
            drawn.append(cli.config["seed_everything"])
            assert os.environ["PL_GLOBAL_SEED"] == str(drawn[-1])  # what seeds the run
    said = capsys.readouterr().err
    if given == "true":
        assert drawn[0] != drawn[1] and all(isinstance(seed, int) for seed in drawn)
        assert f"seed_everything: true drew the seed {drawn[0]} (recorded in the run's config.yaml" in said
    else:
        assert drawn == [int(given or 0)] * 2 and "drew the seed" not in said
    assert not [w for w in caught if "No seed found" in str(w.message)]


def test_seed_everythings_help_says_what_true_does(fit_help):
    assert "true draws one at random (printed, and recorded in the run's config.yaml)" in " ".join(fit_help.split())

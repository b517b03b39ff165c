"""Every bad configuration fails before any sampling, with a message that names the field and the fix.

Each case is one override on top of a good tiny config, run through ``gpo fit`` (or the Python API where a case
needs a Python object); ``HFEngine.generate`` is made to fail the test if it is ever reached.
"""

import json
from dataclasses import dataclass

import lightning as L
import pytest
import torch
import yaml

from gpo.algo import DAPO, ClipGate
from gpo.cli import main, run
from gpo.rewards import RegexFormat, positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.testing import char_tokenizer, save_tiny_model, tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.preflight import check_precision

CONTEXT = 256  # max_position_embeddings of gpo.testing's tiny models


@dataclass(frozen=True)
class Bad:
    """An override, the error it must raise, and two pieces of its message: the field and the fix."""

    args: tuple[str, ...]
    error: type[BaseException]
    field: str
    fix: str


def bad(case_id: str, *args: str, error: type[BaseException] = ValueError, field: str, fix: str):
    return pytest.param(Bad(args, error, field, fix), id=case_id)


def rows(*prompts, **columns):
    return [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]


def tokenizer_without_eos():
    """A pad token but no EOS: no completion could end (the pad token cannot stand in for EOS)."""
    tokenizer = char_tokenizer()
    tokenizer.eos_token = None
    assert tokenizer.pad_token_id is not None
    return tokenizer


def tokenizer_larger_than_the_embedding():
    tokenizer = char_tokenizer()
    tokenizer.add_tokens(["<extra_0>", "<extra_1>"])
    return tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_configs")
    save_tiny_model(root / "model")
    tiny_model().save_pretrained(root / "bare")  # a model folder without tokenizer files
    tokenizer_without_eos().save_pretrained(root / "no_eos")
    files = {
        "train": rows("312=", "51=", "907=", "24=", answer=["123", "15", "079", "24"]),
        "no_answer": rows("312=", "51=", x=[1, 2]),
        "long": rows("9" * 300, answer=["9"]),
        "empty": [],
        "null_prompt": rows("12=", None, answer=["12", "0"]),
        "question": [{"question": "12=", "answer": "12"}],
    }
    for name, records in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    good = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {
            "policy": str(root / "model"),
            "rewards": ["gpo.rewards.positional_match"],
            "group_size": 2,
            "engine": {"class_path": "gpo.rollout.HFEngine", "init_args": {"sampling": {"max_new_tokens": 4}}},
        },
        "data": {"path": str(root / "train.jsonl"), "prompts_per_step": 2},
        "export": "none",
    }
    (root / "good.yaml").write_text(yaml.safe_dump(good))
    return root


@pytest.fixture(autouse=True)
def no_sampling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("HFEngine.generate ran: the configuration was not refused before sampling")

    monkeypatch.setattr(HFEngine, "generate", refuse)


def fit(root, *args: str) -> None:
    main(["fit", f"--config={root / 'good.yaml'}", *(arg.format(root=root) for arg in args)])


def test_the_good_config_reaches_sampling(root):
    # Without an override the run gets as far as the first generate call, which the fixture refuses: every failure
    # below is caused by its override, and happens before sampling.
    with pytest.raises(AssertionError, match=r"HFEngine\.generate ran"):
        fit(root)


def test_an_engine_with_its_own_weights_and_no_weight_sync_warns_when_training_starts(caplog):
    """A vLLM engine nobody syncs samples from the initial policy all run; an engine sampling the trained module
    itself, or one that VLLMWeightSync keeps in step, gets no warning."""
    from gpo.callbacks import VLLMWeightSync
    from gpo.train.preflight import warn_if_sampler_never_synced

    warn_if_sampler_never_synced(True, [])
    warn_if_sampler_never_synced(False, [VLLMWeightSync()])
    assert "VLLMWeightSync" not in caplog.text
    warn_if_sampler_never_synced(False, [])
    assert "it samples from the initial policy for the whole run" in caplog.text


def test_several_updates_per_rollout_without_a_ratio_gate_warn(root, caplog):
    with pytest.raises(AssertionError, match=r"HFEngine\.generate ran"):  # a warning, not an error: the run starts
        fit(root, "--model.optim.number_of_minibatches=2")
    assert "2 optimiser updates per rollout" in caplog.text and "ppo_clip: {}" in caplog.text


def test_max_steps_that_is_not_a_multiple_of_the_updates_per_batch_warns(root, caplog):
    with pytest.raises(AssertionError, match=r"HFEngine\.generate ran"):  # a warning, not an error
        fit(root, "--model.optim.number_of_minibatches=2", "--trainer.max_steps=3")
    assert "trainer.max_steps=3 is not a multiple of the 2 optimiser steps each batch takes" in caplog.text
    assert "the run ends after 4" in caplog.text
    caplog.clear()
    with pytest.raises(AssertionError, match=r"HFEngine\.generate ran"):
        fit(root, "--model.optim.number_of_minibatches=2", "--trainer.max_steps=4")
    assert "is not a multiple" not in caplog.text


def test_rspo_on_a_mixture_of_experts_model_reaches_sampling(root, tmp_path):
    save_tiny_model(tmp_path / "moe", "qwen2_moe")
    with pytest.raises(AssertionError, match=r"HFEngine\.generate ran"):  # the router check lets it through
        fit(root, "--model.algorithm=rspo", f"--model.policy={tmp_path / 'moe'}")


def test_a_policy_that_is_neither_a_folder_nor_a_hub_model(root, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying
    with pytest.raises(FileNotFoundError) as raised:
        fit(root, "--model.policy=no_such_model")  # could be a hub id, so transformers is asked first
    message = str(raised.value)
    assert "model.policy='no_such_model' is not a local folder" in message, message
    assert "point it at a folder written by save_pretrained" in message, message


CLI_CASES = [
    # ---- impossible numbers -----------------------------------------------------------------------------------
    bad("step_rewards_single_turn", "--model.step_rewards.mode=env_sparse",
        field="model.step_rewards needs multi-turn rollouts, and model.engine is HFEngine",
        fix="set model.engine to a MultiTurnEngine"),
    bad("group_size_1", "--model.group_size=1", field="model.group_size=1", fix="set it to >= 2"),
    bad("group_size_0", "--model.group_size=0", field="model.group_size=0", fix="set it to >= 2"),
    bad("max_new_tokens_0", "--model.engine.init_args.sampling.max_new_tokens=0",
        field="model.engine.init_args.sampling.max_new_tokens=0", fix="must be >= 1"),
    bad("max_new_tokens_negative", "--model.engine.init_args.sampling.max_new_tokens=-8",
        field="model.engine.init_args.sampling.max_new_tokens=-8", fix="must be >= 1"),
    bad("temperature_0", "--model.engine.init_args.sampling.temperature=0",
        field="model.engine.init_args.sampling.temperature=0", fix="must be > 0"),
    bad("top_p_0", "--model.engine.init_args.sampling.top_p=0", field="model.engine.init_args.sampling.top_p=0",
        fix="(0, 1]"),
    bad("top_p_above_1", "--model.engine.init_args.sampling.top_p=1.5",
        field="model.engine.init_args.sampling.top_p=1.5", fix="(0, 1]"),
    bad("top_k_negative", "--model.engine.init_args.sampling.top_k=-1",
        field="model.engine.init_args.sampling.top_k=-1", fix="must be >= 0"),
    bad("engine_batch_size_0", "--model.engine.init_args.batch_size=0", field="model.engine.init_args.batch_size=0",
        fix="null to generate in one call"),
    bad("max_prompt_length_0", "--data.max_prompt_length=0", field="data.max_prompt_length=0", fix="must be >= 1"),
    bad("prompts_per_step_0", "--data.prompts_per_step=0", field="data.prompts_per_step=0", fix="must be >= 1"),
    bad("val_size_negative", "--data.val_size=-1", field="data.val_size=-1", fix="must be >= 0"),
    bad("val_size_takes_every_row", "--data.val_size=4", field="data.val_size=4", fix="hold out fewer"),
    bad("lr_0", "--model.optim.lr=0", field="model.optim.lr=0", fix="must be > 0"),
    bad("lr_negative", "--model.optim.lr=-1e-5", field="model.optim.lr=-1e-05", fix="must be > 0"),
    bad("weight_decay_negative", "--model.optim.weight_decay=-0.1", field="model.optim.weight_decay=-0.1",
        fix="must be >= 0"),
    bad("max_grad_norm_0", "--model.optim.max_grad_norm=0", field="model.optim.max_grad_norm=0",
        fix="set it to null to not clip"),
    bad("number_of_minibatches_0", "--model.optim.number_of_minibatches=0",
        field="model.optim.number_of_minibatches=0", fix="must be >= 1"),
    bad("number_of_minibatches_not_a_divisor", "--model.optim.number_of_minibatches=3",
        field="model.optim.number_of_minibatches=3", fix="choose one of [1, 2, 4]"),
    bad("ppo_epochs_0", "--model.optim.ppo_epochs=0", field="model.optim.ppo_epochs=0", fix="must be >= 1"),
    bad("micro_batch_size_0", "--model.optim.micro_batch_size=0", field="model.optim.micro_batch_size=0",
        fix="must be >= 1, or null"),
    bad("eval_samples_0", "--model.evaluation.samples=0", field="model.evaluation.samples=0", fix="must be >= 1"),
    bad("kl_beta_negative", "--model.kl.beta=-0.1", field="beta=-0.1", fix="must be >= 0"),
    bad("entropy_coef_negative", "--model.entropy.coef=-0.01", field="coef=-0.01", fix="must be >= 0"),
    bad("lora_r_0", "--model.trainer_mode=lora", "--model.lora.r=0", field="model.lora.r=0", fix="must be >= 1"),
    bad("lora_alpha_0", "--model.trainer_mode=lora", "--model.lora.alpha=0", field="model.lora.alpha=0",
        fix="must be > 0"),
    bad("lora_target_misspelt", "--model.trainer_mode=lora", "--model.lora.target_modules=[q_prj, v_proj]",
        field="model.lora.target_modules: ['q_prj'] names no module of the model; did you mean q_proj?",
        fix="Its linear layers are named ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj'"),
    bad("lora_dropout_1", "--model.trainer_mode=lora", "--model.lora.dropout=1.0", field="model.lora.dropout=1.0",
        fix="[0, 1)"),
    bad("mixer_weights_count", "--model.mixer=gpo.algo.WeightedSum", "--model.mixer.weights=[1.0, 0.5]",
        field="model.mixer (WeightedSum) has 2 weights", fix="give one weight per reward function"),
    bad("no_rewards", "--model.rewards=[]", field="model.rewards is empty", fix="give at least one reward function"),
    bad("pass_reward_unknown", "--model.evaluation.pass_reward=positional", field="model.evaluation.pass_reward="
        "'positional' names none of model.rewards, which are named positional_match",
        fix="did you mean positional_match?"),
    # ---- the compatibility rules and knob ranges of flat GRPO configs -------------------------------------------
    bad("unknown_algorithm", "--model.algorithm=ppo", field="model.algorithm='ppo'",
        fix="a preset's defaults (grpo, rloo"),
    bad("clip_low_negative", "--model.algorithm=GRPO", "--model.algorithm.ppo_clip.clip_low=-0.1",
        field="clip_low=-0.1", fix="must be >= 0"),
    bad("clip_low_above_1", "--model.algorithm=CISPO", "--model.algorithm.clip_low=1.5", field="clip_low=1.5",
        fix="use a value in [0, 1]"),
    bad("dual_clip_below_1", "--model.algorithm=DAPO", "--model.algorithm.dual_clip=0.5", field="dual_clip=0.5",
        fix="must be > 1"),
    bad("sapo_tau_0", "--model.algorithm=SAPO", "--model.algorithm.tau_neg=0", field="tau_neg=0", fix="must be > 0"),
    bad("token_sum_norm_reads_max_completion_length", "--model.algorithm=DrGRPO",
        "--model.algorithm.max_completion_length=64", field="max_completion_length=64 is read only with",
        fix="loss_agg_mode: token_sum_norm"),
    bad("rspo_on_a_dense_model", "--model.algorithm=rspo", field="model.algorithm: RouterShiftGate (RSPO)",
        fix="model.algorithm: gmpo"),
    bad("correction_over_the_rollout_ratio", "--model.correction.mode=tis",
        field="model.correction weighs each token by pi_train / pi_rollout", fix="Set model.old_logprobs: trainer"),
    bad("pipelined_without_the_sampler_in_the_loss", "--model.max_off_policy_steps=1", "--model.old_logprobs=trainer",
        field="model.max_off_policy_steps=1 trains on rollouts sampled by an older policy",
        fix="with a model.correction"),
    # ---- paths, tokenizer and data ------------------------------------------------------------------------------
    bad("missing_model_path", "--model.policy={root}/no_such_model", error=FileNotFoundError,
        field="model.policy='{root}/no_such_model': no such folder", fix="written by save_pretrained"),
    bad("model_path_without_config", "--model.policy={root}", error=FileNotFoundError,
        field="model.policy='{root}' has no config.json",
        fix="point model.policy at the folder written by model.save_pretrained"),
    bad("model_folder_without_tokenizer", "--model.policy={root}/bare", error=FileNotFoundError,
        field="model.policy='{root}/bare' holds no tokenizer files", fix="tokenizer.save_pretrained"),
    bad("tokenizer_without_eos", "--model.tokenizer={root}/no_eos", field="model.tokenizer",
        fix="Add an eos_token to the tokenizer"),
    bad("missing_data_file", "--data.path={root}/no_such.jsonl", error=FileNotFoundError,
        field="data.path: data path '{root}/no_such.jsonl' does not exist", fix="give a .jsonl/.json/.parquet/.csv"),
    bad("empty_train_set", "--data.path={root}/empty.jsonl", field="data.path='{root}/empty.jsonl' has no rows",
        fix="point data.path at a file with at least one prompt"),
    bad("empty_val_set", "--data.val_path={root}/empty.jsonl", field="data.val_path='{root}/empty.jsonl' has no rows",
        fix="point data.val_path at a file with at least one prompt"),
    bad("no_prompt_column", "--data.path={root}/question.jsonl", field="has no column 'prompt' (prompt_column)",
        fix="Set data.prompt_column"),
    bad("prompt_not_text", "--data.path={root}/null_prompt.jsonl", field="row 1: column 'prompt'",
        fix="give every row a prompt string"),
    bad("reward_column_missing", "--model.rewards=[gpo.rewards.exact_match]", "--data.path={root}/no_answer.jsonl",
        field="the reward exact_match needs column(s) ['answer']", fix="has ['prompt', 'x']"),
    bad("reward_column_missing_in_val_set", "--data.val_path={root}/no_answer.jsonl",
        field="positional_match needs column(s) ['answer']; data.val_path='{root}/no_answer.jsonl' has",
        fix="Add the column to the dataset"),
    bad("prompt_over_max_prompt_length", "--data.path={root}/long.jsonl", "--data.max_prompt_length=100",
        field="the prompt is 300 tokens, over max_prompt_length=100", fix="data.long_prompts: truncate"),
    bad("prompt_plus_budget_over_context", "--data.path={root}/long.jsonl",
        field="model.engine.init_args.sampling.max_new_tokens=4", fix=f"data.max_prompt_length: {CONTEXT - 4}"),
    bad("budget_fills_the_context", f"--model.engine.init_args.sampling.max_new_tokens={CONTEXT}",
        field=f"model.engine.init_args.sampling.max_new_tokens={CONTEXT}", fix=f"set max_new_tokens below {CONTEXT}"),
    # ---- the trainer ---------------------------------------------------------------------------------------------
    bad("gradient_clip_val", "--trainer.gradient_clip_val=0.5", field="trainer.gradient_clip_val=0.5",
        fix="set model.optim.max_grad_norm: 0.5"),
    bad("accumulate_grad_batches", "--trainer.accumulate_grad_batches=2", field="trainer.accumulate_grad_batches=2",
        fix="raise data.prompts_per_step"),
    bad("precision_bf16_true", "--trainer.precision=bf16-true", field="trainer.precision=bf16-true",
        fix="use model.dtype: bfloat16"),
    bad("precision_16_true", "--trainer.precision=16-true", field="trainer.precision=16-true",
        fix="use model.dtype: float16"),
    bad("precision_64_true", "--trainer.precision=64-true", field="trainer.precision=64-true is not supported",
        fix="use one of ['32-true', 'bf16-mixed', '16-mixed']"),
]  # fmt: skip


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_config_fails_before_sampling_naming_field_and_fix(root, case):
    with pytest.raises(case.error) as raised:
        fit(root, *case.args)
    message = str(raised.value)
    assert case.field.format(root=root) in message, message
    assert case.fix in message, message


def test_float16_loss_scaling_needs_float32_weights_and_no_fsdp2_and_the_supported_precisions_pass():
    fp32 = torch.float32
    with pytest.raises(ValueError, match=r"trainer.precision=16-mixed is not supported under FSDP2 .* bf16-mixed"):
        check_precision("16-mixed", True, fp32)  # on a GPU only: Lightning makes it bf16-mixed on a CPU
    for weights in (torch.float16, torch.bfloat16):  # each fails inside the first steps otherwise
        with pytest.raises(ValueError, match=r"16-mixed computes in float16 from float32 weights, and model.dtype"):
            check_precision("16-mixed", False, weights)
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        check_precision(precision, False, fp32)
    for precision in ("32-true", "bf16-mixed"):
        check_precision(precision, True, fp32)


@pytest.mark.parametrize(
    ("arg", "choices"),
    [
        pytest.param("--model.trainer_mode=adapter", "adapter is not one of full, lora, qlora", id="trainer_mode"),
        pytest.param("--export=zip", "zip is not one of merged, adapter, none", id="export"),
        pytest.param("--model.old_logprobs=vllm", "vllm is not one of rollout, trainer", id="old_logprobs"),
        pytest.param(
            "--model.ppo_clip_ref_logprobs=vllm", "vllm is not one of rollout, batch", id="ppo_clip_ref_logprobs"
        ),
        pytest.param("--model.dtype=float8", "float8 is not one of float32, bfloat16, float16", id="dtype"),
        pytest.param("--data.long_prompts=drop", "drop is not one of error, truncate", id="long_prompts"),
    ],
)
def test_a_value_outside_a_fixed_set_is_refused_by_the_parser_with_the_choices(root, capsys, arg, choices):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", f"--config={root / 'good.yaml'}", arg])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"gpo fit: error: {arg[2:].split('=')[0]}: ") and choices in err
    assert len(err.splitlines()) <= 3, err  # no usage dump, no traceback


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--model.algorithm=CISPO", "--model.algorithm.ppo_clip.clip_low=0.2"), id="ppo_clip_on_cispo"),
        pytest.param(("--model.algorithm=GSPO", "--model.algorithm.ppo_clip.clip_low=0.2"), id="ppo_clip_on_gspo"),
        pytest.param(("--model.algorithm=CISPO", "--model.algorithm.ppo_clip={}"), id="ppo_clip_defaults_on_cispo"),
        pytest.param(("--model.algorithm=SAPO", "--model.algorithm.ppo_clip={}"), id="ppo_clip_defaults_on_sapo"),
        pytest.param(("--model.algorithm=SAPO", "--model.algorithm.clip_high=0.3"), id="clip_range_on_sapo"),
        pytest.param(("--model.algorithm=RLOO", "--model.algorithm.advantage_norm=batch"), id="rloo_batch_norm"),
        pytest.param(("--model.algorithm=DrGRPO", "--model.algorithm.advantage_norm=batch"), id="norm_on_dr_grpo"),
        pytest.param(("--model.algorithm=GRPO", "--model.algorithm.tau_pos=2.0"), id="sapo_tau_on_grpo"),
    ],
)
def test_a_setting_the_chosen_preset_does_not_have_is_refused_by_the_parser(root, capsys, args):
    # Each preset takes only the settings it reads (the refusals of flat GRPO configs: no PPO clip on CISPO/GSPO/SAPO,
    # RLOO has no batch normalisation, Dr. GRPO divides by no std), so anything else is an unknown key; the message
    # lists the settings the preset does take.
    with pytest.raises(SystemExit):
        run(["fit", f"--config={root / 'good.yaml'}", *args])
    err = capsys.readouterr().err
    preset, setting = args[0].split("=")[1], args[1].split("=")[0].removeprefix("--model.algorithm.").split(".")[0]
    assert f"model.algorithm ({preset}) has no setting '{setting}'" in err and "model.algorithm takes: " in err, err


# ---- cases that need Python objects: reward functions, loaded tokenizers ---------------------------------------


def needs_solution(prompts, completions, solution, **columns):
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def no_kwargs(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def python_fit(root, **module_kwargs) -> None:
    defaults = {"policy": str(root / "model"), "rewards": [positional_match], "group_size": 2}
    module = GPOModule(**{**defaults, "engine": HFEngine(sampling=Sampling(max_new_tokens=4)), **module_kwargs})
    data = PromptDataModule(str(root / "train.jsonl"), tokenizer=str(root / "model"), prompts_per_step=2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, data)


def py(case_id: str, arguments, *, error: type[BaseException] = ValueError, field: str, fix: str):
    """A Python-API case: ``arguments()`` gives the GPOModule keyword arguments that override the good ones."""
    return pytest.param(arguments, Bad((), error, field, fix), id=case_id)


PYTHON_CASES = [
    py("reward_not_callable", lambda: {"rewards": ["exact_match"]}, error=TypeError,
       field="model.rewards[0]='exact_match'", fix="give a function (prompts, completions, **columns)"),
    py("reward_with_one_positional_parameter", lambda: {"rewards": [lambda completions, **_: [0.0]]},
       error=TypeError, field="model.rewards[0] (<lambda>)", fix="give it (prompts, completions, **kwargs) first"),
    py("reward_missing_its_keyword_column", lambda: {"rewards": [needs_solution]},
       field="the reward needs_solution needs column(s) ['solution']", fix="Add the column to the dataset"),
    py("reward_without_kwargs", lambda: {"rewards": [no_kwargs]},
       field="the reward no_kwargs is called with column(s) ['completion_ids']",
       fix="add **kwargs to its parameters"),
    py("loaded_tokenizer_without_eos", lambda: {"policy": tiny_model(), "tokenizer": tokenizer_without_eos()},
       field="has no EOS token", fix="Add an eos_token to the tokenizer"),
    py("rewards_not_a_list", lambda: {"rewards": needs_solution}, error=TypeError,
       field="model.rewards is one function (needs_solution)", fix="give a list of them: rewards=[fn]"),
    py("loaded_model_without_tokenizer", lambda: {"policy": tiny_model()},
       field="GPOModule was given a loaded model without a tokenizer", fix="pass tokenizer="),
    py("two_rewards_with_one_name", lambda: {"rewards": [lambda prompts, completions, **_: [0.0] * len(completions),
                                                         lambda prompts, completions, **_: [1.0] * len(completions)]},
       field="model.rewards[0], model.rewards[1] are all named '<lambda>'", fix="Give each its own name"),
    py("tokenizer_larger_than_the_embedding",
       lambda: {"policy": tiny_model(), "tokenizer": tokenizer_larger_than_the_embedding()},
       field="has 100 tokens but model.policy's input embedding has 98 rows", fix="resize_token_embeddings"),
    py("reward_class_not_instance", lambda: {"rewards": [RegexFormat]}, error=TypeError,
       field="model.rewards[0] is the class RegexFormat", fix="give an instance, RegexFormat(...)"),
    py("preset_class_not_instance", lambda: {"algorithm": DAPO}, error=TypeError,
       field="model.algorithm is the class DAPO", fix="give an instance, DAPO(...)"),
    py("gate_as_algorithm", lambda: {"algorithm": ClipGate()}, error=TypeError,
       field="model.algorithm=ClipGate(...): it takes a preset's name", fix="ClipGate is a part of one: Custom(gate="),
    py("number_as_kl", lambda: {"kl": 0.1}, error=TypeError,
       field="model.kl=0.1", fix="it takes a gpo.algo.regularizers.KLPenalty"),
    py("dict_as_optim", lambda: {"optim": {"lr": 1e-3}}, error=TypeError,
       field="model.optim={'lr': 0.001}", fix="it takes a gpo.train.optimization.Optimization"),
    py("name_as_mixer", lambda: {"mixer": "weighted_sum"}, error=TypeError,
       field="model.mixer='weighted_sum'", fix="it takes a gpo.algo.mixers.RewardMixer"),
    py("name_as_engine", lambda: {"engine": "hf"}, error=TypeError,
       field="model.engine='hf'", fix="it takes a gpo.rollout.base.RolloutEngine"),
    py("no_engine", lambda: {"engine": None}, error=TypeError,
       field="model.engine=None", fix="it takes a gpo.rollout.base.RolloutEngine"),
]  # fmt: skip


@pytest.mark.parametrize(("arguments", "case"), PYTHON_CASES)
def test_bad_python_arguments_fail_before_sampling_naming_field_and_fix(root, arguments, case):
    with pytest.raises(case.error) as raised:
        python_fit(root, **arguments())
    message = str(raised.value)
    assert case.field in message, message
    assert case.fix in message, message


def test_only_a_pipelined_hf_engine_samples_in_a_worker_process(root):
    for steps, expected in [(0, False), (1, True)]:
        module = GPOModule(
            str(root / "model"), [positional_match], engine=HFEngine(sampling=Sampling(max_new_tokens=4)),
            max_off_policy_steps=steps, old_logprobs="rollout",
        )  # fmt: skip
        assert module.feed.sampler_process is expected


def test_step_rewards_under_a_gate_that_averages_the_advantage_over_the_sequence_warn(caplog):
    from gpo.algo import StepRewards
    from gpo.algo.gates import ClipGate, GeometricMeanGate, SequenceClipGate
    from gpo.envs import NumberGuess
    from gpo.rollout import MultiTurnEngine
    from gpo.train.preflight import check_step_rewards

    episodes = MultiTurnEngine(engine=HFEngine(), env=NumberGuess())
    for gate, warns in [(SequenceClipGate(), True), (GeometricMeanGate(), True), (ClipGate(), False),
                        (SequenceClipGate(per_token_advantage=True), False)]:  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", logger="gpo.train.preflight"):
            check_step_rewards(StepRewards(mode="decision_stepwise"), episodes, gate)
        said = f"the gate {type(gate).__name__} averages the advantage over each sequence" in caplog.text
        assert said == warns, (gate, caplog.text)

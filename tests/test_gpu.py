"""The CUDA paths: bfloat16 full fine-tuning learns, QLoRA trains only its adapter, resume agrees to float tolerance.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``python -m pytest -q -m gpu``, which also runs
the other gpu-marked cases (the pipelined worker's CUDA copy in ``tests/train/test_pipeline.py``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from gpo.models.loading import LoraSettings
from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    model = save_tiny_model(root / "model", "llama", seed=0)
    data = write_jsonl(make_task("sort_digits", 2000, seed=0), root / "train.jsonl")
    return str(model), str(data)


class Rewards(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.values.append(trainer.callback_metrics["reward"].item())


def fit(workspace, steps: int, **module_kwargs) -> tuple[GPOModule, list[float]]:
    model, data = workspace
    L.seed_everything(0)
    module_kwargs.setdefault("optim", Optimization(lr=1e-3))
    module = GPOModule(
        model, [positional_match], group_size=16, engine=HFEngine(sampling=Sampling(max_new_tokens=4)), **module_kwargs
    )
    rewards = Rewards()
    trainer = L.Trainer(
        accelerator="cuda", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[rewards],
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=8))
    return module, rewards.values


def test_bfloat16_full_fine_tuning_learns_on_gpu(workspace):
    module, rewards = fit(workspace, 300, dtype="bfloat16", old_logprobs="trainer")
    assert next(module.policy.parameters()).dtype == torch.bfloat16
    first, last = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    print(f"bf16 reward: first 50 steps {first:.3f}, last 50 steps {last:.3f}")
    assert last > first + 0.2, (first, last)


def test_qlora_trains_only_the_adapter_on_gpu(workspace):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes' 4-bit kernels: pip install bitsandbytes")
    lora = LoraSettings(r=8, alpha=16, dropout=0.0)
    module = GPOModule(
        workspace[0], [positional_match], group_size=4, engine=HFEngine(sampling=Sampling(max_new_tokens=4)),
        trainer_mode="qlora", lora=lora, optim=Optimization(lr=1e-3),
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    quantized = [n for n, p in module.policy.named_parameters() if p.dtype == torch.uint8]
    assert quantized, "no 4-bit weights: QLoRA did not quantise the base model"
    trainer = L.Trainer(
        accelerator="cuda", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(workspace[1], tokenizer=workspace[0], prompts_per_step=4))
    after = dict(module.policy.named_parameters())
    changed = {n for n, p in after.items() if not torch.equal(p.detach(), before[n].to(p.device))}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:5]

"""An exported folder tokenizes exactly as the folder the run started from: through gpo's ``load_tokenizer`` and
through transformers' ``AutoTokenizer``, for the ExportPolicy callback's ``export_policy`` and for ``gpo export``.

transformers 5 loads every ``qwen2`` folder's tokenizer as ``Qwen2Tokenizer``, rebuilt from the vocabulary alone as a
byte-level BPE: a character vocabulary loses its spaces. gpo must load (and so export) the tokenizer the folder
holds; what ``AutoTokenizer`` makes of a ``qwen2`` folder is transformers' choice, the same before and after export.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from gpo.models.export import export_checkpoint, export_policy
from gpo.models.loading import load_tokenizer
from gpo.testing import EOS, PAD, char_tokenizer, tiny_model

TEXT = "Sort  3 1 2,\tthen:\nnaïve café 日本 🙂 <|endoftext|>"  # runs of spaces, a tab, a newline, non-ASCII
ARCHS = ["llama", "qwen2", "qwen2_moe"]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (every character encodable), trained here."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[PAD, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["sort the digits 312 into 123", "then add 12 + 35", "naïve café"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)


TOKENIZERS = {"characters": char_tokenizer, "byte_level_bpe": byte_level_bpe}


def encoded(tokenizer) -> tuple[list[int], str]:
    ids = tokenizer(TEXT).input_ids
    return ids, tokenizer.decode(ids)


def write_folder(folder, arch: str, tokenizer) -> str:
    tiny_model(arch).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def built_pipeline(folder: str) -> dict:
    """The ``tokenizer.json`` of what transformers builds for ``folder`` (for qwen2: rebuilt from the vocabulary)."""
    return json.loads(AutoTokenizer.from_pretrained(folder).backend_tokenizer.to_str())


# each a tokenizer.json that differs from the one transformers builds for a qwen2 folder in one part of its pipeline
ONE_PART_CHANGED = {
    "model": lambda built: {
        **built,
        "model": {"type": "WordLevel", "vocab": built["model"]["vocab"], "unk_token": PAD},
    },
    "normalizer": lambda built: {**built, "normalizer": None},
    "pre_tokenizer": lambda built: {
        **built,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    },
    "decoder": lambda built: {**built, "decoder": {"type": "Fuse"}},
}


@pytest.mark.parametrize("part", list(ONE_PART_CHANGED))
def test_a_folder_whose_pipeline_differs_in_one_part_from_what_transformers_builds_loads_as_saved(tmp_path, part):
    folder = write_folder(tmp_path / "model", "qwen2", byte_level_bpe())
    built = built_pipeline(folder)
    saved = json.loads(
        Tokenizer.from_str(json.dumps(ONE_PART_CHANGED[part](built))).to_str()
    )  # as tokenizers writes it
    Path(folder, "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    loaded = json.loads(load_tokenizer(folder, "model.policy").backend_tokenizer.to_str())
    assert loaded[part] == saved[part] != built[part]


def as_transformers_builds_it(folder: str) -> None:
    Path(folder, "tokenizer.json").write_text(json.dumps(built_pipeline(folder)), encoding="utf-8")


def vocabulary_files_only(folder: str) -> None:
    """As older hub models ship: vocab.json and merges.txt, no tokenizer.json."""
    AutoTokenizer.from_pretrained(folder).backend_tokenizer.model.save(folder)
    Path(folder, "tokenizer.json").unlink()


@pytest.mark.parametrize("rewrite", [as_transformers_builds_it, vocabulary_files_only])
def test_a_folder_whose_pipeline_transformers_builds_as_saved_loads_as_autotokenizer_loads_it(tmp_path, rewrite):
    folder = write_folder(tmp_path / "model", "qwen2", byte_level_bpe())
    rewrite(folder)
    auto, loaded = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder, "model.policy")
    assert type(loaded) is type(auto) and encoded(loaded) == encoded(auto)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_export_keeps_the_tokenizer_of_the_folder(tmp_path, arch, kind):
    original = TOKENIZERS[kind]()
    folder = write_folder(tmp_path / "model", arch, original)
    loaded = load_tokenizer(folder, "model.policy")
    assert encoded(loaded) == encoded(original)
    exported = export_policy(tiny_model(arch), loaded, tmp_path / "export")
    assert encoded(load_tokenizer(str(exported), "export")) == encoded(original)
    assert encoded(PreTrainedTokenizerFast.from_pretrained(exported)) == encoded(original)
    assert encoded(AutoTokenizer.from_pretrained(exported)) == encoded(AutoTokenizer.from_pretrained(folder))
    if arch != "qwen2":  # a user's AutoTokenizer gets the original itself
        assert encoded(AutoTokenizer.from_pretrained(exported)) == encoded(original)


def test_gpo_export_keeps_the_tokenizer_of_the_run(tmp_path):
    original = char_tokenizer()
    folder = write_folder(tmp_path / "model", "qwen2", original)
    weights = {f"policy.{name}": value for name, value in tiny_model("qwen2").state_dict().items()}
    torch.save({"state_dict": weights}, tmp_path / "last.ckpt")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"policy": folder, "tokenizer": None}}))
    exported = export_checkpoint(tmp_path / "config.yaml", tmp_path / "last.ckpt", tmp_path / "export")
    assert encoded(load_tokenizer(str(exported), "export")) == encoded(original)
    assert encoded(PreTrainedTokenizerFast.from_pretrained(exported)) == encoded(original)


def test_gpo_export_takes_the_base_model_from_policy_and_the_tokenizer_from_the_runs_model_tokenizer(tmp_path, capsys):
    """The run's folders moved: --policy names the base model where it is now; the config's model.tokenizer (a
    tokenizer other than the base model's) is the one exported."""
    from gpo.cli import main

    moved = write_folder(tmp_path / "moved", "llama", char_tokenizer())
    tokenizer = byte_level_bpe()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    settings = {"policy": str(tmp_path / "gone"), "tokenizer": str(tmp_path / "tokenizer")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": settings}))
    trained = tiny_model("llama")
    with torch.no_grad():
        trained.model.norm.weight.fill_(0.5)  # the checkpoint's weights, not the base model's, are exported
    torch.save({"state_dict": {f"policy.{k}": v for k, v in trained.state_dict().items()}}, tmp_path / "last.ckpt")
    command = ["export", str(tmp_path / "config.yaml"), str(tmp_path / "last.ckpt"), str(tmp_path / "export")]
    with pytest.raises(SystemExit):
        main(command)
    assert "(gpo export: give the run's base model with --policy)" in capsys.readouterr().err
    main([*command, "--policy", moved])
    assert encoded(load_tokenizer(str(tmp_path / "export"), "export")) == encoded(tokenizer)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in trained.state_dict().items())

"""An exported folder tokenizes exactly as the folder the run started from: through gpo's ``load_tokenizer`` and
through transformers' ``AutoTokenizer``, for the ExportPolicy callback's ``export_policy`` and for ``gpo export``.

transformers 5 loads every ``qwen2`` folder's tokenizer as ``Qwen2Tokenizer``, rebuilt from the vocabulary alone as a
byte-level BPE: a character vocabulary loses its spaces. gpo must load (and so export) the tokenizer the folder
holds; what ``AutoTokenizer`` makes of a ``qwen2`` folder is transformers' choice, the same before and after export.
"""

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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

import json

import pandas as pd
import pytest

from gpo.tasks import Arithmetic
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.records import load_records

ROWS = [{"prompt": "12=", "answer": "12", "level": 1}, {"prompt": "31=", "answer": "13", "level": 2}]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tok") / "model"))


def write(tmp_path, kind, rows=ROWS):
    path = tmp_path / f"prompts.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif kind == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:  # a saved datasets folder with a train split
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "saved"])
def test_every_local_format_loads_with_its_columns(tmp_path, kind):
    records = load_records(write(tmp_path, kind))
    assert [r["prompt"] for r in records] == ["12=", "31="]
    assert [str(r["answer"]) for r in records] == ["12", "13"]


def test_batches_carry_token_ids_texts_and_extra_columns(tmp_path, tokenizer_path):
    data = PromptDataModule(str(write(tmp_path, "jsonl")), tokenizer=tokenizer_path, prompts_per_step=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch["prompt"]) == ["12=", "31="]
    assert set(batch["fields"]) == {"answer", "level"}
    for text, ids in zip(batch["prompt"], batch["prompt_ids"], strict=True):
        assert len(ids) == len(text)  # one token per character with the tiny tokenizer


def test_validation_split_is_held_out_and_reproducible(tmp_path, tokenizer_path):
    rows = [{"prompt": f"{i:03d}=", "answer": str(i)} for i in range(20)]
    path = str(write(tmp_path, "jsonl", rows))
    first = PromptDataModule(path, tokenizer=tokenizer_path, val_size=5, seed=3)
    second = PromptDataModule(path, tokenizer=tokenizer_path, val_size=5, seed=3)
    first.setup("fit"), second.setup("fit")
    val = {r["prompt"] for r in first.val_rows}
    assert len(val) == 5 and not val & {r["prompt"] for r in first.train_rows}
    assert val == {r["prompt"] for r in second.val_rows}


def test_chat_template_is_applied_when_the_tokenizer_has_one(tmp_path, tokenizer_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}!{% endif %}"
    )
    templated = tmp_path / "templated"
    tok.save_pretrained(templated)
    data = PromptDataModule(str(write(tmp_path, "jsonl")), tokenizer=str(templated))
    data.setup("fit")
    assert tok.decode(data.train_rows[0]["prompt_ids"]) in ("<12=>!", "<31=>!")
    plain = PromptDataModule(str(write(tmp_path, "jsonl")), tokenizer=str(templated), chat_template=False)
    plain.setup("fit")
    assert tok.decode(plain.train_rows[0]["prompt_ids"]) in ("12=", "31=")


def test_long_prompts_are_refused_or_truncated_never_silently(tmp_path, tokenizer_path, caplog):
    path = str(write(tmp_path, "jsonl", [{"prompt": "x" * 10}, {"prompt": "short"}]))
    with pytest.raises(ValueError, match="row 0: the prompt is 10 tokens, over max_prompt_length=6"):
        PromptDataModule(path, tokenizer=tokenizer_path, max_prompt_length=6).setup("fit")
    data = PromptDataModule(path, tokenizer=tokenizer_path, max_prompt_length=6, long_prompts="truncate")
    data.setup("fit")
    lengths = {row["prompt"]: len(row["prompt_ids"]) for row in data.train_rows}  # in an order drawn from the seed
    assert lengths["x" * 10] == 6
    assert "1 prompts longer than 6 tokens were truncated" in caplog.text


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([], {}, "has no rows"),
        ([{"question": "a"}], {}, "no column 'prompt' \\(prompt_column\\); its columns are: question"),
        ([{"prompt": "a"}], {"val_size": 1}, "val_size=1 leaves no training rows"),
    ],
)
def test_bad_data_fails_with_the_field_and_the_fix(tmp_path, tokenizer_path, rows, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        PromptDataModule(str(path), tokenizer=tokenizer_path, **kwargs).setup("fit")


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "prompts.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"unknown file type '\.txt'"):
        load_records(tmp_path / "prompts.txt")


# ---- prompts generated from a seed (gpo.tasks.GeneratedTask) instead of read from a file ---------------------------


def test_a_generated_task_serves_prompts_and_its_held_out_split(tokenizer_path):
    train, test = Arithmetic(size=12, seed=2), Arithmetic(size=4, split="test", seed=2)
    data = PromptDataModule(train, val_path=test, tokenizer=tokenizer_path, prompts_per_step=4, chat_template=False)
    data.setup("fit")
    assert [r["prompt"] for r in data.train_rows] == [r["prompt"] for r in train.records()]
    assert [r["answer"] for r in data.val_rows] == [r["answer"] for r in test.records()]
    assert all(len(r["prompt_ids"]) == len(r["prompt"]) for r in data.train_rows)  # one token per character
    assert list(data.columns) == [f"data.path={train!r}", f"data.val_path={test!r}"]
    batch = next(iter(data.train_dataloader()))
    assert len(batch["prompt"]) == 4 and set(batch["fields"]) == {"answer"}


def test_a_generated_task_is_written_in_yaml_and_its_errors_name_the_field(tmp_path, tokenizer_path):
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(PromptDataModule, "data")
    config = tmp_path / "data.yaml"
    config.write_text(
        "data:\n  path:\n    class_path: gpo.tasks.Arithmetic\n    init_args: {size: 19, split: test, digits: 1}\n"
    )
    data = parser.instantiate(parser.parse_args(["--config", str(config)])).data
    assert isinstance(data.path, Arithmetic) and data.path.digits == 1
    data.tokenizer_path = tokenizer_path
    with pytest.raises(ValueError, match=r"^data.path: Arithmetic: size=19, but only 18 distinct test problems"):
        data.setup("fit")
    plain = parser.instantiate(parser.parse_args(["--data.path", "prompts.jsonl"])).data
    assert plain.path == "prompts.jsonl"  # a file path stays a path


# ---- a file the parser cannot read: one line naming the file and what is wrong, not datasets' traceback -----------


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        (
            "prompts.jsonl",
            '{"prompt": "ok"}\n\n{"prompt": "ok"}\n{"prompt": "cut\n',
            r"line 4, column 16 is not valid JSON",
        ),
        (
            "prompts.jsonl",
            '{"prompt": "ok"}\n{"prompt": ok}\n',
            r"line 2, column 12 is not valid JSON: Expecting value",
        ),
        ("prompts.json", '[{"prompt": "ok"}, {"prompt": ', r"Expected object or value at position 29"),
        (
            "prompts.csv",
            "prompt,answer\nok,1\nok,1,2\n",
            r"Error tokenizing data. C error: Expected 2 fields in line 3, saw 3",
        ),
        ("prompts.parquet", "not a parquet file\n", r"Parquet magic bytes not found"),
    ],
)
def test_a_file_that_does_not_parse_is_refused_in_one_line(tmp_path, tokenizer_path, name, content, reason):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"^data.path: {path} could not be read: {reason}") as raised:
        PromptDataModule(str(path), tokenizer=tokenizer_path).setup("fit")
    assert "\n" not in str(raised.value)


# ---- encodings: a prompts file that is not UTF-8 is named with its line -------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        ("prompts.jsonl", '{"prompt": "ok"}\n{"prompt": "café"}\n', 2),
        ("prompts.json", '[{"prompt": "ok"},\n {"prompt": "café"}]\n', 2),
        ("prompts.csv", "prompt\nok\ncafé\n", 3),
    ],
)
def test_a_file_that_is_not_utf8_is_refused_naming_the_line(tmp_path, tokenizer_path, name, content, line):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert [r["prompt"] for r in load_records(path)] == ["ok", "café"]
    path.write_text(content, encoding="latin-1")  # é is the single byte 0xe9 there
    message = (
        rf"^data.path: {path} line {line} is not UTF-8 \(byte 0xe9 at byte \d+ of the line\); prompts files must be"
    )
    with pytest.raises(ValueError, match=message):
        PromptDataModule(str(path), tokenizer=tokenizer_path).setup("fit")


# ---- the tokenizer: the data module's own, else the module's it is trained with -----------------------------------


def test_without_a_tokenizer_it_uses_the_trained_modules(tmp_path, tokenizer_path):
    from tests.tiny import quiet_trainer, tiny_module

    module = tiny_module(tokenizer_path)
    data = PromptDataModule(str(write(tmp_path, "jsonl")), prompts_per_step=2)
    quiet_trainer(1).fit(module, data)
    assert module.global_step == 1
    assert [module.tokenizer.decode(r["prompt_ids"]) for r in data.train_rows] == [r["prompt"] for r in data.train_rows]


def test_without_a_tokenizer_anywhere_it_says_where_to_give_one(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from tests.tiny import quiet_trainer

    data = PromptDataModule(str(write(tmp_path, "jsonl")), prompts_per_step=2)
    with pytest.raises(ValueError, match=r"PromptDataModule has no tokenizer: pass tokenizer= \(the policy's folder"):
        quiet_trainer(1).fit(BoringModel(), data)
    with pytest.raises(ValueError, match="PromptDataModule has no tokenizer"):
        data.setup("fit")  # no trainer at all


def test_without_held_out_prompts_fit_evaluates_nothing_quietly_and_validate_is_refused(tiny_assets, recwarn):
    import lightning as L

    from tests.tiny import prompts, quiet_trainer, tiny_module

    model, data = tiny_assets
    module = tiny_module(model)
    plain = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}  # Lightning's warnings on
    L.Trainer(max_steps=1, **plain).fit(module, prompts(model, data))
    assert not [w for w in recwarn if "Total length of `DataLoader`" in str(w.message)]  # Lightning's empty loader
    with pytest.raises(ValueError, match=r"validating needs held-out prompts: set data\.val_path"):
        quiet_trainer(1).validate(module, prompts(model, data))

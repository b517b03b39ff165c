import json
import warnings

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
    trainer = L.Trainer(max_steps=1, **plain)
    trainer.fit(module, prompts(model, data))
    assert not [w for w in recwarn if "Total length of" in str(w.message)]  # Lightning's empty loader
    assert trainer.limit_val_batches == 1.0  # given back after the fit: a later fit with held-out prompts evaluates
    with pytest.raises(ValueError, match=r"validating needs held-out prompts: set data\.val_path"):
        quiet_trainer(1).validate(module, prompts(model, data))


# ---- settings refused at construction, and a prompt's own checks ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts_per_step": 0}, r"data\.prompts_per_step=0 must be >= 1"),
        ({"max_prompt_length": 0}, r"data\.max_prompt_length=0 must be >= 1"),
        ({"val_size": -1}, r"data\.val_size=-1 must be >= 0"),
        ({"long_prompts": "drop"}, r"data\.long_prompts='drop' is not valid; choose 'error' or 'truncate'"),
    ],
)
def test_a_setting_out_of_its_range_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptDataModule("prompts.jsonl", **kwargs)


def test_the_smallest_valid_settings_are_accepted(tmp_path, tokenizer_path):
    """One prompt a step, one token, nothing held out: the lower bounds themselves are valid."""
    path = str(write(tmp_path, "jsonl", [{"prompt": "1"}, {"prompt": "2"}]))
    data = PromptDataModule(path, tokenizer=tokenizer_path, prompts_per_step=1, max_prompt_length=1, val_size=0)
    data.setup("fit")
    assert sorted(r["prompt"] for r in data.train_rows) == ["1", "2"] and data.val_rows == []


def test_a_prompt_of_exactly_max_prompt_length_tokens_is_kept_whole(tmp_path, tokenizer_path):
    path = str(write(tmp_path, "jsonl", [{"prompt": "abcdef"}]))
    data = PromptDataModule(path, tokenizer=tokenizer_path, max_prompt_length=6)  # long_prompts="error"
    data.setup("fit")
    assert len(data.train_rows[0]["prompt_ids"]) == 6
    assert data.longest_prompt == (6, f"data.path={path!r} row 0")


def test_a_truncated_prompt_keeps_its_last_tokens(tmp_path, tokenizer_path):
    """The end of a prompt (the question, the generation prompt) is what the completion follows."""
    from transformers import AutoTokenizer

    path = str(write(tmp_path, "jsonl", [{"prompt": "abcdefghij"}]))
    data = PromptDataModule(path, tokenizer=tokenizer_path, max_prompt_length=4, long_prompts="truncate")
    data.setup("fit")
    assert AutoTokenizer.from_pretrained(tokenizer_path).decode(data.train_rows[0]["prompt_ids"]) == "ghij"


def test_the_prompt_column_is_not_passed_on_among_the_other_columns(tmp_path, tokenizer_path):
    path = str(write(tmp_path, "jsonl", [{"question": "12=", "answer": "12"}, {"question": "31=", "answer": "13"}]))
    data = PromptDataModule(path, tokenizer=tokenizer_path, prompt_column="question", prompts_per_step=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch["prompt"]) == ["12=", "31="] and batch["fields"] == {"answer": batch["fields"]["answer"]}


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([{"prompt": "ok"}, {"prompt": 7}], {}, r"row 1: column 'prompt' \(data.prompt_column\) holds 7, not text"),
        ([{"prompt": "ok"}, {"prompt": ""}], {}, r"row 1: the prompt is empty \(no tokens\); give every row a prompt"),
        ([{"prompt": "ok"}], {"chat_template": True}, r"chat_template=True but the tokenizer has no chat template"),
    ],
)
def test_a_prompt_that_is_no_text_or_a_template_the_tokenizer_lacks_is_refused(
    tmp_path, tokenizer_path, rows, kwargs, message
):
    path = str(write(tmp_path, "jsonl", rows))
    with pytest.raises(ValueError, match=message):
        PromptDataModule(path, tokenizer=tokenizer_path, **kwargs).setup("fit")


def test_a_batch_that_is_not_a_batch_of_prompts_is_refused_naming_what_it_lacks():
    from gpo.train.data import check_batch, collate

    check_batch(collate([{"prompt": "a", "prompt_ids": [1], "answer": "1"}]))  # a batch of prompts passes
    with pytest.raises(ValueError, match=r"lacks \['fields'\] \(it has \['prompt', 'prompt_ids'\]\)"):
        check_batch({"prompt": ["a"], "prompt_ids": [[1]]})
    with pytest.raises(ValueError, match=r"lacks \['prompt', 'prompt_ids', 'fields'\] \(it has list\)"):
        check_batch([{"prompt": "a"}])


# ---- resuming and the data settings ---------------------------------------------------------------------------------


def fake_trainer(fn=None, *, rank=0, world_size=1):
    """What the data module reads of its trainer: the stage, the process's rank and the number of processes."""
    from types import SimpleNamespace

    return SimpleNamespace(state=SimpleNamespace(fn=fn), global_rank=rank, world_size=world_size)


def test_a_resumed_fit_warns_about_a_changed_data_seed_and_an_evaluation_does_not(tmp_path, tokenizer_path):
    from lightning.pytorch.trainer.states import TrainerFn

    path = str(write(tmp_path, "jsonl"))
    saved = PromptDataModule(path, tokenizer=tokenizer_path, seed=1).state_dict()
    now = PromptDataModule(path, tokenizer=tokenizer_path, seed=2)
    now.trainer = fake_trainer(TrainerFn.FITTING)
    with pytest.warns(UserWarning, match=r"data\.seed 1 -> 2"):
        now.load_state_dict(saved)
    now.trainer = fake_trainer(TrainerFn.VALIDATING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        now.load_state_dict(saved)


# ---- batches under DDP: each process's share of the single process's batch ---------------------------------------


def test_prompts_per_step_that_does_not_split_over_the_processes_is_refused(tmp_path, tokenizer_path):
    data = PromptDataModule(str(write(tmp_path, "jsonl")), tokenizer=tokenizer_path, prompts_per_step=8)
    data.trainer = fake_trainer(world_size=3)
    with pytest.raises(ValueError, match=r"split evenly over the 3 processes .* make it a multiple of 3"):
        data.setup("fit")


def test_each_process_loads_its_share_of_the_batch_one_process_would_load(tmp_path, tokenizer_path):
    rows = [{"prompt": f"{i}="} for i in range(8)]
    data = PromptDataModule(str(write(tmp_path, "jsonl", rows)), tokenizer=tokenizer_path, prompts_per_step=4, seed=5)
    data.setup("fit")
    single = [batch["prompt"] for batch in data.train_dataloader()]
    shares = []
    for rank in (0, 1):
        data.trainer = fake_trainer(rank=rank, world_size=2)
        shares.append([batch["prompt"] for batch in data.train_dataloader()])
    assert [len(batch) for batch in shares[0]] == [2, 2]  # 4 prompts a step over 2 processes, 8 rows: 2 steps
    for step, batch in enumerate(single):
        assert sorted(shares[0][step] + shares[1][step]) == sorted(batch)


def test_an_epoch_that_does_not_split_evenly_is_padded_with_its_first_rows_then_dealt_out():
    from gpo.train.data import EpochOrder

    whole = EpochOrder(5, seed=3).order(0)  # the epoch's permutation of 5 rows, for any number of processes
    padded = whole + whole[:1]  # 6 = 2 processes x 3 rows
    assert [list(EpochOrder(5, 3, rank=rank, world_size=2)) for rank in (0, 1)] == [padded[0::2], padded[1::2]]


# ---- the place in the epoch: saved by the loader and resumed after the prompts done -------------------------------


def numbered_loader(batch_size, trained, *, rank=0, world_size=1, rows=8):
    from gpo.train.data import PromptLoader

    rows = [{"prompt": str(i), "prompt_ids": [i]} for i in range(rows)]
    return PromptLoader(rows, batch_size, seed=4, batches_trained=lambda: trained[0], rank=rank, world_size=world_size)


def test_the_loaders_state_counts_the_prompts_of_every_process():
    trained = [3]
    loader = numbered_loader(2, trained, world_size=2)
    assert loader.state_dict() == {"epoch": 0, "batches_done": 3, "prompts_done": 12}  # 3 batches x 2 x 2 processes


def test_a_resume_with_another_batch_size_counts_the_prompts_before_it_then_its_own():
    """8 rows: 3 batches of 2 done before the checkpoint (6 prompts), then batches of 4."""
    trained = [3]
    resumed = numbered_loader(4, trained)
    resumed.load_state_dict({"epoch": 0, "batches_done": 3, "prompts_done": 6})
    whole = resumed.order.order(0)
    assert [[int(p) for p in batch["prompt"]] for batch in resumed] == [whole[6:8]]  # the 2 prompts left
    trained[0] = 4  # Lightning's count goes on from the checkpoint's
    assert resumed.state_dict() == {"epoch": 0, "batches_done": 4, "prompts_done": 10}  # 6 + 1 x 4
    resumed.order.set_epoch(1)
    trained[0] = 1  # the next epoch counts from 0 again
    assert resumed.state_dict() == {"epoch": 1, "batches_done": 1, "prompts_done": 4}
    assert len(list(resumed)) == 2  # and is whole: 8 rows in batches of 4


def test_a_resume_skips_the_prompts_done_split_over_the_processes_and_only_once():
    """4 prompts done over 2 processes: each skips the first 2 rows of its share, on the resumed epoch's first pass."""
    loader = numbered_loader(1, [0], rank=1, world_size=2)
    share = loader.order.order(0)[1::2]  # rank 1 of 2: rows 1, 3, 5, 7 of the epoch's permutation
    loader.load_state_dict({"epoch": 0, "batches_done": 2, "prompts_done": 4})
    assert [int(batch["prompt"][0]) for batch in loader] == share[2:]
    assert [int(batch["prompt"][0]) for batch in loader] == share  # the next pass over it is whole


def test_a_skip_for_one_epoch_is_not_applied_to_another():
    loader = numbered_loader(2, [0])
    loader.order.resume(0, 4)
    loader.order.set_epoch(1)
    assert len(list(loader)) == 4


# ---- extra draws (DynamicSampling) ----------------------------------------------------------------------------------


def test_extra_draws_go_through_reshuffled_passes_and_a_resumed_draw_goes_on_where_it_stopped():
    from gpo.seeds import stream_seed
    from gpo.train.data import PromptDraws, reshuffled

    loader = numbered_loader(2, [0], rows=6)  # 3 batches a pass
    passes = [[b["prompt"] for b in reshuffled(loader, stream_seed("data/draws", 9, k))] for k in (0, 1)]
    draws = PromptDraws(loader, seed=9)
    assert [next(draws)["prompt"] for _ in range(5)] == passes[0] + passes[1][:2]
    resumed = PromptDraws(loader, seed=9, drawn=4)
    assert next(resumed)["prompt"] == passes[1][1]


def test_without_a_seed_of_its_own_the_data_follows_the_runs_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) exports
    assert PromptDataModule("prompts.jsonl").seed == 7
    assert PromptDataModule("prompts.jsonl", seed=3).seed == 3

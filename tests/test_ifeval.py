"""IFEval rewards: lm-eval's instruction checkers on ROLL's and IFEval's rows, offline, in the
reward worker (ROLL's GeneralRuleRewardWorker path), the built-in task, the per-domain metrics."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from roll_gspo.config import preflight
from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards import ifeval
from roll_gspo.rewards.scoring import RewardProcess, ScoreWithMetrics
from tests.test_reward_workers import batch_of, make_worker
from tests.test_roll_configs import GSPO, ROLL_DIR, load_roll

ROLL_PATH = "roll.pipeline.rlvr.rewards.ifeval_rule_reward_worker.GeneralRuleRewardWorker"


@pytest.fixture(scope="module", autouse=True)
def punkt_in_tmp(tmp_path_factory):
    """nltk's English Punkt model written into a test folder, not the user's ~/nltk_data."""
    return ifeval.ensure_punkt_tab(str(tmp_path_factory.mktemp("nltk_data")))


def verdict(response, instruction, kwargs=None):
    return ifeval.score_instructions(response, [instruction], [kwargs or {}])[0]


# ------------------------------------------------------------------------ lm-eval's checkers
@pytest.mark.parametrize("instruction,kwargs,response,expected", [
    ("punctuation:no_comma", {}, "No commas in here.", 1.0),
    ("punctuation:no_comma", {}, "Yes, there is one.", 0.0),
    ("change_case:english_lowercase", {}, "the rain falls on the green hills all day long", 1.0),
    ("change_case:english_lowercase", {}, "The rain falls on the green hills all day long", 0.0),
    ("change_case:english_capital", {}, "THE WEATHER IS VERY NICE TODAY AND I WENT FOR A WALK IN THE PARK", 1.0),
    ("change_case:english_capital", {}, "THE RAIN FALLS ON THE GREEN HILLS all day", 0.0),
    ("keywords:existence", {"keywords": ["cat", "hat"]}, "The Cat wore a hat.", 1.0),
    ("keywords:existence", {"keywords": ["cat", "hat"]}, "The cat wore a cap.", 0.0),
    ("keywords:forbidden_words", {"forbidden_words": ["dog"]}, "Dogs are fine.", 1.0),  # whole words
    ("keywords:forbidden_words", {"forbidden_words": ["dog"]}, "A dog barked.", 0.0),
    ("startend:end_checker", {"end_phrase": "That is all."}, "Fine. That is all.", 1.0),
    ("startend:end_checker", {"end_phrase": "That is all."}, "That is all. Fine.", 0.0),
    ("startend:quotation", {}, '"Wrapped."', 1.0),
    ("startend:quotation", {}, 'Not "wrapped".', 0.0),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", 1.0),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three", 0.0),
    ("length_constraints:number_words", {"num_words": 4, "relation": "less than"}, "one two three", 1.0),
    # nltk's English Punkt knows "Mr." and "p.m."; an untrained one would count 5 sentences
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Mr. Smith came home. He left at 3 p.m. today.", 1.0),
    ("detectable_format:title", {}, "<<A Poem>>\nRoses.", 1.0),
    ("detectable_format:title", {}, "A Poem\nRoses.", 0.0),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", 1.0),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two\n* three", 0.0),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', 1.0),
    ("detectable_format:json_format", {}, "{a: 1}", 0.0),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", 1.0),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi. bye", 0.0),
    ("combination:two_responses", {}, "First one.\n******\nSecond one.", 1.0),
    ("combination:two_responses", {}, "First one.\n******\nFirst one.", 0.0),
    ("language:response_language", {"language": "de"}, "Das ist ein kleiner Text auf Deutsch, nicht wahr?", 1.0),
    ("language:response_language", {"language": "de"}, "This is a short text in English, is it not?", 0.0),
])
def test_ifeval_checkers_through_lm_eval(instruction, kwargs, response, expected):
    assert verdict(response, instruction, kwargs) == expected


def test_strict_loose_hard_soft():
    ids = ["startend:end_checker", "punctuation:no_comma"]
    kwargs = [{"end_phrase": "Bye now."}, {}]
    response = "**Note**\nIt rains, a lot. Bye now.\n*signed*"  # a comma; the ending is not the last line
    score, results = ifeval.score_instructions(response, ids, kwargs)
    assert score == 0.0 and [(r.instruction, r.strict, r.loose) for r in results] == [
        ("startend:end_checker", False, True), ("punctuation:no_comma", False, False)]
    assert ifeval.score_instructions(response, ids, kwargs, loose=True)[0] == 0.0
    assert ifeval.score_instructions(response, ids, kwargs, loose=True, reward_type="soft")[0] == 0.5
    assert ifeval.instruction_metrics(results) == {"prompt_level_strict_acc": 0.0, "inst_level_strict_acc": 0.0,
                                                   "prompt_level_loose_acc": 0.0, "inst_level_loose_acc": 0.5}
    assert ifeval.score_instructions("", ["punctuation:no_comma"], [{}])[0] == 0.0  # lm-eval: empty fails


# ------------------------------------------------------------------------ ROLL's rows
def roll_truth(func_name, **args):
    """A ground truth as ROLL's data writes it: every argument name, unused ones null."""
    every = {"keyword_list": None, "word": None, "N": None, "forbidden_words": None, "letter": None,
             "language": None, "quantifier": None, "first_word": None, "i": None, "postscript_marker": None,
             "options": None, "section_splitter": None, "original_prompt": None, "end_phrase": None}
    return json.dumps({"func_name": func_name, **every, **args})


@pytest.mark.parametrize("func_name,args,response,expected", [
    ("verify_keywords", {"keyword_list": ["sun", "sea"]}, "The sun set over the sea.", 1.0),
    ("verify_keywords", {"keyword_list": ["sun", "sea"]}, "The sun set.", 0.0),
    ("validate_forbidden_words", {"forbidden_words": ["rain"]}, "Sunny all day.", 1.0),
    ("validate_forbidden_words", {"forbidden_words": ["rain"]}, "Rain all day.", 0.0),
    ("verify_letter_frequency", {"letter": "z", "N": 2}, "Jazz.", 1.0),
    ("verify_letter_frequency", {"letter": "z", "N": 3}, "Jazz.", 0.0),
    ("validate_response_language", {"language": "en"}, "This answer is written in plain English words.", 1.0),
    ("validate_word_constraint", {"N": 3, "quantifier": "at least"}, "one two three", 1.0),
    ("validate_word_constraint", {"N": 3, "quantifier": "at most"}, "one two three four", 0.0),
    ("validate_word_constraint", {"N": 10, "quantifier": "around"}, "a b c d e f g h i", 1.0),   # within 1
    ("validate_word_constraint", {"N": 10, "quantifier": "around"}, "a b c d e f g h", 0.0),
    ("verify_sentence_constraint", {"N": 2, "quantifier": "at most"}, "One. Two.", 1.0),
    ("verify_sentence_constraint", {"N": 2, "quantifier": "at least"}, "Only one.", 0.0),
    ("validate_paragraphs", {"N": 2, "i": 2, "first_word": "Then"}, "First came rain.\n\nThen sun.", 1.0),
    ("validate_paragraphs", {"N": 2, "i": 2, "first_word": "Then"}, "First came rain.\n\nSun.", 0.0),
    ("verify_postscript", {"postscript_marker": "P.P.S"}, "Hello.\nP.P.S see you", 1.0),
    ("validate_placeholders", {"N": 2}, "Meet at [place] on [date].", 1.0),
    ("validate_placeholders", {"N": 2}, "Meet at [place].", 0.0),
    ("verify_bullet_points", {"N": 2}, "* a\n* b", 1.0),
    ("validate_title", {}, "<<Rain>> falls.", 1.0),
    ("validate_choice", {"options": ["My answer is yes.", "My answer is no.", "My answer is maybe."]},
     "My answer is no.", 1.0),
    ("validate_highlighted_sections", {"N": 2}, "*one* and *two*", 1.0),
    ("validate_highlighted_sections", {"N": 2}, "*one* only", 0.0),
    ("validate_sections", {"N": 2, "section_splitter": "SECTION"}, "SECTION 1\nA.\nSECTION 2\nB.", 1.0),
    ("validate_json_format", {}, '{"answer": 4}', 1.0),
    ("validate_repeat_prompt", {"original_prompt": "Say hi."}, "Say hi. Hi!", 1.0),
    ("validate_repeat_prompt", {"original_prompt": "Say hi."}, "Hi!", 0.0),
    ("validate_two_responses", {}, "Yes.\n******\nNo.", 1.0),
    ("validate_uppercase", {}, "THE WEATHER IS VERY NICE TODAY AND I WENT FOR A WALK IN THE PARK", 1.0),
    ("validate_lowercase", {}, "The rain falls on the green hills all day long", 0.0),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "at least"}, "The NASA and ESA teams met.", 1.0),
    ("validate_end", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", 1.0),
    ("validate_quotation", {}, '"Quoted."', 1.0),
    ("validate_no_commas", {}, "Yes, a comma.", 0.0),
])
def test_roll_rows_score_as_roll(func_name, args, response, expected):
    assert ifeval.ifeval_reward("p", response, roll_truth(func_name, **args)) == expected


@pytest.mark.parametrize("func_name,args,response,expected", [
    # ROLL's function compares every word with itself (it counts all words); "N times" is exact here
    ("verify_keyword_frequency", {"word": "cat", "N": 2}, "A cat met a cat.", 1.0),
    ("verify_keyword_frequency", {"word": "cat", "N": 2}, "A cat met a cat and a cat.", 0.0),
    # IFEval's paragraph divider is *** (ROLL's function splits on "* * *")
    ("verify_paragraph_count", {"N": 2}, "First part.\n***\nSecond part.", 1.0),
    ("verify_paragraph_count", {"N": 3}, "First part.\n***\nSecond part.", 0.0),
    # options written as a tuple's text (ROLL's function iterates over its characters)
    ("validate_choice", {"options": "('My answer is yes.', 'My answer is no.', 'My answer is maybe.')"},
     "My answer is maybe.", 1.0),
])
def test_where_roll_functions_differ_ifeval_rules_hold(func_name, args, response, expected):
    assert ifeval.ifeval_reward("p", response, roll_truth(func_name, **args)) == expected


def test_every_roll_function_maps_to_an_ifeval_instruction():
    _, registry, _ = ifeval.lm_eval_ifeval()
    assert len(ifeval.ROLL_FUNC_NAMES) == 25  # ROLL's IF_FUNCTIONS_MAP
    targets = {iid for iid, _ in ifeval.ROLL_RENAMED.values()}
    targets |= {c.instruction_id for c in ifeval.ROLL_COUNTED.values()}
    assert targets <= set(registry.INSTRUCTION_DICT) and len(targets) == 25


def test_reasoning_is_dropped_and_metrics_travel_with_the_score():
    truth = roll_truth("validate_lowercase")
    score = ifeval.ifeval_reward("p", "<think>Hmm, Mixed Case.</think>\n\nthe rain falls on the green hills", truth)
    assert isinstance(score, ScoreWithMetrics) and score == 1.0 and score.metrics["prompt_level_strict_acc"] == 1.0
    process = RewardProcess(ifeval.ifeval_reward, timeout_s=30)  # forked child, pickled back
    try:
        [(got, status, _)] = process.score_many([("p", "The Rain", truth)])
    finally:
        process.close()
    assert status == "ok" and got == 0.0 and got.metrics["inst_level_loose_acc"] == 0.0


@pytest.mark.parametrize("truth,named", [
    (roll_truth("validate_lowercse"), "unknown instruction 'validate_lowercse' (did you mean 'validate_lowercase'?)"),
    (json.dumps({"instruction_id_list": ["punctuation:no_comma", "nope:none"], "kwargs": [{}, {}]}),
     "unknown instruction 'nope:none'"),
    (roll_truth("verify_keywords"), "verify_keywords: missing keyword_list"),
    (roll_truth("validate_word_constraint", N=3, quantifier="roughly"), "quantifier 'roughly'"),
    (json.dumps({"instruction_id_list": ["keywords:existence"], "kwargs": [{}]}),
     "'keywords:existence': bad kwargs {} (it takes ['keywords'])"),
    (json.dumps({"instruction_id_list": ["keywords:letter_frequency"],
                 "kwargs": [{"letter": "ab", "let_frequency": 2, "let_relation": "at least"}]}),
     "lm-eval would draw one at random"),
    (json.dumps({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"color": "red"}]}),
     "unexpected keyword argument 'color'"),
    (roll_truth("validate_choice", options=["A", "B"]), "validate_choice: options ['A', 'B'] differ"),
    ("not json {", "neither JSON nor a Python literal"),
    (json.dumps({"answer": 3}), "names no instructions"),
])
def test_bad_rows_raise_naming_the_problem(truth, named):
    with pytest.raises(ValueError) as info:
        ifeval.ifeval_reward("p", "some answer", truth)
    assert named in str(info.value), str(info.value)


def test_ground_truth_forms():
    python_repr = str({"func_name": "validate_end", "end_phrase": "Bye.", "N": None})  # a dict column as text
    assert ifeval.parse_ground_truth(python_repr) == (["validate_end"], [{"end_phrase": "Bye.", "N": None}])
    ids, kwargs = ifeval.parse_ground_truth({"instruction_id_list": ["a", "b"], "kwargs": None})
    assert ids == ["a", "b"] and kwargs == [{}, {}]
    with pytest.raises(ValueError, match="2 instruction ids but 1 kwargs"):
        ifeval.parse_ground_truth({"instruction_id_list": ["a", "b"], "kwargs": [{}]})


# ------------------------------------------------------------------------ offline nltk data
def test_lm_eval_imports_offline_from_a_fresh_home(tmp_path):
    """No nltk data anywhere: the English Punkt model is written from the pip package where
    nltk.download would put it, and nothing reaches for the network."""
    script = textwrap.dedent("""
        import json, sys
        events = []
        sys.addaudithook(lambda ev, args: events.append(ev) if ev in ("socket.connect", "socket.getaddrinfo",
                                                                      "urllib.Request") else None)
        import nltk
        from nltk.downloader import Downloader
        try:
            nltk.data.find("tokenizers/punkt_tab/english/")
            had = True
        except LookupError:
            had = False
        from roll_gspo.rewards import ifeval
        _, _, utils = ifeval.lm_eval_ifeval()
        print(json.dumps([had, Downloader().default_download_dir(), ifeval.ensure_punkt_tab(), events]))
    """)
    env = {**os.environ, "HOME": str(tmp_path), "NLTK_DATA": ""}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    had, download_dir, folder, events = json.loads(out.stdout.strip().splitlines()[-1])
    assert events == [] and "Downloaded" not in out.stdout + out.stderr
    if not had:  # a machine with nltk data of its own keeps using it
        assert folder == os.path.join(download_dir, "tokenizers", "punkt_tab", "english")
        assert sorted(os.listdir(folder)) == ["abbrev_types.txt", "collocations.tab", "ortho_context.tab",
                                              "sent_starters.txt"]


# ------------------------------------------------------------------------ the worker
def test_worker_in_process_scores_counts_errors_and_reports_metrics():
    from roll_gspo.workers.rewards import IFEvalRewardWorker

    worker = make_worker(IFEvalRewardWorker, reward_type="soft")
    two = json.dumps({"instruction_id_list": ["punctuation:no_comma", "keywords:existence"],
                      "kwargs": [{}, {"keywords": ["sun"]}]})
    out = worker.compute_scores(batch_of(
        ["p"] * 4, ["the sun is out", "the sun, again", "anything", "<think>unfinished"],
        [two, two, roll_truth("validate_lowercas"), two]))
    worker.close()
    assert out["scores"].tolist() == [1.0, 0.5, 0.0, 0.0]
    assert out["reward_status"] == ["ok", "ok", "error", "format"]
    assert out["reward_correct"] == [1.0, 0.0, 0.0, 0.0]
    assert out["reward_metrics"][1] == {"prompt_level_strict_acc": 0.0, "inst_level_strict_acc": 0.5,
                                        "prompt_level_loose_acc": 0.0, "inst_level_loose_acc": 0.5}
    assert out["reward_metrics"][2:] == [None, None]
    with pytest.raises(ValueError, match="reward_kwargs: \\['strict'\\] unknown"):
        make_worker(IFEvalRewardWorker, reward_kwargs={"strict": False})


def test_error_rows_are_logged_with_the_instruction(caplog):
    from roll_gspo.workers.rewards import IFEvalRewardWorker

    worker = make_worker(IFEvalRewardWorker, timeout_s=0)  # in this process
    out = worker.compute_scores(batch_of(["p"], ["x"], [roll_truth("validate_foo")]))
    assert out["reward_status"] == ["error"] and "unknown instruction 'validate_foo'" in caplog.text


def test_domain_metrics_average_what_the_workers_report():
    from pipelines.reward_scoring import reward_metrics

    batch = Batch({"scores": torch.tensor([1.0, 0.0, 0.0, 1.0])},
                  {"domain": ["ifeval", "ifeval", "ifeval", "math"], "reward_status": ["ok", "ok", "error", "ok"],
                   "reward_metrics": [{"prompt_level_strict_acc": 1.0}, {"prompt_level_strict_acc": 0.0}, None, None]})
    metrics = reward_metrics(batch, prefix="val")
    assert metrics["val/ifeval/prompt_level_strict_acc"] == 0.5 and metrics["val/ifeval/errors"] == 1.0
    assert not any(k.startswith("val/math/prompt") for k in metrics)


# ------------------------------------------------------------------------ built-in task, ROLL path
def compliant_answer(constraint):
    """An answer that follows a built-in row's one instruction."""
    kind = constraint["func_name"]
    return {"validate_lowercase": lambda: "the rain falls on the green hills all day long",
            "validate_uppercase": lambda: "THE WEATHER IS VERY NICE TODAY AND I WENT FOR A WALK IN THE PARK",
            "verify_keywords": lambda: f"it is {constraint.get('keyword_list', [''])[0]} today",
            "validate_end": lambda: f"It was a fine day. {constraint.get('end_phrase')}",
            "validate_no_commas": lambda: "it is fine",
            "validate_word_constraint": lambda: " ".join(["word"] * int(constraint.get("N") or 0)),
            "validate_quotation": lambda: '"it is fine"'}[kind]()


def test_builtin_task_rows_are_roll_rows_that_score(session_cache):
    from roll_gspo import builtin

    for split, size in (("train", 2000), ("val", 64)):
        path = builtin.resolve_data_file(f"builtin:ifeval/{split}")
        with open(path) as fh:
            rows = [json.loads(line) for line in fh]
        assert len(rows) == size and {r["tag"] for r in rows} == {"ifeval"}
        assert all(len(r["prompt"]) < 64 for r in rows)
    kinds = {}
    for row in rows:
        kinds.setdefault(json.loads(row["ground_truth"])["func_name"], row)
    assert len(kinds) == 7
    for kind, row in kinds.items():
        constraint = json.loads(row["ground_truth"])
        assert ifeval.ifeval_reward(row["prompt"], compliant_answer(constraint), row["ground_truth"]) == 1.0, kind
        assert ifeval.ifeval_reward(row["prompt"], "Yes, Sure", row["ground_truth"]) == 0.0, kind


def test_roll_class_path_maps_to_the_worker_and_passes_preflight(session_cache, monkeypatch):
    monkeypatch.chdir(ROLL_DIR)
    cfg = load_roll(GSPO, ["+rewards.ifeval={worker_cls: " + ROLL_PATH + ", tag_included: [ifeval]}"])
    assert cfg.rewards["ifeval"].worker_cls == "roll_gspo.workers.rewards.IFEvalRewardWorker"
    preflight(cfg)

import math

import pytest
import sacrebleu

from kiln.errors import DataError
from kiln.eval.genmetrics import all_metrics, as_reference_lists, bleu, chrf, exact_match, rouge


def test_exact_match_normalizes_whitespace_and_accepts_any_reference():
    preds = ["the  cat\nsat", "dog", "Bird"]
    refs = [["the cat sat"], ["cat", " dog "], ["bird"]]
    assert exact_match(preds, refs) == pytest.approx(2 / 3)


def test_bleu_by_hand():
    # 1- to 4-gram precisions 4/5, 3/4, 2/3, 1/2; equal lengths so no brevity penalty.
    expected = 100 * math.exp(sum(math.log(p) for p in (4 / 5, 3 / 4, 2 / 3, 1 / 2)) / 4)
    assert bleu(["a b c d e"], [["a b c d f"]]) == pytest.approx(expected, abs=1e-9)
    assert bleu(["the cat sat on the mat"], [["the cat sat on the mat"]]) == pytest.approx(100.0)


def test_bleu_brevity_penalty_by_hand():
    # Hypothesis of 4 tokens, reference of 6: all n-grams match, BP = exp(1 - 6/4).
    assert bleu(["a b c d"], [["a b c d e f"]]) == pytest.approx(100 * math.exp(1 - 6 / 4), abs=1e-9)


def test_bleu_and_chrf_are_corpus_level_with_ragged_references():
    preds = ["the cat sat on the mat", "a quick brown fox"]
    refs = [["the cat sat on a mat", "the cat is on the mat"], ["the quick brown fox"]]
    expected_bleu = sacrebleu.corpus_bleu(preds, [["the cat sat on a mat", "the quick brown fox"],
                                                  ["the cat is on the mat", None]]).score
    assert bleu(preds, refs) == pytest.approx(expected_bleu)
    # Corpus chrF pools character n-gram statistics, so it is not the mean of sentence scores.
    sentence_mean = (sacrebleu.sentence_chrf(preds[0], refs[0]).score
                     + sacrebleu.sentence_chrf(preds[1], refs[1]).score) / 2
    corpus = chrf(preds, refs)
    assert 0 < corpus < 100 and corpus != pytest.approx(sentence_mean, abs=1e-6)
    assert chrf(["same text"], [["same text"]]) == pytest.approx(100.0)


def test_rouge_by_hand_with_stemming():
    scores = rouge(["the cats sat"], [["the cat sat down"]])
    # Stemming makes "cats" match "cat": unigram P=3/3, R=3/4; bigram P=2/2, R=2/3; LCS = 3.
    assert scores["rouge1"] == pytest.approx(2 * 1 * 0.75 / 1.75)
    assert scores["rouge2"] == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert scores["rougeL"] == pytest.approx(2 * 1 * 0.75 / 1.75)


def test_rouge_takes_the_best_reference_and_averages_pairs():
    scores = rouge(["a b", "x y"], [["q r", "a b"], ["z w"]])
    assert scores["rouge1"] == pytest.approx(0.5)


def test_all_metrics_and_bad_input():
    metrics = all_metrics(["hello big wide world"], as_reference_lists(["hello big wide world"]))
    assert metrics["exact_match"] == 1.0 and metrics["bleu"] == pytest.approx(100.0)
    assert metrics["n"] == 1
    with pytest.raises(DataError, match="2 predictions but 1 references"):
        bleu(["a", "b"], [["a"]])
    with pytest.raises(DataError, match="no predictions"):
        rouge([], [])

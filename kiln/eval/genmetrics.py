"""Metrics for generated text against references: BLEU, chrF, ROUGE-1/2/L and exact match.

BLEU and chrF are sacrebleu's corpus-level scores (0-100); ROUGE is rouge-score's F-measure with
Porter stemming, averaged over pairs (0-1); exact match compares whitespace-normalized strings.
Each prediction may have one reference or several (a list).
"""

from __future__ import annotations

from kiln.errors import DataError


def normalize_whitespace(text: str) -> str:
    return " ".join(text.split())


def exact_match(predictions: list[str], references: list[list[str]]) -> float:
    """Fraction of predictions equal (after whitespace normalization) to any of their references."""
    _check(predictions, references)
    hits = sum(normalize_whitespace(p) in {normalize_whitespace(r) for r in refs}
               for p, refs in zip(predictions, references))
    return hits / len(predictions)


def _reference_streams(references: list[list[str]]) -> list[list[str]]:
    """sacrebleu wants one stream per reference position; pad ragged lists with None (ignored)."""
    width = max(len(refs) for refs in references)
    return [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]


def bleu(predictions: list[str], references: list[list[str]]) -> float:
    import sacrebleu

    _check(predictions, references)
    return float(sacrebleu.corpus_bleu(predictions, _reference_streams(references)).score)


def chrf(predictions: list[str], references: list[list[str]]) -> float:
    import sacrebleu

    _check(predictions, references)
    return float(sacrebleu.corpus_chrf(predictions, _reference_streams(references)).score)


def rouge(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1; with several references, the best-scoring one per prediction."""
    from rouge_score import rouge_scorer

    _check(predictions, references)
    kinds = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    totals = dict.fromkeys(kinds, 0.0)
    for prediction, refs in zip(predictions, references):
        scores = scorer.score_multi(refs, prediction)
        for kind in kinds:
            totals[kind] += scores[kind].fmeasure
    return {kind: total / len(predictions) for kind, total in totals.items()}


def all_metrics(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    return {"bleu": bleu(predictions, references), "chrf": chrf(predictions, references),
            **rouge(predictions, references), "exact_match": exact_match(predictions, references),
            "n": len(predictions)}


def as_reference_lists(references: list[str | list[str]]) -> list[list[str]]:
    return [[r] if isinstance(r, str) else list(r) for r in references]


def _check(predictions: list[str], references: list[list[str]]) -> None:
    if not predictions:
        raise DataError("no predictions to score")
    if len(predictions) != len(references):
        raise DataError(f"{len(predictions)} predictions but {len(references)} references")
    for i, refs in enumerate(references):
        if not refs or not all(isinstance(r, str) for r in refs):
            raise DataError(f"reference {i} must be a string or a non-empty list of strings")

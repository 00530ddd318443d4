"""Scores: sacreBLEU and chrF on detokenized text, and a tokenized lower-cased BLEU for comparison with older
papers.

Detokenized sacreBLEU is the number to quote: it tokenizes hypotheses and references itself and prints a
signature that says exactly how. Many tutorials on Multi30k instead report BLEU over lower-cased spaCy tokens
(what ``torchtext``'s ``bleu_score`` saw); :func:`tokenized_bleu` reproduces that setting so the numbers can be
compared, and says so in its signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} = {self.score:.2f}  ({self.signature})"


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references; they must pair up")
    if not hypotheses:
        raise ValueError("nothing to score: no hypotheses")


def bleu_tokenizer_for(language: str | None) -> str:
    """sacreBLEU's tokenizer for a target language: ``zh`` for Chinese, ``13a`` (its default) otherwise."""
    return "zh" if language and language.lower().startswith("zh") else "13a"


def bleu(hypotheses: Sequence[str], references: Sequence[str], *, language: str | None = None) -> Score:
    """Corpus BLEU (Papineni et al. 2002) on detokenized text, by sacreBLEU."""
    from sacrebleu.metrics import BLEU

    _check(hypotheses, references)
    metric = BLEU(tokenize=bleu_tokenizer_for(language))
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return Score("BLEU", result.score, str(metric.get_signature()))


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
    """chrF (Popović 2015): character n-gram F-score, by sacreBLEU."""
    from sacrebleu.metrics import CHRF

    _check(hypotheses, references)
    metric = CHRF()
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return Score("chrF", result.score, str(metric.get_signature()))


def check_tokenized_bleu() -> None:
    """Raise ValueError, saying how to install it, if spaCy (an optional extra of qkv) is missing."""
    import importlib.util

    if importlib.util.find_spec("spacy") is None:
        raise ValueError("tokenized BLEU needs spaCy's tokenizer, an optional extra: pip install 'qkv[bleu]' "
                         "(or pip install spacy)")


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], *, language: str = "en") -> Score:
    """BLEU over lower-cased spaCy tokens, the setting of the usual Multi30k tutorials (36.5 for a 9M
    Transformer de→en). Uses spaCy's rule-based tokenizer only (``spacy.blank``): no model download."""
    check_tokenized_bleu()
    import spacy
    from sacrebleu.metrics import BLEU

    _check(hypotheses, references)
    nlp = spacy.blank(language)

    def tokenize(texts: Sequence[str]) -> list[str]:
        return [" ".join(t.text for t in doc if not t.is_space) for doc in nlp.pipe(t.lower() for t in texts)]

    metric = BLEU(tokenize="none", force=True)
    result = metric.corpus_score(tokenize(hypotheses), [tokenize(references)])
    return Score("tokenized BLEU", result.score, f"lowercase, spacy.blank({language!r}) tokens, sacrebleu tok:none")

